"""Importing and reading with fstrain prints nothing on stderr; only known library noise is filtered."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO_ROOT
from tests.fstrain.shards import write_shards

_READ = """
import sys
import fstrain.data, fstrain.train
{extra}
from fstrain.data import ShardDataset
steps = [s.step for s in ShardDataset({out!r}, 0, 1)]
assert steps == [0, 1, 2], steps
"""

#: Undoes fstrain's filter: the control below proves the filtered line really comes from the libraries.
_UNFILTER = "import logging; logging.getLogger('torch.fx._symbolic_trace').filters.clear()"


def _run(code: str, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO_ROOT)


def test_import_and_read_print_nothing(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=3, batch_size_per_rank=2)
    r = _run(_READ.format(out=out, extra=""))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == "", r.stderr[-3000:]


def test_filtered_line_is_real_library_noise_and_our_warnings_stay(tmp_path):
    """Control: without fstrain's filter torch logs its fx line; fstrain's own warnings still show."""
    out = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=3, batch_size_per_rank=2)
    r = _run(_READ.format(out=out, extra=_UNFILTER))
    assert r.returncode == 0 and "is_fx_tracing will return true" in r.stderr, r.stderr[-3000:]
    r = _run("import logging, fstrain; logging.basicConfig(); "
             "logging.getLogger('fstrain.pipelines').warning('pipeline pec: not on CPU')")
    assert r.returncode == 0 and "pipeline pec: not on CPU" in r.stderr, r.stderr[-3000:]
