"""Import-graph check shared by the layer tests (tests/test_architecture.py, fstrain's no-cycle test)."""

from __future__ import annotations


def assert_no_cycle(edges: dict[str, set[str]]) -> None:
    """Raise ``AssertionError`` naming the first import cycle in ``edges`` (module -> imported modules)."""
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(d):], d]))
            if d not in state:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
