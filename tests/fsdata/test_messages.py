"""Messages that name the real problem (not "corrupt"), convert's warnings and line numbers, quiet
broken pipes, and progress bars only on a terminal."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdata.common import cli as cliutil
from fsdata.cli import main
from tests.conftest import REPO_ROOT
from tests.fsdata.helpers import write_samples

SMALL = ["--ranks", "2", "--batch-size-per-rank", "2"]


def _err_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("fsdata: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _run(command, inp, tmp_path, *extra):
    out = [str(tmp_path / "out")] if command == "balance" else []
    return main([command, str(inp), *out, *SMALL, "--no-progress", *extra])


@pytest.mark.parametrize("command", ["profile", "balance"])
def test_columns_naming_a_missing_column(tmp_path, capsys, command):
    inp = write_samples(tmp_path / "in.parquet", n=16)
    assert _run(command, inp, tmp_path, "--columns", "sample_id=nope") == 2
    line = _err_line(capsys)
    assert "no column 'nope'" in line and "--columns" in line and "corrupt" not in line
    assert not (tmp_path / "out").exists()


def test_columns_mapping_onto_an_existing_column(tmp_path, capsys):
    t = pq.read_table(write_samples(tmp_path / "a.parquet", n=16))
    pq.write_table(t.append_column("id", pa.array(range(100, 116), pa.int64())), tmp_path / "in.parquet")
    assert _run("profile", tmp_path / "in.parquet", tmp_path, "--columns", "sample_id=id") == 2
    line = _err_line(capsys)
    assert "already has a column 'sample_id'" in line and "corrupt" not in line


def _uint64_ids(path: Path, top: int) -> Path:
    t = pq.read_table(write_samples(path.with_suffix(".src.parquet"), n=16))
    ids = pa.array([top - i for i in range(16)], pa.uint64())
    pq.write_table(t.set_column(0, "sample_id", ids), path)
    return path


@pytest.mark.parametrize("command", ["profile", "balance"])
def test_uint64_ids_above_int64(tmp_path, capsys, command):
    inp = _uint64_ids(tmp_path / "in.parquet", 2**64 - 1)
    assert _run(command, inp, tmp_path) == 2
    line = _err_line(capsys)
    assert "uint64" in line and str(2**64 - 1) in line and "int64 maximum" in line and "remap" in line
    assert "corrupt" not in line and not (tmp_path / "out").exists()


def test_uint64_ids_within_int64_are_fine(tmp_path, capsys):
    inp = _uint64_ids(tmp_path / "in.parquet", 2**63 - 1)
    assert _run("profile", inp, tmp_path) == 0


@pytest.mark.parametrize("command", ["profile", "balance"])
@pytest.mark.parametrize("text", ["1 5 6 7\n2 8 9\n", "userId,Id,rating,timestamp\n1,2,3.5,964982703\n"])
def test_text_log_says_run_convert_first(tmp_path, capsys, command, text):
    log = tmp_path / "log.txt"
    log.write_text(text)
    assert _run(command, log, tmp_path) == 2
    line = _err_line(capsys)
    assert "looks like a text log" in line and "fsdata convert" in line and "corrupt" not in line
    assert log.read_text() == text


def test_truncated_parquet_still_says_corrupt(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=64)
    inp.write_bytes(inp.read_bytes()[:300])
    assert _run("profile", inp, tmp_path) == 2
    assert "corrupt or truncated" in _err_line(capsys)


def _ratings(tmp_path) -> Path:
    p = tmp_path / "ratings.csv"
    p.write_text("userId,movieId,rating,timestamp\n1,10,4.0,300\n1,11,3.0,100\n1,12,5.0,200\n"
                 "2,10,4.0,50\n2,13,4.0,40\n")
    return p


def test_convert_warns_about_an_unused_time_column(tmp_path, caplog):
    src = _ratings(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fsdata.convert"):
        assert main(["convert", str(src), str(tmp_path / "a.parquet"), "--format", "events", "--user-col", "userId",
                     "--item-col", "movieId", "--no-progress"]) == 0
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1 and "'timestamp'" in warns[0] and "--time-col timestamp" in warns[0]
    assert "\n" not in warns[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fsdata.convert"):
        assert main(["convert", str(src), str(tmp_path / "b.parquet"), "--format", "events", "--user-col", "userId",
                     "--item-col", "movieId", "--time-col", "timestamp", "--no-progress"]) == 0
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_sequences_parse_error_names_file_and_line(tmp_path, capsys):
    src = tmp_path / "seq.txt"
    src.write_text("1 2 3\n\n2 4 5\n3 6 x7 8\n")
    assert main(["convert", str(src), str(tmp_path / "o.parquet"), "--format", "sequences", "--no-progress"]) == 2
    line = _err_line(capsys)
    assert str(src) in line and "line 4" in line and "'x7'" in line
    assert not (tmp_path / "o.parquet").exists()


def test_events_parse_error_names_file_line_and_column(tmp_path, capsys):
    src = tmp_path / "ev.csv"
    # ids may be strings; a time must be a number or an ISO 8601 string
    src.write_text("user,item,ts\n1,10,5\n1,11,6\n2,12,1x2\n")
    assert main(["convert", str(src), str(tmp_path / "o.parquet"), "--format", "events", "--user-col", "user",
                 "--item-col", "item", "--time-col", "ts", "--no-progress"]) == 2
    line = _err_line(capsys)
    assert str(src) in line and "line 4" in line and "column 'ts'" in line and "'1x2'" in line
    src.write_text("user,item\n1,10\n1,\n")
    assert main(["convert", str(src), str(tmp_path / "o.parquet"), "--format", "events", "--user-col", "user",
                 "--item-col", "item", "--no-progress"]) == 2
    line = _err_line(capsys)
    assert "line 3" in line and "column 'item'" in line and "empty" in line


def test_missing_rank_folder_is_named_missing(tmp_path):
    pytest.importorskip("torch")
    import shutil

    from fstrain.data import infer_num_items, load_manifest
    from fstrain.errors import ShardError

    inp = write_samples(tmp_path / "in.parquet", n=64)
    out = tmp_path / "out"
    assert main(["balance", str(inp), str(out), "--ranks", "2", "--batch-size-per-rank", "4", "--partitioner",
                 "lpt-swap", "--no-progress"]) == 0
    m = load_manifest(str(out))
    shutil.rmtree(Path(m.rank_file(1)).parent)
    with pytest.raises(ShardError, match="is missing") as e:
        infer_num_items(m)
    assert "corrupt" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# broken pipes


def _closed_stdout(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` with a stdout pipe whose reader is gone before the command writes (like ``| head``
    that already exited)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=300)
    return subprocess.CompletedProcess(cmd, proc.returncode, "", err)


@pytest.mark.parametrize("argv", [
    ["-m", "fsdata", "--help"],
    ["-m", "fsdata", "profile", "{inp}", "--ranks", "2", "--batch-size-per-rank", "4", "--json"],
    ["-m", "fstrain.cli", "--help"],
    ["-m", "pipelines.nightly", "--help"],
    ["-m", "pipelines.nightly", "--input", "{inp}", "--format", "samples", "--output", "{tmp}/w", "--ranks", "2",
     "--batch-size-per-rank", "4", "--partitioner", "lpt-swap", "--json"],
])
def test_broken_pipe_exits_quietly(tmp_path, argv):
    inp = write_samples(tmp_path / "in.parquet", n=64)
    cmd = [sys.executable] + [a.format(inp=inp, tmp=tmp_path) for a in argv]
    r = _closed_stdout(cmd)
    assert r.returncode in (0, cliutil.EXIT_BROKEN_PIPE), r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr and "Exception ignored" not in r.stderr


# ---------------------------------------------------------------------------------------------
# progress bars


def test_progress_only_on_a_terminal_unless_forced(tmp_path, capsys, monkeypatch):
    inp = write_samples(tmp_path / "in.parquet", n=64)
    args = ["balance", str(inp), None, "--ranks", "2", "--batch-size-per-rank", "4", "--partitioner", "lpt-swap"]
    monkeypatch.delenv(cliutil.PROGRESS_ENV, raising=False)

    def stderr_of(i, *extra):
        a = list(args)
        a[2] = str(tmp_path / f"o{i}")
        assert main([*a, *extra]) == 0
        return capsys.readouterr().err

    assert "gather rows by rank" not in stderr_of(0) and "\r" not in stderr_of(1)  # captured stderr is no TTY
    assert "gather rows by rank" in stderr_of(2, "--progress")
    monkeypatch.setenv(cliutil.PROGRESS_ENV, "1")
    assert "gather rows by rank" in stderr_of(3)
    assert "gather rows by rank" not in stderr_of(4, "--no-progress")


def test_resolve_progress(monkeypatch):
    monkeypatch.delenv(cliutil.PROGRESS_ENV, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert cliutil.resolve_progress(None) is True and cliutil.resolve_progress(False) is False
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert cliutil.resolve_progress(None) is False and cliutil.resolve_progress(True) is True
    monkeypatch.setenv(cliutil.PROGRESS_ENV, "1")
    assert cliutil.resolve_progress(None) is True
    monkeypatch.setenv(cliutil.PROGRESS_ENV, "off")
    assert cliutil.resolve_progress(None) is False
