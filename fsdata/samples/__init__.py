"""The samples layer: what a training sample is and how fsdata reads, converts and makes samples.

* :mod:`~fsdata.samples.schema`: the sample columns and their Arrow types (docs/format.md);
* :mod:`~fsdata.samples.io`: opening Parquet input and reading sequence lengths;
* :mod:`~fsdata.samples.diagnose`: one-line diagnoses of bad input;
* :mod:`~fsdata.samples.convert`: public datasets to the sample schema;
* :mod:`~fsdata.samples.holdout`: the last-interaction hold-out split;
* :mod:`~fsdata.samples.synth`: synthetic samples from a length distribution.
* :mod:`~fsdata.samples.settings`: :class:`~fsdata.samples.settings.ConvertSettings`, the settings of a conversion.

Imports only the base layer (:mod:`fsdata.errors`, :mod:`fsdata.atomic`, :mod:`fsdata.guards`).
"""
