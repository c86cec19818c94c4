"""The Ray engine of ``fsdata balance``: the stages as Ray tasks, byte-identical to the local engine.

Stages (docs/cluster.md has the commands and what runs where):

1. **lengths** (:mod:`~fsdata.engines.ray.chunks`; Ray tasks, one per *chunk* = a run of whole row
   groups of one input file, about :data:`~fsdata.engines.ray.chunks.CHUNK_ROWS` rows): read
   ``sample_id`` and the sequence length plus the validation counts (nulls, empty histories,
   misaligned ``timestamps``); the local engine's errors, word for word.
2. **plan** (:mod:`~fsdata.engines.ray.plan`): under the fixed policy (or the shuffle strategy)
   one Ray task per window of steps plans it with the local engine's per-window function and the
   driver combines the window summaries, never holding N rows; under cost-budget the driver plans
   the gathered costs with the local engine's call (O(N)). Either way a
   :class:`~fsdata.shards.plan_file.PlanTable` equal to the local engine's.
3. **partition**, 4. **write**, 5. **verify** (:mod:`~fsdata.engines.ray.write`; Ray tasks per
   chunk and per rank group): rows routed to rank groups through the Ray object store
   (:mod:`fsdata.engines.routing`, as the local engine routes), each rank file written by
   :func:`fsdata.shards.writer.write_rank` (the local engine's writer), then re-read and checked.
6. **finalize** (driver): :func:`fsdata.shards.finalize.finalize`, run by
   :meth:`fsdata.engines.base.Engine.run` as for every engine.

:mod:`~fsdata.engines.ray.session` joins or starts Ray once per run
(:func:`~fsdata.engines.ray.session.ray_session`) and ends what it started. The engine itself is
:class:`~fsdata.engines.ray.engine.RayEngine`, registered as ``ray``.

The OUTPUT (and its temporary sibling) must be on storage every node sees: a shared file system,
or an object store named by a URI (``s3://bucket/prefix``; :mod:`fsdata.fsio`), which the write and
verify tasks reach through :mod:`pyarrow.fs` (then published as :mod:`fsdata.atomic` describes for
object stores). The input is read through :mod:`pyarrow.fs` too (``FileSystem.from_uri`` for URIs).
Nothing is written when any stage fails: the temporary folder (or the written prefix) is removed
and pending tasks are cancelled. Ray itself is imported only when a run starts.
"""

from fsdata.engines.ray.chunks import Chunk, make_chunks
from fsdata.engines.ray.engine import RayEngine
from fsdata.engines.ray.plan import plan_windowed
from fsdata.engines.ray.session import ray_session
from fsdata.engines.ray.write import group_bounds, write_ranks

__all__ = ["Chunk", "RayEngine", "group_bounds", "make_chunks", "plan_windowed", "ray_session", "write_ranks"]
