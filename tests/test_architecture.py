"""The layer rule of fsdata (docs/architecture.md): no module imports from a layer above its own,
and the imports between fsdata modules form no cycle. Read statically with ``ast``, imports inside
functions included."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from tests.importgraph import assert_no_cycle

REPO = pathlib.Path(__file__).resolve().parents[1]

#: Layers bottom to top; a module may import its own layer or a lower one.
LAYERS = {
    "base": 0, "common": 0, "samples": 1, "balancer": 2, "shards": 3, "engines": 4, "cli": 5,
}
BASE = {"fsdata._version", "fsdata.errors", "fsdata.atomic", "fsdata.guards", "fsdata.fsio"}
CLI = {"fsdata.cli", "fsdata.report", "fsdata.__main__"}
#: Module paths removed in 0.3.0 (CHANGELOG.md names their new homes); none may come back.
REMOVED = {"fsdata." + m for m in (
    "schema io diagnose convert holdout synth cost bubble compose partition partition_fast kk cpsat "
    "cost_budget plan profile manifest verify balance _deprecated").split()} | {
    "fstrain." + m for m in ("pipeline", "prioritized", "pipeline_timing", "dataset")}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _imports(path: pathlib.Path, modules: set[str], packages: tuple[str, ...] = ("fsdata",)) -> set[str]:
    """Modules of ``packages`` that ``path`` imports (``from fsdata.x import y`` counts ``fsdata.x.y``
    when that is one of ``modules``)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                and node.module.split(".")[0] in packages):
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            deps |= subs or {node.module}
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name.split(".")[0] in packages}
    return deps


def _fsdata_graph() -> dict[str, set[str]]:
    paths = sorted((REPO / "fsdata").rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) - {_module_name(p)} for p in paths}


def _layer(mod: str) -> int:
    if mod in BASE:
        return LAYERS["base"]
    if mod in CLI or mod == "fsdata":
        return LAYERS["cli"]
    part = mod.split(".")[1]
    assert part in LAYERS, f"{mod} is in no layer; add it to a sub-package or to tests/test_architecture.py"
    return LAYERS[part]


def test_every_fsdata_module_is_in_a_layer():
    for mod in _fsdata_graph():
        _layer(mod)


def test_no_upward_import_in_fsdata():
    bad = []
    for mod, deps in _fsdata_graph().items():
        if mod == "fsdata":
            continue  # the package facade sits on top
        for dep in deps:
            if _layer(dep) > _layer(mod):
                bad.append(f"{mod} ({_layer(mod)}) imports {dep} ({_layer(dep)})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycle_in_fsdata():
    graph = _fsdata_graph()
    edges = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    assert_no_cycle(edges)


def test_fsdata_holds_at_most_nine_top_level_modules():
    """The package's own ``__init__.py`` aside; everything else lives in a layer's sub-package."""
    top = sorted(p.name for p in (REPO / "fsdata").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 9, top


def test_removed_paths_stay_removed():
    """The old flat paths import nowhere: no file of the project names them, none exists."""
    for old in sorted(REMOVED):
        path = REPO.joinpath(*old.split("."))
        assert not path.with_suffix(".py").exists() and not path.is_dir(), f"{old} is back"
    paths = [p for d in ("fsdata", "fstrain", "pipelines", "benchmarks", "tests") for p in (REPO / d).rglob("*.py")]
    modules = {_module_name(p) for p in (REPO / "fsdata").rglob("*.py")} | REMOVED
    bad = [f"{_module_name(p)} imports {dep}" for p in paths
           for dep in _imports(p, modules, ("fsdata", "fstrain")) & REMOVED]
    assert not bad, "\n".join(sorted(bad))


def test_fstrain_reads_shards_through_the_manifest_module_only():
    modules = {_module_name(p) for p in (REPO / "fsdata").rglob("*.py")}
    for p in (REPO / "fstrain").rglob("*.py"):
        deps = _imports(p, modules)
        bad = [d for d in deps for pkg in ("fsdata.shards.writer", "fsdata.shards.plan_file", "fsdata.shards.finalize",
                                           "fsdata.shards.verify", "fsdata.engines")
               if d == pkg or d.startswith(pkg + ".")]
        assert not bad, (p, bad)


def test_no_module_of_fsdata_fstrain_or_pipelines_passes_500_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for d in ("fsdata", "fstrain", "pipelines") for p in (REPO / d).rglob("*.py")}
    big = {p: n for p, n in sizes.items() if n > 500}
    assert not big, big


# --- no table renaming settings fields in a command line (issue 40) ------------------------------

#: A settings field's name, or its path (``comm.backend``), as a table key.
_FIELD_KEY = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*")
#: A flag (``--ranks``, ``-o``) or a namespace dest (``ranks``) as a table value.
_FLAG_OR_DEST = re.compile(r"--?[a-z][a-z0-9-]*|[a-z][a-z0-9_]*")


def _renames(key: str, names: list[str]) -> bool:
    """Whether ``names`` (a dict value's strings) rename the field ``key``: flags (``--ranks``,
    ``("-o", "--output")``), or one dest that shares a word with the field's name (``ranks``)."""
    field = key.rsplit(".", 1)[-1]
    if names and all(n.startswith("-") and _FLAG_OR_DEST.fullmatch(n) for n in names):
        return True
    return (len(names) == 1 and names[0] != field and _FLAG_OR_DEST.fullmatch(names[0]) is not None
            and bool(set(names[0].split("_")) & set(field.split("_"))))


def _renamings(source: str) -> list[str]:
    """The entries of dict literals (anywhere in ``source``, but a field's own ``metadata=``) that
    rename a settings field: a field-like key whose value is a flag, a tuple of flags, or another
    dest name (``{"num_ranks": "--ranks"}``, ``{"num_ranks": "ranks"}``,
    ``{"pipeline.name": ("--pipeline",)}``)."""
    tree = ast.parse(source)
    metadata = {id(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                for k in node.keywords if k.arg == "metadata"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Dict) or id(node) in metadata:
            continue
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str) and _FIELD_KEY.fullmatch(k.value)):
                continue
            values = v.elts if isinstance(v, (ast.Tuple, ast.List)) else [v]
            names = [e.value for e in values if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(names) == len(values) and _renames(k.value, names):
                found.append(f"{k.value!r}: {names}")
    return found


def _cli_modules() -> list[pathlib.Path]:
    """The command-line modules and the config modules their flags come from."""
    paths = [REPO / "fsdata/cli.py", REPO / "fsdata/common/cli.py", REPO / "fstrain/cli.py",
             *sorted((REPO / "pipelines").rglob("cli.py")), *sorted((REPO / "pipelines").rglob("config.py"))]
    return [p for p in paths if p.exists()]


def test_the_renaming_check_finds_the_old_tables():
    """The check below fails on the tables fsdata/cli.py had before the spellings moved onto the fields."""
    old = ('_BALANCE_DEST = {"num_ranks": "ranks"}\nFLAGS = {"num_ranks": "--ranks", "has_header": "--header"}\n'
           'NIGHTLY = {"job": {"output": ("-o", "--output")}}\n'
           'def parse(a):\n    return {"num_ranks": "ranks"}.get(a, a)\n')
    assert len(_renamings(old)) == 5
    assert not _renamings('COMMANDS = {"convert": _cmd_convert}\nD = {"embedding_dim": 32, "metrics.dir": "DIR"}\n'
                          'P = {"model": "", "pipeline": "pipeline-"}\nS = {"num_ranks": "num_ranks"}\n'
                          'NO_FLAG = {"balance": ("progress", "overwrite")}\nNEW = {"bad_lines": "error"}\n'
                          'x: int = field(default=0, metadata={"flag": "--x"})\n')


@pytest.mark.parametrize("path", _cli_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_cli_module_keeps_a_table_renaming_settings_fields(path):
    """A flag spelled otherwise than ``--field-name`` (``--ranks`` for ``num_ranks``) is declared on the
    field (``field(metadata={"flag": ...})``, read by :func:`fsdata.common.cli.add_settings_flags`),
    never in a table of the command line that renames fields to flags or dests."""
    assert not _renamings(path.read_text()), (path, _renamings(path.read_text()))


def test_fstrain_config_keeps_no_table_renaming_settings_fields():
    path = REPO / "fstrain/config.py"
    assert not _renamings(path.read_text()), (path, _renamings(path.read_text()))
