"""What fsdata, fstrain and the pipelines share below every layer: the CLI toolkit
(:mod:`fsdata.common.cli`), the registry type (:mod:`fsdata.common.registry`) and the HTML page
writer (:mod:`fsdata.common.page`)."""
