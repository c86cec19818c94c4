"""Importing and reading with fstrain prints nothing on stderr; only known library noise is filtered."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.fstrain.shards import write_shards

_READ = """
import sys

import pytest
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
    r = _run("import logging, fstrain\n"
             "logging.getLogger('fstrain.train').warning('our own warning')\n"
             "logging.getLogger('torch.fx._symbolic_trace').warning('another torch.fx line')")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "our own warning" in r.stderr and "another torch.fx line" in r.stderr, r.stderr[-3000:]
    r = _run("import logging, fstrain; logging.basicConfig(); "
             "logging.getLogger('fstrain.pipelines').warning('pipeline pec: not on CPU')")
    assert r.returncode == 0 and "pipeline pec: not on CPU" in r.stderr, r.stderr[-3000:]


def test_known_noise_is_dropped_and_everything_else_passes():
    """The entry points' filter drops exactly the known library lines; ours and other library lines pass; -v undoes
    it."""
    import logging
    import warnings

    from fstrain.quiet import LOG_NOISE, WARNING_NOISE, show_all_noise, silence_known_noise

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    def emit_all() -> list[str]:
        records.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            silence_known_noise() if quiet else show_all_noise()
            for category, message in WARNING_NOISE:
                warnings.warn(message.replace("\\", "") + " (library)", category)
            warnings.warn("cuda-ce falls back to NCCL kernels: ours", UserWarning)
            warnings.warn("some other library FutureWarning", FutureWarning)
            for name, prefixes in LOG_NOISE.items():
                logging.getLogger(name).warning("%s and more", prefixes[0])
                logging.getLogger(name).warning("another message of that logger")
            logging.getLogger("fstrain.pipelines").warning("pipeline pec: ours")
        return records + [str(w.message) for w in caught]

    handler = Keep()
    loggers = [logging.getLogger(n) for n in (*LOG_NOISE, "fstrain.pipelines")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        quiet = True
        shown = emit_all()
        assert sorted(shown) == sorted(["cuda-ce falls back to NCCL kernels: ours", "some other library FutureWarning",
                                        "pipeline pec: ours"] + ["another message of that logger"] * len(LOG_NOISE))
        quiet = False
        shown = emit_all()
        assert len(shown) == 3 + 2 * len(LOG_NOISE) + len(WARNING_NOISE), shown
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        show_all_noise()
        from fstrain.quiet import silence_import_noise

        silence_import_noise()


_NOISE = ("TopologyFactory", "HeuristicalStorageReservation", "dense tensor size calculation", "broadcast_buffers",
          "deprecating ShardedTensor", "is_fx_tracing")


@pytest.mark.slow  # two real `fstrain train` runs and one `fstrain evaluate` (about 1-2 min on 2 idle cores)
@pytest.mark.timeout(1800)  # three interpreters importing torchrec: minutes each on a loaded machine
def test_train_and_evaluate_are_quiet_and_verbose_shows_the_noise(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=3, batch_size_per_rank=4)
    small = ["--embedding-dim", "16", "--num-negatives", "8", "--num-layers", "1", "--max-seq-len", "64"]
    code = "import sys; from fstrain.cli import main; sys.exit(main(sys.argv[1:]))"
    ckpt = str(tmp_path / "ck")
    r = _run_args(code, "train", out, *small, "--checkpoint-dir", ckpt, "--log-every-steps", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [n for n in _NOISE if n in r.stderr], r.stderr[-3000:]
    assert "INFO fstrain.train: step 3 loss" in r.stderr, r.stderr[-3000:]  # our own lines stay
    from tests.fstrain.test_evaluate import _eval_file

    ev = _eval_file(tmp_path / "e.parquet")
    r = _run_args(code, "evaluate", os.path.join(ckpt, "step-00000003"), ev, "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    r = _run_args(code, "train", out, *small, "--pipeline", "prioritized", "-v")  # the control: the noise is real
    assert r.returncode == 0, r.stderr[-3000:]
    missing = [n for n in _NOISE if n not in r.stderr]
    assert not missing, (missing, r.stderr[-3000:])


def _run_args(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600,
                          cwd=REPO_ROOT)
