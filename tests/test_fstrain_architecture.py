"""fstrain's layout (docs/architecture.md, "fstrain"): role packages in layers, small modules, and
the named public surface of fsdata it imports. Read statically with ``ast``, lazy imports inside
functions included."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOT = REPO / "fstrain"

#: What fstrain may import from fsdata: module -> names (``*``: every public name of the module).
#: A module imported whole (``from fsdata.samples import schema``) is checked by the attributes used.
FSDATA_SURFACE = {
    "fsdata.shards.manifest": {"Manifest", "ManifestError"},
    "fsdata.samples.schema": {"*"},
    "fsdata.fsio": {"exists", "filesystem_and_path"},
    "fsdata.balancer.bubble": {"run_bubble", "step_bubbles", "reduction"},
    "fsdata.errors": {"FsdataError", "cli_terms", "command", "in_cli", "setting"},
    "fsdata.common.cli": {"add_common_flags", "add_json_flag", "add_output_flag", "add_settings_flags",
                          "add_subcommands", "add_version_flag", "cli_main", "configure_logging", "new_parser",
                          "resolve_progress", "settings_help", "subparsers"},
    "fsdata.guards": {"check_output_apart", "process_alive"},
    "fsdata.atomic": {"check_replaceable", "register_output_kind"},
    "fsdata.common.page": {"Figure", "pyplot", "figure_png", "write_page"},
    "fsdata.common.registry": {"Registry"},
    "fsdata.report": {"load_output", "output_figures", "output_rows"},
}

#: fstrain's packages and top-level modules, bottom to top: a module imports its own layer or lower ones.
LAYERS = {"fstrain.errors": 0, "fstrain.compat": 0, "fstrain.quiet": 0, "fstrain.data": 1, "fstrain.models": 2,
          "fstrain.distributed": 3,
          "fstrain.components": 4, "fstrain.pipelines": 5, "fstrain.measure": 6, "fstrain.config": 6,
          "fstrain.train": 7, "fstrain.cli": 8, "fstrain": 8}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(REPO).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return out


def _fsdata_uses(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(fsdata module, name)`` of every fsdata import of ``path`` (whole modules: each attribute used)."""
    tree = ast.parse(path.read_text())
    uses, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses += [(a.name, "<import>") for a in node.names if a.name.split(".")[0] == "fsdata"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fsdata":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if (REPO / (sub.replace(".", "/") + ".py")).exists():
                    aliases[a.asname or a.name] = sub  # a module: check what is used of it
                else:
                    uses.append((node.module, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            uses.append((aliases[node.value.id], node.attr))
    return uses


def test_fstrain_imports_only_the_public_surface_of_fsdata():
    bad = []
    for mod, path in _modules().items():
        for fmod, name in _fsdata_uses(path):
            allowed = FSDATA_SURFACE.get(fmod, set())
            if not ("*" in allowed and not name.startswith("_") or name in allowed):
                bad.append(f"{mod} uses {fmod}.{name}")
    assert not bad, "outside fsdata's public surface (docs/architecture.md):\n" + "\n".join(sorted(set(bad)))


def _layer(mod: str) -> int:
    parts = mod.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise AssertionError(f"{mod} is in no layer; add it to tests/test_fstrain_architecture.py")


def test_no_upward_import_in_fstrain():
    bad = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fstrain":
                deps = [node.module]
            elif isinstance(node, ast.Import):
                deps = [a.name for a in node.names if a.name.split(".")[0] == "fstrain"]
            else:
                continue
            for dep in deps:
                if dep != "fstrain" and _layer(dep) > _layer(mod):
                    bad.append(f"{mod} ({_layer(mod)}) imports {dep} ({_layer(dep)})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(set(bad)))


def test_fstrain_is_small_rooms():
    """At most 7 top-level modules (packages do not count) and no module over 500 lines."""
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 7, top
    long = {str(p.relative_to(REPO)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
