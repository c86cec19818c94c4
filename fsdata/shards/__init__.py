"""The shards layer: the on-disk shard format, its writer and its verifier (docs/format.md).

* :mod:`~fsdata.shards.manifest`: the format itself: the
  :class:`~fsdata.shards.manifest.Manifest` dataclass with ``write``/``read`` (the one reader,
  also used by ``fstrain``), exporting the names of :mod:`~fsdata.shards.layout` (version, root
  file names, rank file paths, step stats, file digests);
* :mod:`~fsdata.shards.plan_file`: the plan file (:class:`~fsdata.shards.plan_file.PlanTable`, its digest,
  ``write_plan`` / ``read_plan``);
* :mod:`~fsdata.shards.writer`: the rank-file writer (``write_rank``, the one every engine calls);
* :mod:`~fsdata.shards.finalize`: the root files, manifest last;
* :mod:`~fsdata.shards.verify`: ``fsdata verify``, every invariant of a written output (a package:
  the manifest's records, the output files, epochs, the input).

Imports the base, samples and balancer layers; the manifest and layout modules import the base
layer only, so ``fstrain`` reads shards without pulling in the writer.
"""
