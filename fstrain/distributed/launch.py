"""User errors under ``torchrun``: one line, printed once, and the line torchrun's summary shows.

Under ``torchrun`` every rank runs the same command on the same inputs, so a bad setting or a bad
file fails every rank with the same message. The rules (docs/fstrain.md, "Errors under torchrun"):

* An error every rank raises (anything before the first training step: flags, config, manifest,
  evaluation file, a shard error the ranks agreed on) is printed by rank 0 only; an error only one
  rank can see (one raised while stepping, :attr:`FstrainError.rank_local`) by the rank that has it.
* Every failing worker exits 2 and writes the line to torch elastic's error file
  (``TORCHELASTIC_ERROR_FILE``, the file ``torch.distributed.elastic.multiprocessing.errors.record``
  writes for an uncaught exception), as ``{"message": LINE, "timestamp": SECONDS}``: torchrun's
  ``ChildFailedError`` summary then shows that line instead of "To enable traceback see ...".
* An unexpected exception is left to ``@record`` (its traceback goes to the error file), see
  :func:`run_recorded`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
from collections.abc import Callable

#: The environment variable torch elastic names each worker's error file in.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: How long a rank other than 0 waits, after an error every rank raised, for rank 0 to report it.
RANK0_GRACE_SECONDS = 30.0
#: ``rank0_reports``: this process left its error to rank 0 (set by :func:`report_user_error`).
#: ``line``: the error line this process wrote to its error file (re-written at exit, see :func:`run_recorded`).
_state: dict = {"rank0_reports": False, "line": None}


def launched_rank() -> int:
    """This process's global rank from ``RANK`` (0 outside torchrun)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def under_torchrun() -> bool:
    """Whether torch elastic started this process (it sets the error file variable)."""
    return bool(os.environ.get(ERROR_FILE_ENV))


def write_error_file(line: str) -> None:
    """Write ``line`` as this worker's failure message to ``TORCHELASTIC_ERROR_FILE`` (no-op without it).

    The JSON ``{"message": line, "timestamp": int seconds}`` is the form torch elastic's
    ``ProcessFailure`` reads as a plain message (shown as is in the ``ChildFailedError`` summary,
    earliest timestamp first). Written to a temporary file and renamed, so torchrun never reads half a file.
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # the summary then says "To enable traceback ..."; the line is on stderr anyway


def report_user_error(line: str, *, rank_local: bool = False) -> None:
    """Print a user error line once per job and record it for torchrun's summary.

    Args:
        line: the whole line, ``fstrain COMMAND: error: MESSAGE``.
        rank_local: only this rank can see the problem (printed by this rank, whichever it is);
            else every rank raised it and rank 0 prints it.
    """
    if rank_local or launched_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        _state["rank0_reports"] = True
    _state["line"] = line
    write_error_file(line)


def parse_once(parse: Callable[[], object]):
    """Run an argument parser so that its usage error is printed by rank 0 only under torchrun.

    Outside torchrun ``parse()`` runs as is. Under torchrun its stderr is held back: rank 0 prints
    it, the other ranks drop it; on a usage error (``SystemExit`` with a non-zero code) the error's
    last line goes to the error file (:func:`write_error_file`) and the exit is re-raised.
    """
    if not under_torchrun():
        return parse()
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            return parse()
    except SystemExit as e:
        if e.code not in (0, None):
            lines = [x for x in buf.getvalue().splitlines() if x.strip()]
            if lines:
                _state["line"] = lines[-1]
                write_error_file(lines[-1])
            _state["rank0_reports"] = launched_rank() != 0
        raise
    finally:
        if launched_rank() == 0 and buf.getvalue():
            sys.stderr.write(buf.getvalue())
            sys.stderr.flush()


def _exit_deferred() -> None:
    """Exit 2 from a rank that left its error to rank 0, re-writing its error file with the time now."""
    if _state["line"]:
        write_error_file(_state["line"])
    os._exit(2)


def run_recorded(fn: Callable[[], int]) -> int:
    """``fn()`` under torch elastic's ``@record`` when launched by torchrun (an uncaught exception's
    traceback goes to the error file, as torch documents); a plain call otherwise.

    Under torchrun a user error's exit (status 2, a usage error's too) leaves at once with
    ``os._exit`` after flushing stdout and stderr, except on a rank other than 0 whose error every
    rank raised: torchrun sends SIGTERM to every worker still running as soon as one has failed, so
    such a rank waits (at most :data:`RANK0_GRACE_SECONDS`) for rank 0 to print the line and fail
    first, and exits 2 when torchrun's SIGTERM comes. It re-writes its error file as it exits, so the
    file's timestamp (whole seconds; torchrun's "Root Cause" is the failure with the earliest one, the
    lowest rank on a tie) is never earlier than rank 0's.
    """
    if not under_torchrun():
        return fn()
    from torch.distributed.elastic.multiprocessing.errors import record  # noqa: PLC0415

    try:
        rc = record(fn)()
    except SystemExit as e:
        if e.code != 2:
            raise
        rc = 2
    if rc == 2:
        sys.stdout.flush()
        sys.stderr.flush()
        if _state["rank0_reports"] and launched_rank() != 0:
            signal.signal(signal.SIGTERM, lambda *_: _exit_deferred())
            time.sleep(RANK0_GRACE_SECONDS)
            _exit_deferred()
        os._exit(2)
    return rc
