"""Read a target's signature from source without importing it (stdlib ``ast`` only).

Coupled targets (``Target.group``) are checked all at once when the first member is about to be applied,
but the other members' modules may not be imported yet, and importing them early would change the order in
which the stack initialises. This module finds their ``.py`` files through the top-level package's spec
(``importlib.util.find_spec(top)`` never executes the package) and reads the definitions with ``ast``:

- :func:`find_module_source` — the file a module would be loaded from, or None;
- :func:`read_parameters` — the parameter names of ``Class.method`` / ``function`` in the class or module
  that *defines* it (an inherited method is absent, as for :func:`kda_patches.registry.resolve_attribute`),
  following ``from X import name`` re-exports; None when absent;
- :func:`read_module_version` — the ``__version__`` a module file sets (a literal, or followed through
  ``from X import __version__``).

The same readers serve release conformance on downloaded sources: pass ``locate`` (module name -> file)
for a source tree that is not on ``sys.path``. Parsed trees are cached per file (parse once per process).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Callable

    Locate = Callable[[str], "pathlib.Path | None"]

_MAX_REEXPORT_DEPTH = 8
_trees: dict[pathlib.Path, ast.Module | None] = {}


def find_module_source(module_name: str) -> pathlib.Path | None:
    """Return the ``.py`` file module ``module_name`` would be loaded from, without importing it.

    Only the top-level package's spec is asked (:func:`importlib.util.find_spec` does not execute it);
    the submodule path is then walked on disk with the import system's precedence (package directory,
    then module file, then namespace portion), so no parent package is imported either.

    Args:
        module_name: absolute dotted module name.
    Returns:
        The source file (``__init__.py`` for a package), or None when it cannot be found as a ``.py`` file.
    """
    top, *rest = module_name.split(".")
    module = sys.modules.get(top)
    spec = getattr(module, "__spec__", None) if module is not None else None
    if spec is None:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return None
    if spec is None:
        return None
    if not rest:
        origin = spec.origin
        return pathlib.Path(origin) if origin and origin.endswith(".py") and pathlib.Path(origin).is_file() else None
    locations = [pathlib.Path(p) for p in (spec.submodule_search_locations or ())]
    for index, part in enumerate(rest):
        last = index == len(rest) - 1
        package, file, portions = None, None, []
        for location in locations:
            if (location / part / "__init__.py").is_file():
                package = location / part
                break
            if (location / f"{part}.py").is_file():
                file = location / f"{part}.py"
                break
            if (location / part).is_dir():
                portions.append(location / part)
        if package is not None:
            if last:
                return package / "__init__.py"
            locations = [package]
        elif file is not None:
            return file if last else None  # a plain module has no submodules
        elif portions and not last:
            locations = portions  # namespace package
        else:
            return None
    return None


def _tree(path: pathlib.Path) -> ast.Module | None:
    path = pathlib.Path(path)
    if path not in _trees:
        try:
            _trees[path] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            _trees[path] = None
    return _trees[path]


def _scope_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements of a scope, descending into ``if``/``try``/``with`` blocks (not into defs)."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If | ast.With | ast.AsyncWith | ast.For | ast.While):
            out.extend(_scope_statements(node.body + node.orelse if hasattr(node, "orelse") else node.body))
        elif isinstance(node, ast.Try):
            out.extend(_scope_statements(node.body + node.orelse + node.finalbody))
            for handler in node.handlers:
                out.extend(_scope_statements(handler.body))
    return out


def _find_definition(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The first class/function definition or import binding ``name`` in a scope."""
    for node in _scope_statements(body):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return node
    return None


def _absolute_module(node: ast.ImportFrom, module_name: str | None, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    if module_name is None:
        return None
    parts = module_name.split(".")
    base = parts if is_package else parts[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    if not base:
        return None
    return ".".join(base + ([node.module] if node.module else []))


def _parameters_of(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg is not None:
        names.append(args.vararg.arg)
    names.extend(a.arg for a in args.kwonlyargs)
    if args.kwarg is not None:
        names.append(args.kwarg.arg)
    decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
    if "classmethod" in decorators and names:
        names = names[1:]  # getattr on the class gives a bound method: inspect drops ``cls``
    return tuple(names)


def read_parameters(source_path: pathlib.Path | str, qualname: str, module_name: str | None = None,
                    locate: Locate | None = None) -> tuple[str, ...] | None:
    """Return the parameter names of ``qualname`` as defined in ``source_path`` (as ``inspect.signature`` lists them).

    Args:
        source_path: the module's ``.py`` file.
        qualname: ``function`` or ``Class.method`` (nested classes allowed).
        module_name: the module's dotted name; needed to follow relative ``from . import name`` re-exports.
        locate: module name -> source file, for following re-exports (default :func:`find_module_source`).
    Returns:
        The names (``self`` included for methods; ``cls`` dropped for classmethods), or None when the class
        or function is absent, the method is only inherited, or the file cannot be parsed.
    """
    return _read(pathlib.Path(source_path), qualname.split("."), module_name, locate or find_module_source, 0)


def _read(path: pathlib.Path, parts: list[str], module_name: str | None, locate: Locate,
          depth: int) -> tuple[str, ...] | None:
    tree = _tree(path)
    if tree is None or depth > _MAX_REEXPORT_DEPTH:
        return None
    node = _find_definition(tree.body, parts[0])
    if isinstance(node, ast.ImportFrom):  # re-exported name: read it where it is defined
        source_module = _absolute_module(node, module_name, path.name == "__init__.py")
        original = next(a.name for a in node.names if (a.asname or a.name) == parts[0])
        source = locate(source_module) if source_module else None
        if source is None:
            return None
        return _read(source, [original, *parts[1:]], source_module, locate, depth + 1)
    for part in parts[1:]:
        if not isinstance(node, ast.ClassDef):
            return None
        node = _find_definition(node.body, part)
        if isinstance(node, ast.ImportFrom):
            return None  # a name imported inside a class body: not a definition we can read
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return _parameters_of(node)
    return None


def read_module_version(source_path: pathlib.Path | str, module_name: str | None = None,
                        locate: Locate | None = None) -> str | None:
    """Return the ``__version__`` string a module file sets, or None.

    The first binding in the module's statement order wins (``try`` bodies included): a literal
    ``__version__ = "..."``, or a ``from X import __version__`` re-export followed into ``X`` (vLLM:
    ``__init__`` -> ``version`` -> ``_version``), which needs ``module_name`` for relative imports.
    """
    return _read_version(pathlib.Path(source_path), module_name, locate or find_module_source, 0)


def _read_version(path: pathlib.Path, module_name: str | None, locate: Locate, depth: int) -> str | None:
    tree = _tree(path)
    if tree is None or depth > _MAX_REEXPORT_DEPTH:
        return None
    for node in _scope_statements(tree.body):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == "__version__" for a in node.names):
            source_module = _absolute_module(node, module_name, path.name == "__init__.py")
            source = locate(source_module) if source_module else None
            found = _read_version(source, source_module, locate, depth + 1) if source is not None else None
            if found is not None:
                return found
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        if any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets) \
                and isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
    return None
