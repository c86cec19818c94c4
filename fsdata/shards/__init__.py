"""The shards layer: the on-disk shard format, its writer and its verifier (docs/format.md).

* :mod:`~fsdata.shards.manifest`: the format itself: version, root file names, step stats, file digests, the
  :class:`~fsdata.shards.manifest.Manifest` dataclass with ``write``/``read`` (the one reader,
  also used by ``fstrain``);
* :mod:`~fsdata.shards.plan_file`: the plan file (:class:`~fsdata.shards.plan_file.PlanTable`, its digest,
  ``write_plan`` / ``read_plan``);
* :mod:`~fsdata.shards.writer`: the rank-file writer (``write_rank``, the one every engine calls);
* :mod:`~fsdata.shards.finalize`: the root files, manifest last;
* :mod:`~fsdata.shards.verify`: ``fsdata verify``, every invariant of a written output.

Imports the base, samples and balancer layers; the manifest module imports the base layer only, so
``fstrain`` reads shards without pulling in the writer.
"""
