"""The ``ray`` engine: the stages of ``fsdata balance`` as Ray tasks, byte-identical to ``local``."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from fsdata.balancer.cost import CostModel
from fsdata.engines.base import Engine, register
from fsdata.engines.ray import plan as ray_plan
from fsdata.engines.ray.chunks import Chunk, make_chunks
from fsdata.engines.ray.session import ray_session
from fsdata.engines.ray.write import write_ranks
from fsdata.samples.io import SampleSource
from fsdata.shards.manifest import FileEntry
from fsdata.shards.plan_file import PlanTable

log = logging.getLogger("fsdata.engines.ray")


@register("ray")
class RayEngine(Engine):
    """The stages as Ray tasks on a Ray cluster (``settings.ray_address``, else ``RAY_ADDRESS``, else
    a Ray instance started for the run; :mod:`fsdata.engines.ray`). Plans and writes one epoch."""

    max_epochs = 1
    stages = ("ray_connect", "read_lengths", "plan", "write_ranks", "verify", "finalize")

    def __init__(self, settings):
        super().__init__(settings)
        self._ray = None
        self._chunks: list[Chunk] | None = None
        self._chunk_plans: list | None = None
        self._nodes: set = set()

    @contextlib.contextmanager
    def session(self, timings: dict[str, float]) -> Iterator[object]:
        """Join or start Ray once for the run (``ray_connect`` seconds); the plan's object refs live in it."""
        t0 = time.perf_counter()
        with ray_session(self.settings.ray_address) as ray:
            timings["ray_connect"] = time.perf_counter() - t0
            self._ray = ray
            try:
                yield ray
            finally:
                self._ray = None
        if self._nodes:
            log.info("ray engine: tasks ran on %d Ray nodes; stage seconds %s", len(self._nodes), timings)

    def plan(self, src: SampleSource, cost_model: CostModel, *, timings: dict[str, float]) -> PlanTable:
        self._chunks = make_chunks(src)
        table, self._chunk_plans, self._nodes = ray_plan.plan(self._ray, src, self.settings, self._chunks, cost_model,
                                                              timings)
        return table

    def write_ranks(self, src: SampleSource, plan: PlanTable, output: str | os.PathLike, *,
                    timings: dict[str, float] | None = None) -> list[FileEntry]:
        return write_ranks(src, plan, output, self.settings, chunks=self._chunks, timings=timings, nodes=self._nodes,
                           chunk_plans=self._chunk_plans)
