"""The routing core has no import circle, and the seam declarations import nothing of the mechanism.

Every ``import`` / ``from ... import`` of the routing modules counts, deferred ones inside functions too
(a deferred import is still an edge of the circle: it only moves when the cycle bites).
"""

from __future__ import annotations

import ast
import pathlib

ROUTING = pathlib.Path(__file__).resolve().parents[2] / "kda_patches" / "routing"
PACKAGE = "kda_patches.routing"


def imported_routing_modules(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:
                found.update(f"{PACKAGE}.{alias.name}" for alias in node.names)
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith(PACKAGE + "."))
    return found


def routing_graph() -> dict[str, set[str]]:
    return {f"{PACKAGE}.{path.stem}": imported_routing_modules(path) for path in ROUTING.glob("*.py")
            if path.stem != "__init__"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Return one import cycle as a path, or None (depth-first search)."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target):], target] if target in path else [*path, target]
            if state.get(target) is None:
                cycle = visit(target, [*path, target])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if state.get(node) is None:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_the_routing_core_has_no_import_circle():
    assert find_cycle(routing_graph()) is None, " -> ".join(find_cycle(routing_graph()) or [])


def test_the_seam_declarations_import_nothing_of_the_mechanism():
    tree = ast.parse((ROUTING / "seams.py").read_text(encoding="utf-8"))
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {module for module in modules if module and module.startswith("kda_patches")} == set()


def test_the_cycle_finder_finds_a_deferred_circle():
    # the shape the core had: seams' wrappers imported calls on first use, and calls imported seams
    assert find_cycle({"seams": {"calls"}, "calls": {"seams", "alias"}, "alias": set()}) == ["calls", "seams",
                                                                                             "calls"]
