"""Code blocks of docs/api.md that tests run as written: the install lines, the example, the extras table."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT

API_MD = REPO_ROOT / "docs" / "api.md"


def block(marker: str) -> str:
    """The fenced code block right after ``<!-- marker -->`` in docs/api.md."""
    text = API_MD.read_text()
    m = re.search(rf"<!-- {re.escape(marker)} -->\n```[a-z]*\n(.*?)```", text, re.S)
    assert m, f"docs/api.md has no code block after <!-- {marker} -->"
    return m.group(1)


def commands(marker: str) -> list[str]:
    """The command lines of an install block (one per line)."""
    return [ln.strip() for ln in block(marker).splitlines() if ln.strip() and not ln.strip().startswith("#")]


def extras_table() -> dict[str, list[str]]:
    """The extras table: extra name (``core`` for the first row) -> its backticked requirements, in order."""
    text = API_MD.read_text()
    body = text.split("<!-- extras-table", 1)[1].split("<!-- /extras-table -->", 1)[0]
    rows = {}
    for line in body.splitlines():
        if not line.startswith("| ") or line.startswith("| extra") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = "core" if cells[0] == "(core)" else cells[0].strip("`[]")
        rows[name] = re.findall(r"`([^`]+)`", cells[1])
    return rows
