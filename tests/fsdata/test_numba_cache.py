"""The one-time Numba compilation is cached on disk where the user chose (NUMBA_CACHE_DIR): a second
process compiles nothing (docs/api.md, "The first fsdata.balance() in a new environment compiles")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

_BALANCE = """
import json
from pathlib import Path
from numba.core.registry import CPUDispatcher
import fsdata
from fsdata.balancer import bubble, compose, cost_budget, order, partition_fast, windows
from tests.fsdata.helpers import write_samples
inp = write_samples(Path({inp!r}), n=600, seed=2)
fsdata.balance(inp, {out!r}, fsdata.BalanceSettings(num_ranks=2, batch_size_per_rank=8, overwrite=True,
                                                    progress=False))
stats = {{}}
for mod in (bubble, compose, cost_budget, order, partition_fast, windows):
    for name, f in vars(mod).items():
        if isinstance(f, CPUDispatcher):
            stats[f"{{mod.__name__}}.{{name}}"] = [sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values())]
print(json.dumps(stats))
"""


@pytest.mark.slow
def test_second_process_loads_every_kernel_from_the_cache(tmp_path):
    cache = tmp_path / "numba-cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    code = _BALANCE.format(inp=str(tmp_path / "in.parquet"), out=str(tmp_path / "out"))

    def run() -> dict[str, list[int]]:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = run()
    used = {k for k, (hits, misses) in first.items() if hits + misses}
    assert "fsdata.balancer.partition_fast._lpt_swap_steps" in used, first
    assert all(first[k][1] > 0 for k in used), f"a fresh NUMBA_CACHE_DIR must compile: {first}"
    assert list(cache.rglob("*.nbi")) and list(cache.rglob("*.nbc")), "the cache lies in NUMBA_CACHE_DIR"
    second = run()
    # kernels called from Python load from the cache (those called only from other kernels are inlined
    # into their callers' cached code and not touched at all); nothing compiles
    assert second["fsdata.balancer.partition_fast._lpt_swap_steps"][0] > 0, second
    assert any(h for h, _ in second.values()) and all(m == 0 for _, m in second.values()), \
        f"second process compiled: {second}"
    assert {k for k, (h, m) in second.items() if h + m} <= used
