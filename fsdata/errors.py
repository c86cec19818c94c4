"""Typed errors for user mistakes, and how their fixes are spelled.

Every error a user can cause (bad input, impossible settings) is an :class:`FsdataError` whose
message names the problem and the fix. The CLI prints it as one line on stderr and exits non-zero.

The fix is named in the caller's terms: the flag from a command line (``--overwrite``), the
setting or argument from Python (``BalanceSettings(overwrite=True)``). :data:`SETTINGS` is the one
table of both spellings; messages name a setting through :func:`setting` (or choose a phrase with
:func:`in_cli`), and the command lines run their commands inside :func:`cli_terms`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass


class FsdataError(Exception):
    """A user-facing error: bad input data or impossible settings.

    The message is one line that names the problem, the numbers involved and the fix.
    """


class InputError(FsdataError):
    """The input data is missing, empty, corrupt, or does not match the sample schema."""


class ConfigError(FsdataError):
    """The settings are impossible (e.g. ``--ranks 0``) or name something unknown."""


class VerifyError(FsdataError):
    """A written output violates an invariant of the shard format (see docs/format.md)."""


@dataclass(frozen=True, slots=True)
class Spelling:
    """One setting as each caller writes it.

    Attributes:
        cli: the command-line flag (``--ranks``).
        python: the keyword of the Python API (``num_ranks``: a :class:`BalanceSettings` field or a
            function argument).
        owner: what holds the keyword in Python (``BalanceSettings``), or None for a plain argument.
    """

    cli: str
    python: str
    owner: str | None = None


#: Every setting an error message names: its flag (CLI rendering) and its keyword (Python rendering).
#: The settings dataclasses' fields enter through :func:`register_settings` (the field is the one place a
#: flag's spelling is declared: its ``flag`` metadata, else ``--field-name``); these two are no field.
SETTINGS: dict[str, Spelling] = {
    # the reader's world size: torchrun's flag from the command line, the argument from Python
    "world_size": Spelling("--nproc-per-node", "world_size", "ShardDataset"),
    # a plain function argument (fsdata.samples.convert.convert, ...)
    "overwrite_arg": Spelling("--overwrite", "overwrite"),
}


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of a settings dataclass field: its ``flag`` metadata, else ``--field-name``."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def register_settings(cls: type, owner: str) -> None:
    """Enter every field of the settings dataclass ``cls`` in :data:`SETTINGS`, held by ``owner`` in Python
    (``BalanceSettings``); a name already there keeps its spelling."""
    for f in dataclasses.fields(cls):
        SETTINGS.setdefault(f.name, Spelling(flag_of(f), f.name, owner))


#: The commands a message may tell the user to re-run, per caller.
COMMANDS: dict[str, tuple[str, str]] = {
    "balance": ("fsdata balance", "fsdata.balance()"),
}

_UNSET = object()
_in_cli = False


@contextlib.contextmanager
def cli_terms() -> Iterator[None]:
    """Inside this block (a command line's command), messages name flags rather than settings."""
    global _in_cli
    before, _in_cli = _in_cli, True
    try:
        yield
    finally:
        _in_cli = before


def in_cli() -> bool:
    """Whether messages are being written for a command line (inside :func:`cli_terms`)."""
    return _in_cli


def setting(name: str, value: object = _UNSET, *, owner: str | None | object = _UNSET) -> str:
    """The setting ``name`` of :data:`SETTINGS` as the caller writes it.

    Args:
        name: a key of :data:`SETTINGS`.
        value: the value to show (``True`` for a switch); unset: the name alone.
        owner: overrides the table's owner for the Python rendering (None: the bare keyword).

    Returns:
        From a command line: ``--ranks`` / ``--ranks 256`` / ``--overwrite`` (a switch set to True).
        From Python: ``num_ranks`` / ``BalanceSettings(num_ranks=256)`` / ``BalanceSettings(overwrite=True)``.
    """
    s = SETTINGS.get(name) or Spelling("--" + name.replace("_", "-"), name)  # not registered: the usual rule
    if _in_cli:
        if value is _UNSET or value is True:
            return s.cli
        return f"{s.cli} {value}"
    if value is _UNSET:
        return s.python
    who = s.owner if owner is _UNSET else owner
    kw = f"{s.python}={value!r}"
    return f"{who}({kw})" if who else kw


def command(name: str) -> str:
    """A command of :data:`COMMANDS` as the caller runs it (``fsdata balance`` / ``fsdata.balance()``)."""
    cli, py = COMMANDS[name]
    return cli if _in_cli else py
