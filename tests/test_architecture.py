"""The layer rule of fsdata (docs/architecture.md): no module imports from a layer above its own,
and the imports between fsdata modules form no cycle. Read statically with ``ast``, imports inside
functions included; the deprecated flat aliases (``fsdata.plan`` ...) are used by nothing in the project."""

from __future__ import annotations

import ast
import importlib
import pathlib
import sys
import warnings

import pytest

from tests.importgraph import assert_no_cycle

REPO = pathlib.Path(__file__).resolve().parents[1]

#: Layers bottom to top; a module may import its own layer or a lower one.
LAYERS = {
    "base": 0, "samples": 1, "balancer": 2, "shards": 3, "engines": 4, "cli": 5,
}
BASE = {"fsdata.errors", "fsdata.atomic", "fsdata.guards", "fsdata.fsio", "fsdata._deprecated", "fsdata._version"}
CLI = {"fsdata.cli", "fsdata.cliutil", "fsdata.report", "fsdata.__main__"}
#: Old flat paths, kept one release as deprecated aliases of the new modules.
DEPRECATED = {"fsdata." + m for m in (
    "schema io diagnose convert holdout synth cost bubble compose partition partition_fast kk cpsat "
    "cost_budget plan profile manifest verify balance").split()}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """fsdata modules that ``path`` imports (``from fsdata.x import y`` counts ``fsdata.x.y`` when that
    is a module)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "fsdata":
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            deps |= subs or {node.module}
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name.split(".")[0] == "fsdata"}
    return deps


def _fsdata_graph() -> dict[str, set[str]]:
    paths = sorted((REPO / "fsdata").rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) - {_module_name(p)} for p in paths}


def _layer(mod: str) -> int:
    if mod in BASE:
        return LAYERS["base"]
    if mod in CLI or mod in DEPRECATED or mod == "fsdata":
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
        if mod == "fsdata" or mod in DEPRECATED:
            continue  # the package facade and the aliases sit on top
        for dep in deps:
            if dep == "fsdata":
                continue  # ``from fsdata import __version__``
            if _layer(dep) > _layer(mod):
                bad.append(f"{mod} ({_layer(mod)}) imports {dep} ({_layer(dep)})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycle_in_fsdata():
    graph = _fsdata_graph()
    edges = {m: {d for d in deps if d in graph and d != "fsdata"} for m, deps in graph.items() if m != "fsdata"}
    assert_no_cycle(edges)


def test_the_project_uses_no_deprecated_path():
    """fsdata, fstrain, pipelines and benchmarks import the new paths; only users outside hit the aliases."""
    paths = [p for d in ("fsdata", "fstrain", "pipelines", "benchmarks") for p in (REPO / d).rglob("*.py")]
    modules = {_module_name(p) for p in (REPO / "fsdata").rglob("*.py")}
    bad = [f"{_module_name(p)} imports {dep}" for p in paths if _module_name(p) not in DEPRECATED
           for dep in _imports(p, modules) & DEPRECATED]
    assert not bad, "\n".join(sorted(bad))


def test_fstrain_reads_shards_through_the_manifest_module_only():
    modules = {_module_name(p) for p in (REPO / "fsdata").rglob("*.py")}
    for p in (REPO / "fstrain").rglob("*.py"):
        deps = _imports(p, modules)
        assert not deps & {"fsdata.shards.writer", "fsdata.shards.verify", "fsdata.engines"}, p


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_old_path_imports_with_one_deprecation_warning(old):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(old)
    dep = [w for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
    assert len(dep) == 1, [str(w.message) for w in caught]
    import fsdata

    assert callable(fsdata.balance), "fsdata.balance must stay the function"


def test_old_balance_module_names_still_work():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fsdata.balance import BalanceSettings, balance, write_rank  # noqa: F401
        from fsdata.schema import MANIFEST_NAME, SAMPLE_ID  # noqa: F401
    import fsdata
    import fsdata.engines

    assert balance is fsdata.balance is fsdata.engines.balance
    assert BalanceSettings is fsdata.BalanceSettings
    assert MANIFEST_NAME == "_manifest.json" and SAMPLE_ID == "sample_id"
