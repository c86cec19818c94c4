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
* :func:`add_json_flag`: ``--json`` prints the summary as JSON on stdout; :func:`add_output_flag`:
  ``-o/--output`` names the output wherever it is not fsdata's positional ``OUTPUT``/``PLAN``.
* thread counts are ``--num-threads`` (never processes), a settings dataclass's ``num_threads``.

Flags generated from a settings dataclass (:func:`add_settings_flags`, :func:`add_field_flag`, with
``jsonargparse``): the field's type, default, choices and docstring are the flag's, declared once.
:func:`new_parser` makes the parser every entry point uses (a usage error is one ``PROG: error:``
line after the usage, exit 2) and :func:`cli_main` is the one ``main()`` of every entry point:
parse, run the command, turn a user error into one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence

from fsdata._version import __version__
from fsdata.errors import FsdataError, cli_terms, flag_of
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


@functools.cache
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


def add_output_flag(p: argparse.ArgumentParser | argparse._ActionsContainer, *, help: str,  # noqa: A002
                    required: bool = False, default: str | None = None, metavar: str = "PATH") -> argparse.Action:
    """Add ``-o/--output`` (``dest="output"``)."""
    return p.add_argument("-o", "--output", required=required, default=default, metavar=metavar, help=help)


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
        except Exception as e:  # anything that is not an environment failure re-raises
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


# --- the parser and main() of every entry point --------------------------------------------------


def subparsers(parser) -> dict:
    """``{name: parser}`` of a parser's subcommands (empty without)."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return dict(sub.choices) if sub is not None else {}


def _one_line(parser, message: str) -> tuple[object, str]:
    """``(parser whose usage to show, message)``: a jsonargparse message as one line in the flags'
    terms (``Parser key "balance.num_ranks"`` names ``--ranks``), and the subcommand it is about."""
    text = " ".join(str(message).split())
    req = re.fullmatch(r"the following arguments are required: (.*)", text)
    keys = req.group(1).split(", ") if req else re.findall(r'Key "([^"]+)"', text, re.IGNORECASE)
    head = keys[0].split(".", 1)[0] if keys else None
    if head in subparsers(parser):  # a key of a subcommand: its usage, its flag
        parser = subparsers(parser)[head]
        keys = [k.split(".", 1)[1] if k.startswith(head + ".") else k for k in keys]
        text = text.replace(f'"{head}.', '"').replace(f" {head}.", " ")
    flags = {a.dest: "/".join(a.option_strings) for a in parser._actions if a.option_strings}
    if req:
        return parser, "the following arguments are required: " + ", ".join(flags.get(k, k) for k in keys)

    def flag(m: re.Match) -> str:
        name = flags.get(m.group(2), m.group(2))
        return f"argument {name}" if m.group(1) == "Parser key" else name

    text = re.sub(r'(Parser key|Key) "([^"]+)"', flag, text)
    text = re.sub(r"Expected a <class '(\w+)'>", r"expected \1", text)
    text = text.replace("Expected a typing.Literal", "expected one of ")
    return parser, text


@functools.cache
def _classes() -> tuple[type, type]:
    import jsonargparse  # noqa: PLC0415 - at parse time only

    class HelpFormatter(jsonargparse.DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """Field help with its type and default; descriptions and examples as written."""

    class ArgumentParser(jsonargparse.ArgumentParser):
        """A ``jsonargparse`` parser whose usage errors are the usage and one ``PROG: error: ...`` line (exit 2)."""

        def error(self, message: str, ex: Exception | None = None):
            if not self.exit_on_error:
                return super().error(message, ex)
            parser, text = _one_line(getattr(ex, "subcommand_parser", None) or self, message)
            parser.print_usage(sys.stderr)
            sys.stderr.write(f"{parser.prog.replace(' [options]', '')}: error: {text}\n")
            sys.exit(2)

    return ArgumentParser, HelpFormatter


def new_parser(prog: str | None = None, **kwargs):
    """A ``jsonargparse.ArgumentParser`` in the house manner: usage errors are one ``PROG: error:`` line
    (the flag named, exit 2), help shows each flag's type and default and keeps examples as written,
    no abbreviated flags (a removed spelling never parses as a prefix of a new one), no
    jsonargparse ``--print_config``. ``kwargs`` go to the parser (``description``, ``epilog``)."""
    cls, fmt = _classes()
    kwargs.setdefault("formatter_class", fmt)
    return cls(prog=prog, print_config=None, exit_on_error=True, allow_abbrev=False, **kwargs)


def add_subcommands(parser, commands: dict[str, tuple[object, str]]) -> None:
    """Add subcommands (``dest="command"``, one required): ``{name: (parser from new_parser, help)}``."""
    sub = parser.add_subcommands(dest="command", required=True)
    for name, (p, text) in commands.items():
        sub.add_subcommand(name, p, help=text)


def _lookup(ns, key: str):
    """The plain attribute ``key`` (``metrics.dir`` of a flat namespace), else ``ns.a.b`` for ``"a.b"``."""
    if hasattr(ns, key):
        return getattr(ns, key)
    for part in key.split("."):
        ns = getattr(ns, part, None)
    return ns


def cli_main(prog: str, parse: Callable[[], object], command: Callable[[object], int], *,
             errors: tuple[type[BaseException], ...] = (), location: Sequence[str] = (),
             label: Callable[[object], str] | None = None, interrupted: str | None = None) -> int:
    """The ``main()`` of every entry point: parse, run, and keep to the error conventions.

    A user error (:class:`fsdata.errors.FsdataError` or one of ``errors``) is one ``LABEL: error:
    MESSAGE`` line on stderr and exit 2; the command runs inside :func:`fsdata.errors.cli_terms`
    (messages name flags, not keywords); environment failures and broken pipes are
    :func:`run_main`'s.

    Args:
        prog: program name (``fsdata``) for environment failures, and the label by default.
        parse: returns the parsed namespace (called inside, so ``--help | head`` is covered).
        command: runs the command on it; returns the exit status (returned here).
        errors: user-error types besides ``FsdataError`` (``FstrainError``).
        location: namespace keys of the output, then the input: the first one set is named when an
            environment failure carries no path of its own.
        label: the error line's label from the namespace (``fstrain train``; default ``prog``).
        interrupted: with Ctrl-C, print ``PROG: INTERRUPTED`` and exit 130 (default: re-raise).
    """

    parsed: list = []

    def body() -> int:
        parsed.append(parse())
        try:
            with cli_terms():
                return command(parsed[0])
        except (FsdataError, *errors) as e:
            print(f"{label(parsed[0]) if label else prog}: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            if interrupted is None:
                raise
            print(f"{prog}: {interrupted}", file=sys.stderr)
            return 130

    def where() -> str | None:
        return next((v for k in location if (v := _lookup(parsed[0], k))), None) if parsed else None

    return run_main(prog, body, where)


# --- flags generated from a settings dataclass (jsonargparse) ---------------------------------

#: reST roles and literals stripped from a docstring when it becomes help text.
_REST = re.compile(r":[a-z]+:`~?([^`]+)`|``([^`]+)``")


@functools.cache
def settings_help(cls: type) -> dict[str, str]:
    """Help text of every field of a settings dataclass, from its docstrings.

    A field's docstring is the string under it, else its entry in the ``Attributes:`` section of its
    (base) class's docstring (``docstring_parser``); reST markup (````x````, ``:func:`x```) is dropped.

    Returns:
        ``{field name: one-paragraph help}`` ("" for an undocumented field); read once per class.
    """
    import docstring_parser  # noqa: PLC0415

    doc = {p.arg_name: p.description or "" for base in reversed(cls.__mro__) if dataclasses.is_dataclass(base)
           for p in docstring_parser.parse_from_object(base).params}
    return {f.name: " ".join(_REST.sub(lambda m: m.group(1) or m.group(2), doc.get(f.name, "")).split())
            for f in dataclasses.fields(cls)}


def _optional(hint: object) -> tuple[object, bool]:
    """``(hint without None, whether None is allowed)`` of an annotation such as ``int | None``."""
    args = typing.get_args(hint)
    if type(None) in args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else typing.Union[rest]), True  # noqa: UP007
    return hint, False


def _literal_none(hint: object) -> tuple | None:
    """The values of ``Literal[...] | None`` (spelled ``none`` on a command line), else None."""
    base, nullable = _optional(hint)
    return typing.get_args(base) if nullable and typing.get_origin(base) is typing.Literal else None


def flag_choices(hint: object, choices: Sequence | None = None) -> tuple | None:
    """The values a field's flag accepts, as spelled on a command line: ``choices`` (a registry's
    names) if given, else a ``Literal``'s (``none`` first for ``Literal[...] | None``), else None."""
    if choices is not None:
        return tuple(choices)
    if (values := _literal_none(hint)) is not None:
        return ("none", *values)
    base, _ = _optional(hint)
    return typing.get_args(base) if typing.get_origin(base) is typing.Literal else None


def action_choices(action: argparse.Action) -> tuple | None:
    """The choices of a parser's action: argparse's ``choices`` or a jsonargparse ``Literal`` type's."""
    if action.choices is not None:
        return tuple(action.choices)
    base, _ = _optional(getattr(action, "_typehint", None))  # a Literal, or a registry's names | None
    return typing.get_args(base) if typing.get_origin(base) is typing.Literal else None


def add_field_flag(parser, names: Sequence[str], *, dest: str, hint: object, default: object, help: str,  # noqa: A002
                   required: bool = False, choices: Sequence | None = None, override: bool = False,
                   metavar: str | None = None) -> list[str]:
    """Add the flag of one settings field to a ``jsonargparse`` parser (or argument group); the
    house rules of spelling and type, the same in every entry point:

    * ``bool``: ``--flag`` (store true) when the default is false, ``--no-flag`` (store false) when
      it is true; ``bool | None``: both.
    * ``Literal[...]`` or ``choices`` (a registry's names): one of them (``str | None``: or unset);
      ``Literal[...] | None``: ``none`` for None (:func:`settings_values`).
    * ``tuple[T, ...]``: that many values after the flag (``--betas 0.9 0.99``).
    * anything else: the field's type.

    Args: ``names`` the option strings (the last the long one), ``dest`` the namespace key
    (``balance.num_ranks``), ``hint`` the field's annotation, ``default`` the flag's default,
    ``help`` the field's docstring, ``required`` (a field without a default), ``choices`` (a
    registry's names, for a ``str`` field), ``override``: every default is None, so a flag given
    overrides another source (a checkpoint's recorded config) and one not given leaves it
    (booleans keep the direction of ``default``), ``metavar``. Returns the option strings added.
    """
    names, text = tuple(names), (help or dest.rsplit(".", 1)[-1]).replace("%", "%%")
    base, nullable = _optional(hint)
    kw: dict = {"dest": dest, "help": text}
    if required:
        kw["required"] = True
    elif override:
        kw["default"] = None
    else:
        kw["default"] = list(default) if isinstance(default, tuple) else default
    if base is bool:
        no = tuple("--no-" + n[2:] for n in names if n.startswith("--"))
        if nullable:
            parser.add_argument(*names, action="store_true", **kw)
            parser.add_argument(*no, action="store_false", **{**kw, "help": f"not {names[-1]}"})
            return [*names, *no]
        if default is True:
            parser.add_argument(*no, action="store_false", **kw)
            return list(no)
        parser.add_argument(*names, action="store_true", **kw)
        return list(names)
    if metavar is not None:
        kw["metavar"] = metavar
    values = flag_choices(hint, choices)
    if _literal_none(hint) is not None:
        kw["type"] = typing.Literal[values]
        if kw.get("default") is None and not required:
            kw["default"] = "none"
    elif values is not None:
        kw["type"] = typing.Optional[typing.Literal[values]] if nullable else typing.Literal[values]
    elif typing.get_origin(base) is tuple:
        args = typing.get_args(base)
        kw["nargs"], kw["type"] = ("+" if args[-1] is Ellipsis else len(args)), args[0]
    else:
        kw["type"] = hint
    parser.add_argument(*names, **kw)
    return list(names)


def _field_default(f: dataclasses.Field, instance: object = None) -> object:
    """The instance's value, else the field's default (factory called), else ``dataclasses.MISSING``."""
    if instance is not None or f.default is not dataclasses.MISSING:
        return getattr(instance, f.name) if instance is not None else f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def add_settings_flags(parser, cls: type, *, section: str, flags: dict[str, str | tuple[str, ...]] | None = None,
                       exclude: Sequence[str] = (), include: Sequence[str] | None = None, title: str | None = None,
                       defaults: object = None, override: bool = False, require: bool = False,
                       choices: dict[str, Sequence] | None = None, metavars: dict[str, str] | None = None,
                       group=None) -> dict[str, str]:
    """Add one flag per field of the settings dataclass ``cls`` to a ``jsonargparse`` parser.

    The field is the one declaration: its type (choices of a ``Literal`` or of ``choices``), default
    and docstring (:func:`settings_help`) become the flag's type, default and help
    (:func:`add_field_flag` has the rules); the value lands at ``SECTION.FIELD`` of the parsed
    namespace (and of a ``--config`` YAML file). Spelling: ``--field-name`` unless the field's metadata
    names another (``field(metadata={"flag": "--ranks", "metavar": "N"})``: declared there only).
    Fields that are dataclasses themselves are left to the caller (a section of their own).

    Args:
        parser: a ``jsonargparse.ArgumentParser`` (see :func:`new_parser`).
        cls: the dataclass.
        section: the namespace key of the fields (``balance``, ``comm.shm``; empty: top level).
        flags: field name -> option string(s) (``("-o", "--output")``), over the field's ``flag`` metadata.
        exclude, include: fields that get no flag; only these fields (default: all).
        title: argument group title (default: ``section``); ``group``: an existing group instead.
        defaults: an instance of ``cls`` whose values are the defaults (default: the fields' own).
        override: every default is None (:func:`add_field_flag`).
        require: a field without a default is a required flag (else the caller checks it).
        choices: field name -> allowed names from a registry; ``metavars``: field name -> metavar (over metadata).
    Returns ``{option string: field name}`` of every option string added.
    """
    hints = typing.get_type_hints(cls)
    helps = settings_help(cls)
    group = group if group is not None else parser.add_argument_group(title or section)
    added = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude or include is not None and f.name not in include:
            continue
        if dataclasses.is_dataclass(_optional(hints[f.name])[0]):
            continue
        names = (flags or {}).get(f.name) or flag_of(f)
        default = _field_default(f, defaults)
        missing = default is dataclasses.MISSING
        text = helps[f.name] + (" (required)" if missing and not require else "")
        dest = f"{section}.{f.name}" if section else f.name
        opts = add_field_flag(group, (names,) if isinstance(names, str) else names, dest=dest,
                              hint=hints[f.name], default=None if missing else default, help=text,
                              required=missing and require, choices=(choices or {}).get(f.name), override=override,
                              metavar=(metavars or {}).get(f.name, f.metadata.get("metavar")))
        added.update(dict.fromkeys(opts, f.name))
    return added


def settings_values(cls: type, values: dict) -> dict:
    """The keyword arguments of ``cls`` from a parsed section: ``none`` back to None where
    :func:`add_settings_flags` spelled it so, lists back to tuples where the field is a tuple."""
    hints = typing.get_type_hints(cls)
    out = {}
    for k, v in values.items():
        if v == "none" and _literal_none(hints[k]) is not None:
            v = None
        elif isinstance(v, list) and typing.get_origin(_optional(hints[k])[0]) is tuple:
            v = tuple(v)
        out[k] = v
    return out
