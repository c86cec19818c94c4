"""Behaviour shared by the command lines (``fsdata``, ``fstrain``, ``python -m pipelines.nightly``).

* :func:`run_main` runs a command body so that piping into ``head`` ends quietly (exit 141, the
  shell's status for SIGPIPE, and no traceback), and so that a full disk, a read-only file
  system or a denied permission anywhere in the command is one ``PROG: error: ...`` line naming the
  cause and the location (exit 2) instead of a traceback (:mod:`fsdata.guards`).
* :func:`add_progress_flag` / :func:`resolve_progress`: progress bars are shown only when stderr
  is a terminal, unless ``--progress`` / ``--no-progress`` or ``FSDATA_PROGRESS=1|0`` says otherwise.

The one CLI convention of every entry point (README.md, "CLI conventions"); the flags are defined
here and nowhere else:

* :func:`add_version_flag`: ``--version`` prints ``PROG VERSION`` (the installed ``freescale``
  distribution's version, else :data:`fsdata._version.__version__`) and exits 0.
* :func:`add_verbosity_flags` / :func:`configure_logging`: ``-v/--verbose`` sets the ``fsdata``,
  ``fstrain`` and ``pipelines`` loggers to DEBUG, ``-q/--quiet`` to ERROR.
* :func:`add_json_flag`: ``--json`` prints the summary as JSON on stdout.
* :func:`add_output_flag`: ``-o/--output`` names the output location wherever it is not one of
  fsdata's positional ``OUTPUT``/``PLAN`` arguments.
* :func:`add_num_threads_flag`: ``--num-threads`` counts threads (never processes: PyTorch's
  ``num_workers`` means processes).
* :func:`add_deprecated_alias`: an old spelling still parses (hidden from ``--help``) and prints one
  ``PROG: warning: OLD is deprecated; use NEW`` line on stderr.

Flags generated from a settings dataclass (:func:`add_settings_flags`, with ``jsonargparse``): the
field's type, default, choices and docstring are the flag's, declared once.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
import typing
from collections.abc import Callable, Sequence

from fsdata._version import __version__
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


def package_version() -> str:
    """The FreeScale version: ``importlib.metadata.version("freescale")``, else ``fsdata._version.__version__``."""
    from importlib import metadata

    try:
        return metadata.version("freescale")
    except metadata.PackageNotFoundError:
        return __version__


def add_version_flag(p: argparse.ArgumentParser, name: str | None = None) -> None:
    """Add ``--version``: print ``NAME VERSION`` (default name: the parser's prog) on stdout and exit 0."""
    p.add_argument("--version", action="version", version=f"{name or '%(prog)s'} {package_version()}",
                   help="print the version and exit")


#: Loggers that ``-v/--verbose`` and ``-q/--quiet`` set (our packages; libraries stay at WARNING).
OUR_LOGGERS = ("fsdata", "fstrain", "pipelines")


def add_verbosity_flags(p: argparse.ArgumentParser) -> None:
    """Add ``-v/--verbose`` (``dest="verbose"``) and ``-q/--quiet`` (``dest="quiet"``), exclusive."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("-v", "--verbose", action="store_true", help="debug logging (fsdata, fstrain, pipelines loggers)")
    g.add_argument("-q", "--quiet", action="store_true", help="log errors only")


def configure_logging(verbose: bool = False, quiet: bool = False, *, default: int = logging.WARNING,
                      fmt: str = "%(levelname)s %(name)s: %(message)s", force: bool = False) -> int:
    """Set up logging for a command: the root logger at WARNING, our loggers by the flags.

    Args:
        verbose: ``-v/--verbose``: our loggers at DEBUG.
        quiet: ``-q/--quiet``: our loggers at ERROR.
        default: our loggers' level with neither flag (the command's usual chattiness).
        fmt: log line format.
        force: replace handlers an earlier ``basicConfig`` installed.

    Returns:
        The level set on the ``fsdata``, ``fstrain`` and ``pipelines`` loggers.
    """
    level = logging.DEBUG if verbose else logging.ERROR if quiet else default
    logging.basicConfig(level=logging.WARNING, format=fmt, force=force)
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(level)
    return level


def add_json_flag(p: argparse.ArgumentParser, help: str = "print the summary as JSON") -> None:  # noqa: A002
    """Add ``--json`` (``dest="json"``)."""
    p.add_argument("--json", action="store_true", help=help)


class _DeprecatedAlias(argparse.Action):
    """Store like the new flag's action, after one ``PROG: warning: OLD is deprecated; use NEW`` line."""

    def __init__(self, option_strings, dest, new: str = "", store_const=None, **kw):
        self.new = new
        self.store_const = store_const
        if store_const is not None:
            kw["nargs"] = 0
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, self.store_const if self.store_const is not None else values)


def add_deprecated_alias(p: argparse.ArgumentParser | argparse._ActionsContainer, old: str, new_action: argparse.Action,
                         ) -> argparse.Action:
    """Add ``old`` as a hidden spelling of ``new_action`` that warns once per use.

    Args:
        p: the parser (or argument group) holding ``new_action``.
        old: the deprecated option string, e.g. ``"--work-dir"``.
        new_action: what :meth:`~argparse.ArgumentParser.add_argument` returned for the new flag.

    Returns:
        The alias's action (hidden from ``--help``; default left to ``new_action``).
    """
    new = max(new_action.option_strings, key=len)
    store_const = True if isinstance(new_action, argparse._StoreTrueAction) else None
    kw = {} if store_const is not None else {"type": new_action.type, "choices": new_action.choices,
                                             "metavar": new_action.metavar}
    return p.add_argument(old, dest=new_action.dest, action=_DeprecatedAlias, new=new, store_const=store_const,
                          default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)


def add_output_flag(p: argparse.ArgumentParser | argparse._ActionsContainer, *, help: str,  # noqa: A002
                    required: bool = False, default: str | None = None, metavar: str = "PATH",
                    deprecated: Sequence[str] = ()) -> argparse.Action:
    """Add ``-o/--output`` (``dest="output"``) and hidden deprecated spellings (``--out``, ``--work-dir``)."""
    act = p.add_argument("-o", "--output", required=required, default=default, metavar=metavar, help=help)
    for old in deprecated:
        add_deprecated_alias(p, old, act)
    return act


def add_num_threads_flag(p: argparse.ArgumentParser | argparse._ActionsContainer, *, default: int,
                         help: str, deprecated: Sequence[str] = ()) -> argparse.Action:  # noqa: A002
    """Add ``--num-threads N`` (``dest="num_threads"``) and hidden deprecated spellings (``--num-workers``)."""
    act = p.add_argument("--num-threads", type=int, default=default, metavar="N", help=help)
    for old in deprecated:
        add_deprecated_alias(p, old, act)
    return act


def add_common_flags(p: argparse.ArgumentParser, *, progress: bool = True, name: str | None = None) -> None:
    """``--version`` (printing ``name``), ``-v/--verbose``, ``-q/--quiet`` and (``progress``)
    ``--progress/--no-progress``."""
    if progress:
        add_progress_flag(p)
    add_verbosity_flags(p)
    add_version_flag(p, name)


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


# ---------------------------------------------------------------------------------------------
# flags generated from a settings dataclass (jsonargparse)

#: reST roles and literals stripped from a docstring when it becomes help text.
_REST = re.compile(r":[a-z]+:`~?([^`]+)`|``([^`]+)``")


def settings_help(cls: type) -> dict[str, str]:
    """Help text of every field of a settings dataclass, from its docstrings.

    A field's docstring is the string under it, else its entry in the class docstring's Google-style
    ``Attributes:`` section (read with ``docstring_parser``); reST markup (````x````, ``:func:`x```)
    is reduced to plain text.

    Returns:
        ``{field name: one-paragraph help}`` (empty string for an undocumented field).
    """
    import docstring_parser  # noqa: PLC0415

    doc = {p.arg_name: p.description or "" for p in docstring_parser.parse_from_object(cls).params}
    return {f.name: " ".join(_REST.sub(lambda m: m.group(1) or m.group(2), doc.get(f.name, "")).split())
            for f in dataclasses.fields(cls)}


def _literal_none(hint: object) -> tuple | None:
    """The values of ``Literal[...] | None`` (spelled ``none`` on a command line), else None."""
    args = typing.get_args(hint)
    if type(None) not in args:
        return None
    rest = [a for a in args if a is not type(None)]
    if len(rest) == 1 and typing.get_origin(rest[0]) is typing.Literal:
        return typing.get_args(rest[0])
    return None


def add_settings_flags(parser, cls: type, *, section: str, flags: dict[str, str | tuple[str, ...]] | None = None,
                       exclude: Sequence[str] = (), title: str | None = None) -> dict[str, str]:
    """Add one flag per field of the settings dataclass ``cls`` to a ``jsonargparse`` parser.

    The field is the one declaration: its type (choices of a ``Literal``), default and docstring
    (:func:`settings_help`) become the flag's type, default and help; the value lands at
    ``SECTION.FIELD`` of the parsed namespace (and of a ``--config`` YAML file). Spelling:
    ``--field-name`` unless ``flags`` names another; a ``bool | None`` field gets ``--flag`` /
    ``--no-flag``; a ``Literal[...] | None`` field takes ``none`` for None (:func:`settings_values`).
    A field without a default gets none on the command line either (the caller checks it is given).

    Args:
        parser: a ``jsonargparse.ArgumentParser`` (or argument group of one).
        cls: the dataclass.
        section: the namespace key of the fields (``balance``).
        flags: field name -> option string (or strings, e.g. ``("-o", "--output")``), where it
            differs from ``--field-name``.
        exclude: fields that get no flag (set by other flags, or meaningless for this command).
        title: argument group title (default: ``section``).

    Returns:
        ``{option string: field name}`` of every option string added.
    """
    hints = typing.get_type_hints(cls)
    helps = settings_help(cls)
    group = parser.add_argument_group(title or section)
    added = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        names = (flags or {}).get(f.name, "--" + f.name.replace("_", "-"))
        names = (names,) if isinstance(names, str) else tuple(names)
        flag = names[-1]
        dest, hint, text = f"{section}.{f.name}", hints[f.name], helps[f.name] or f.name
        default = None if f.default is dataclasses.MISSING else f.default
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            text += " (required)"
        if hint in (bool, bool | None):
            group.add_argument(*names, dest=dest, action="store_true", default=default, help=text)
            no = "--no-" + flag[2:]
            group.add_argument(no, dest=dest, action="store_false", default=default, help=f"not {flag}")
            added[no] = f.name
        elif (values := _literal_none(hint)) is not None:
            group.add_argument(*names, dest=dest, type=typing.Literal[("none", *values)],
                               default="none" if default is None else default, help=text)
        else:
            group.add_argument(*names, dest=dest, type=hint, default=default, help=text)
        added.update(dict.fromkeys(names, f.name))
    return added


def settings_values(cls: type, values: dict) -> dict:
    """The keyword arguments of ``cls`` from a parsed section: ``none`` back to None where
    :func:`add_settings_flags` spelled it so."""
    hints = typing.get_type_hints(cls)
    return {k: None if v == "none" and _literal_none(hints[k]) is not None else v for k, v in values.items()}


def add_settings_argument(p: argparse.ArgumentParser | argparse._ActionsContainer, cls: type, name: str,
                          *option_strings: str, **kwargs) -> argparse.Action:
    """Add a plain ``argparse`` flag for field ``name`` of the settings dataclass ``cls``: its
    default (required when the field has none), choices (of a ``Literal``; ``none`` for None as in
    :func:`add_settings_flags`) and type (``int`` / ``float``) are the field's.

    Args:
        p: the parser or argument group.
        cls: the dataclass.
        name: the field.
        option_strings: the flag's spellings (default ``--field-name``).
        kwargs: anything else for ``add_argument`` (``help`` defaults to the field's docstring,
            followed by the default; ``%(default)s`` in a given help shows the field's default).

    Returns:
        The action.
    """
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
        kwargs.setdefault("required", True)
    else:
        kwargs.setdefault("default", field.default)
    if typing.get_origin(hint) is typing.Literal:
        kwargs.setdefault("choices", list(args))
    elif (values := _literal_none(hint)) is not None:
        kwargs.setdefault("choices", ["none", *values])
        if kwargs.get("default") is None:
            kwargs["default"] = "none"
    else:
        base = next((t for t in (int, float) if hint is t or t in args), None)
        if base is not None:
            kwargs.setdefault("type", base)
    if "help" not in kwargs:
        text = settings_help(cls)[name]
        shown = kwargs.get("default") not in (None, "none") and kwargs.get("action") is None
        kwargs["help"] = f"{text[:1].lower()}{text[1:].rstrip('.')}" + (" (default %(default)s)" if shown else "")
    return p.add_argument(*(option_strings or ("--" + name.replace("_", "-"),)), **kwargs)
