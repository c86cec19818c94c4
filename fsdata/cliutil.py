"""Behaviour shared by the command lines (``fsdata``, ``fstrain``, ``python -m pipelines.nightly``).

* :func:`run_main` runs a command body so that piping into ``head`` ends quietly (exit 141, the
  shell's status for SIGPIPE, and no traceback), and so that a full disk, a read-only file
  system or a denied permission anywhere in the command is one ``PROG: error: ...`` line naming the
  cause and the location (exit 2) instead of a traceback (:mod:`fsdata.guards`).
* :func:`add_progress_flag` / :func:`resolve_progress`: progress bars are shown only when stderr
  is a terminal, unless ``--progress`` / ``--no-progress`` or ``FSDATA_PROGRESS=1|0`` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from fsdata.guards import environment_error

#: Environment variable forcing progress bars on (``1``) or off (``0``) when no flag is given.
PROGRESS_ENV = "FSDATA_PROGRESS"
#: Exit status after the reader of stdout went away (128 + SIGPIPE, as a shell reports it).
EXIT_BROKEN_PIPE = 141


def add_progress_flag(p: argparse.ArgumentParser) -> None:
    """Add ``--progress`` / ``--no-progress`` (``dest="progress"``, default None: decide by TTY)."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help=f"show progress bars on stderr (default: only when stderr is a terminal; "
                        f"{PROGRESS_ENV}=1|0 sets the default)")


def resolve_progress(flag: bool | None) -> bool:
    """Whether to show progress bars.

    Args:
        flag: ``--progress`` (True), ``--no-progress`` (False) or neither (None).

    Returns:
        ``flag`` if given; else ``FSDATA_PROGRESS`` (``1/true/yes/on`` or ``0/false/no/off``) if
        set; else whether stderr is a terminal (so logs of ``make demo`` or cron hold no bars).
    """
    if flag is not None:
        return bool(flag)
    env = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def run_main(prog: str, body: Callable[[], int], location: Callable[[], str | None] = lambda: None) -> int:
    """Run a command body; map broken pipes and environment failures to quiet exits.

    Args:
        prog: program name for the error line (``fsdata``, ``fstrain train``, ``nightly``).
        body: the command (argument parsing included, so ``--help | head`` is covered too); returns
            the exit status.
        location: the path the command writes (or reads), named when an environment failure's
            exception carries no file name of its own.

    Returns:
        ``body()``'s status; 2 after an environment failure (one line on stderr); 141 when stdout's
        reader went away (nothing on stderr).
    """
    try:
        try:
            rc = body()
        except SystemExit:  # argparse's --help / usage errors: flush here, where a broken pipe is caught
            sys.stdout.flush()
            raise
        except Exception as e:  # noqa: BLE001 - anything that is not an environment failure re-raises
            env = environment_error(e, location())
            if env is None:
                raise
            print(f"{prog}: error: {env}", file=sys.stderr)
            rc = 2
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
