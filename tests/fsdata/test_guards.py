"""Outputs never overlap inputs; environment failures (disk full, read-only, permission denied) are
named as such, exit 2, and leave nothing behind (fsdata.guards)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fsdata.cli import main
from fsdata.guards import environment_errno, environment_error, overlap, process_alive, public_path
from tests.conftest import REPO_ROOT
from tests.fsdata.helpers import write_samples

BAL = ["--ranks", "2", "--batch-size-per-rank", "4", "--partitioner", "lpt-swap", "--no-progress"]


def _digest(path: Path) -> dict[str, str]:
    """sha256 of every file below ``path`` (or of the file), keyed by relative path."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdata: error: ") and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# output vs input


def test_balance_onto_its_own_input_refused_and_input_unchanged(tmp_path, capsys):
    inp = write_samples(tmp_path / "X.parquet", n=64)
    before = _digest(inp)
    assert main(["balance", str(inp), str(inp), "--overwrite", *BAL]) == 2
    assert "is the same path as INPUT" in _one_error_line(capsys.readouterr().err)
    assert _digest(inp) == before and inp.is_file()


def test_convert_onto_its_own_input_refused_and_input_unchanged(tmp_path, capsys):
    log = tmp_path / "log.txt"
    log.write_text("1 5 6 7\n2 8 9\n")
    before = log.read_bytes()
    assert main(["convert", str(log), str(log), "--format", "sequences", "--overwrite", "--no-progress"]) == 2
    assert "is the same path as input" in _one_error_line(capsys.readouterr().err)
    assert log.read_bytes() == before
    # through a symlink to the input as well
    link = tmp_path / "link.txt"
    link.symlink_to(log)
    assert main(["convert", str(log), str(link), "--format", "sequences", "--overwrite", "--no-progress"]) == 2
    assert log.read_bytes() == before and link.is_symlink()


def test_output_inside_input_folder_refused_and_nothing_deleted(tmp_path, capsys):
    data = write_samples(tmp_path / "data", n=64, num_files=2)
    (data / "old_out").mkdir()  # an existing folder that --overwrite would have replaced
    (data / "old_out" / "keep.parquet").write_bytes((data / "part-000.parquet").read_bytes())
    before = _digest(data)
    assert main(["balance", str(data), str(data / "old_out"), "--overwrite", *BAL]) == 2
    assert "lies inside INPUT" in _one_error_line(capsys.readouterr().err)
    assert _digest(data) == before
    # an output that contains the input (its parent), or a glob matching it
    assert main(["balance", str(data), str(tmp_path), "--overwrite", *BAL]) == 2
    assert "contains INPUT" in capsys.readouterr().err
    assert main(["balance", str(data / "*.parquet"), str(data / "part-001.parquet"), "--overwrite", *BAL]) == 2
    assert "from " in capsys.readouterr().err
    assert _digest(data) == before and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_synth_onto_its_lengths_source_refused(tmp_path, capsys):
    src = tmp_path / "seq.txt"
    src.write_text("1 2 3\n2 3 4 5\n")
    assert main(["synth", str(src), "--num-samples", "10", "--lengths-from", str(src), "--overwrite",
                 "--no-progress"]) == 2
    assert "--lengths-from" in _one_error_line(capsys.readouterr().err) and src.read_text() == "1 2 3\n2 3 4 5\n"


def test_overlap_cases(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.parquet").write_bytes(b"x")
    (tmp_path / "alias").symlink_to(tmp_path / "in")
    assert overlap(tmp_path / "in", tmp_path / "in") == "is"
    assert overlap(tmp_path / "alias" / "new", tmp_path / "in") == "lies inside"
    assert overlap(tmp_path / "in" / ".." / "in" / "x", tmp_path / "in") == "lies inside"
    assert overlap(tmp_path, tmp_path / "alias" / "a.parquet") == "contains"
    assert overlap(tmp_path / "in2", tmp_path / "in") is None  # a shared name prefix is not nesting
    assert overlap(tmp_path / "out", tmp_path / "in" / "a.parquet") is None
    assert public_path(tmp_path / ".out.tmp-123-abcdef01" / ".buckets" / "00000.arrow") == str(tmp_path / "out")


def test_environment_errors_recognised_in_every_wrapping():
    import errno

    import polars as pl
    import pyarrow as pa

    assert environment_errno(OSError(errno.ENOSPC, "No space left on device")) == errno.ENOSPC
    # PyArrow: an OSError whose errno is set and whose text carries "Detail: [errno N]"
    assert environment_errno(OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left")) == 28
    assert environment_errno(pa.ArrowIOError("Failed to open local file '/x/y'. Detail: [errno 30] "
                                             "Read-only file system")) == errno.EROFS
    # Polars keeps only the text
    assert environment_errno(pl.exceptions.ComputeError(
        "parquet: File out of specification: underlying IO error: No space left on device (os error 28)")) == 28
    assert environment_errno(ValueError("Permission denied")) == errno.EACCES
    assert environment_errno(pa.ArrowInvalid("Integer value 18446744073709551615 not in range")) is None
    assert environment_errno(FileNotFoundError(errno.ENOENT, "No such file")) is None
    e = environment_error(pa.ArrowIOError("Failed to open local file '/data/.out.tmp-12-ab12cd34/x.arrow'. "
                                          "Detail: [errno 13] Permission denied"), "/elsewhere")
    assert str(e).startswith("cannot access /data/out: permission denied (EACCES)")


def test_fstrain_outputs_apart_from_shards(tmp_path, capsys):
    from fstrain.cli import main as fstrain_main

    shards = tmp_path / "shards"
    shards.mkdir()
    rc = fstrain_main(["calibrate", "--output", str(shards / "cal.json"), "--from-shards", str(shards)])
    err = capsys.readouterr().err
    assert rc == 2 and "--output" in err and "lies inside --from-shards" in err
    assert list(shards.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# environment failures


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    """Mount a small tmpfs at ``path`` (root only); skip the test with the reason where impossible."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root; this test runs as a normal user")
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (container without CAP_SYS_ADMIN?): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_disk_full_during_bucketing_names_the_disk_not_the_input(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=40_000)
    before = _digest(inp)
    with _tmpfs(tmp_path / "small", "size=1m") as small:
        out = small / "new" / "nested" / "out"  # folders this run creates are removed too
        rc = main(["balance", str(inp), str(out), *BAL])
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2
        assert "no space left on device" in line and str(out) in line, line
        assert "corrupt" not in line and "regenerate" not in line
        assert _leftovers(small) == []
    assert _digest(inp) == before


@pytest.mark.parametrize("nr_inodes", range(3, 12))
def test_disk_full_at_every_stage_is_one_line_and_leaves_nothing(tmp_path, capsys, nr_inodes):
    """A tmpfs with room for only ``nr_inodes`` files and folders runs out at a different stage
    for each value: the temporary folder, the buckets, the rank folders and files, step stats,
    the manifest (a 2-rank OUTPUT needs about 12)."""
    inp = write_samples(tmp_path / "in.parquet", n=64)
    with _tmpfs(tmp_path / "small", f"size=64m,nr_inodes={nr_inodes}") as small:
        rc = main(["balance", str(inp), str(small / "out"), *BAL])
        err = capsys.readouterr().err
        if rc == 0:
            assert (small / "out").is_dir()
            return
        line = _one_error_line(err)
        assert rc == 2 and "no space left on device" in line and str(small / "out") in line, line
        assert _leftovers(small) == []


def test_convert_disk_full_leaves_nothing(tmp_path, capsys):
    log = tmp_path / "seq.txt"
    log.write_text("\n".join(" ".join(str(u * 7 + k) for k in range(300)) for u in range(3000)) + "\n")
    with _tmpfs(tmp_path / "small", "size=256k") as small:
        rc = main(["convert", str(log), str(small / "s.parquet"), "--format", "sequences", "--no-progress"])
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2 and "no space left on device" in line and "s.parquet" in line
        assert _leftovers(small) == []


def test_read_only_location_named(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=64)
    with _tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
        for out in (ro / "out", ro / "deeper" / "out"):
            rc = main(["balance", str(inp), str(out), *BAL])
            line = _one_error_line(capsys.readouterr().err)
            assert rc == 2 and "read-only file system" in line and str(ro) in line, line
        log = tmp_path / "seq.txt"
        log.write_text("1 5 6 7\n2 8 9\n")
        rc = main(["convert", str(log), str(ro / "x.parquet"), "--format", "sequences", "--no-progress"])
        assert rc == 2 and "read-only file system" in capsys.readouterr().err


def test_file_size_limit_named(tmp_path):
    """No root needed: RLIMIT_FSIZE makes writes past 64 KiB fail with EFBIG (SIGXFSZ ignored)."""
    inp = write_samples(tmp_path / "in.parquet", n=20_000)
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))\n"
            "from fsdata.cli import main\n"
            f"sys.exit(main(['balance', {str(inp)!r}, {str(tmp_path / 'out')!r}, *{BAL!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r.stderr)
    assert "file too large" in line and str(tmp_path / "out") in line and "corrupt" not in line
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_permission_denied_named(tmp_path):
    """As an unprivileged user (root ignores permissions): a 0555 folder refuses the OUTPUT, a 0600
    input refuses the read; each is one line naming the path and the permission."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user (as non-root the test user may own the files)")
    scratch = Path(tempfile.mkdtemp(prefix="fsdata-perm-", dir="/tmp"))
    try:
        scratch.chmod(0o755)
        inp = write_samples(scratch / "in.parquet", n=64)
        inp.chmod(0o644)
        closed = scratch / "closed"
        closed.mkdir(mode=0o555)
        closed.chmod(0o555)
        private = write_samples(scratch / "private.parquet", n=64)
        private.chmod(0o600)
        warm = scratch / "warm"
        warm.mkdir(mode=0o777)
        warm.chmod(0o777)
        code = ("import os, sys\n"
                "from fsdata.cli import main\n"
                # first run as root imports every lazily imported module, then drop privileges
                f"assert main(['balance', {str(inp)!r}, {str(warm / 'o')!r}, *{BAL!r}]) == 0\n"
                f"assert main(['profile', {str(inp)!r}, '--ranks', '2', '--batch-size-per-rank', '2']) == 0\n"
                "os.setgid(65534); os.setuid(65534)\n"
                f"rc1 = main(['balance', {str(inp)!r}, {str(closed / 'out')!r}, *{BAL!r}])\n"
                f"rc2 = main(['profile', {str(private)!r}, '--ranks', '2', '--batch-size-per-rank', '2'])\n"
                "sys.exit(10 * rc1 + rc2)\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        assert r.returncode == 22, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("fsdata: error:")]
        assert len(lines) == 2 and "Traceback" not in r.stderr, r.stderr
        assert "permission denied" in lines[0] and str(closed) in lines[0]
        assert "permission denied" in lines[1] and str(private) in lines[1] and "corrupt" not in lines[1]
        assert list(closed.iterdir()) == []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_process_alive_running_zombie_and_reaped():
    """The one liveness check (fsdata.guards.process_alive; atomic outputs, bucket folders and
    fstrain's shared-memory transport use it): a zombie counts as exited, as a reaped process does."""
    if not os.path.isdir("/proc"):
        pytest.skip("no /proc: a zombie is told apart only through /proc/PID/stat")
    assert process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pid = child.pid
    deadline = time.monotonic() + 30
    while process_alive(pid) and time.monotonic() < deadline:  # exited, not yet waited for: a zombie
        time.sleep(0.01)
    assert not process_alive(pid)
    assert os.path.exists(f"/proc/{pid}")  # still a zombie: the check read its state, not its absence
    child.wait()
    assert not process_alive(pid)
