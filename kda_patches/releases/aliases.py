"""Where a release imports a wrapped function by name, and whether the overlay's wrapper reaches each place.

The runtime rebinds the module-level aliases of a function its module defines (:mod:`kda_patches.aliases`).
This module finds, in a release's own files, every ``from M import name [as other]`` of such a target
(relative imports resolved; re-exports followed: ``from X import name`` where ``X`` itself imported it at
module level) and classifies each by the scope it runs in:

- ``module``: covered. Imported before the overlay activates, the name is rebound when the target is
  wrapped; imported after, it reads the wrapper.
- ``function``: covered. The import runs at call time, after the wrapper is in place.
- ``class``: **not covered**. The function is bound into a class body when the class is created; the
  overlay rebinds module namespaces only, so such a class keeps the original (conformance: *broken*).

A target that names an *import* (the function is defined elsewhere: "the name that module calls") wraps
that one name on purpose; its other importers are not the patch's, and none are listed.

Files are pre-filtered by a text search for the name before parsing, so a release's thousands of files
cost one read each. Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import ast
import pathlib

from kda_patches import static_check
from kda_patches.releases.source import ReleaseSource

COVERED_SCOPES = {"module": "rebound at apply, or imported after the wrapper is in place",
                  "function": "imported at call time, after the wrapper is in place"}
_MAX_REEXPORT_HOPS = 4


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_of(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    parts = package.split(".")
    base = ".".join(parts[: max(len(parts) - (node.level - 1), 0)])
    return f"{base}.{node.module}" if node.module else base


def _imports_in(tree: ast.Module) -> list[tuple[ast.ImportFrom, str]]:
    """Every ``from ... import`` of a module with the scope it runs in (module / function / class)."""
    found: list[tuple[ast.ImportFrom, str]] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                found.append((child, scope))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, "function")
            elif isinstance(child, ast.ClassDef):
                visit(child, "class" if scope != "function" else "function")
            else:
                visit(child, scope)

    visit(tree, "module")
    return found


_FILES_WITH: dict[tuple[pathlib.Path, str], list[pathlib.Path]] = {}


def _files_with(root: pathlib.Path, name: str) -> list[pathlib.Path]:
    """The release's ``.py`` files whose text contains ``name`` (cached per release and name)."""
    key = (root, name)
    if key not in _FILES_WITH:
        found = []
        for path in sorted(root.rglob("*.py")):
            try:
                if name in path.read_text(encoding="utf-8", errors="replace"):
                    found.append(path)
            except OSError:
                continue
        _FILES_WITH[key] = found
    return _FILES_WITH[key]


def find_importers(sources: list[ReleaseSource], module: str, name: str) -> list[dict]:
    """Return every place the stack's releases import ``module``'s ``name`` by name, re-exports followed.

    Args:
        sources: every release of the stack (a fork imports upstream's functions too).
        module: the target's module.
        name: the module-level function's name.
    Returns:
        Dicts ``{"module", "line", "bound", "scope", "from", "covered", "why"}``, sorted by module and line.
    """
    wanted = {(module, name)}
    results: dict[tuple[str, int, str], dict] = {}
    for _ in range(_MAX_REEXPORT_HOPS):
        names = sorted({wanted_name for _, wanted_name in wanted})
        added = set()
        paths = sorted({(source.root, path) for source in sources for wanted_name in names
                        for path in _files_with(source.root, wanted_name)})
        for root, path in paths:
            tree = static_check._tree(path)
            if tree is None:
                continue
            importer = _module_name(root, path)
            for node, scope in _imports_in(tree):
                origin = _source_of(importer, path.name == "__init__.py", node)
                for alias in node.names:
                    if (origin, alias.name) not in wanted or (importer == module and alias.name == name):
                        continue
                    bound = alias.asname or alias.name
                    key = (importer, node.lineno, bound)
                    if key in results:
                        continue
                    covered = scope in COVERED_SCOPES
                    results[key] = {"module": importer, "line": node.lineno, "bound": bound, "scope": scope,
                                    "from": f"{origin}:{alias.name}", "covered": covered,
                                    "why": COVERED_SCOPES.get(scope, "bound into a class body at class creation; "
                                                              "the overlay rebinds module namespaces only")}
                    if scope == "module":
                        added.add((importer, bound))
        if not added - wanted:
            break
        wanted |= added
    return sorted(results.values(), key=lambda entry: (entry["module"], entry["line"], entry["bound"]))


def alias_report(source: ReleaseSource | None, sources: list[ReleaseSource], module: str,
                 qualname: str) -> dict | None:
    """Return ``{"defines", "importers", "uncovered"}`` for a module-level function target, or None otherwise.

    Args:
        source: the release that ships ``module``.
        sources: every release of the stack (where importers are looked for).
        module, qualname: the target.
    ``defines`` is False when the module binds the name by an import (then no importers are listed: the
    target wraps only that name, see the module docstring).
    """
    if source is None or "." in qualname:
        return None
    definition = source.resolve(module, qualname)
    if definition is None or definition.kind != "function":
        return None
    if definition.via:
        return {"defines": False, "importers": [], "uncovered": []}
    importers = find_importers(sources, module, qualname)
    return {"defines": True, "importers": importers,
            "uncovered": [entry for entry in importers if not entry["covered"]]}
