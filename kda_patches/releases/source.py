"""Read a release's source with ``ast`` (never import it): modules, definitions, signatures, classes.

A :class:`ReleaseSource` answers, for one release folder (see :mod:`kda_patches.releases.fetch`), the
questions the registry asks of a live module, without running any of it:

- :meth:`ReleaseSource.resolve`: what ``module:qualname`` is bound to — a ``def``, a ``class``, a
  module-level name bound by ``import`` (``from x import clear_ssm_states``, followed to its definition),
  or a plain assignment. Like :func:`kda_patches.registry.resolve_attribute`, a method must be defined in
  the named class itself (an inherited one does not resolve).
- :meth:`ReleaseSource.parameters`: the parameter names ``inspect.signature`` would report for that
  object as the registry reads it, by :func:`kda_patches.static_check.read_parameters` (one reader for
  the runtime group check and for conformance); decorators are taken to preserve the signature
  (``functools.wraps``), as vLLM's do.
- :meth:`ReleaseSource.classes_defining`: which classes of a module define a given attribute, with their
  base-class names (e.g. which Kimi class defines ``_run_prefill`` in ``vllm_ascend.ops.kimi_kda``).

Module-level bindings are read from the module body including ``if`` / ``try`` / ``with`` blocks (both
branches); the first binding in statement order wins, the rule of :mod:`kda_patches.static_check` (whose
``read_parameters`` this reader uses for signatures), so both readers always agree on what a name is.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

from kda_patches import static_check
from kda_patches.static_check import read_parameters

_MAX_IMPORT_HOPS = 8


@dataclasses.dataclass(frozen=True)
class Definition:
    """What a ``module:qualname`` is bound to in a release.

    Attributes:
        kind: ``function``, ``class``, ``assignment`` or ``module`` (after following imports).
        module: module that holds the definition (differs from the asked module when an import was followed).
        qualname: qualified name inside ``module``.
        path: the source file.
        relative_path: the source file relative to the release folder (``vllm/models/...py``), for messages.
        node: the AST node (``FunctionDef``/``AsyncFunctionDef``/``ClassDef``/assigned value; Module for modules).
        via: the ``module:name`` import bindings followed to get here, in order (empty when defined directly).
        is_classmethod: the definition is a method decorated ``@classmethod``.
    """

    kind: str
    module: str
    qualname: str
    path: pathlib.Path
    relative_path: str
    node: ast.AST
    via: tuple[str, ...] = ()
    is_classmethod: bool = False


@dataclasses.dataclass(frozen=True)
class ClassInfo:
    """A class found in a module: its name, the dotted names of its bases, its AST node."""

    name: str
    bases: tuple[str, ...]
    node: ast.ClassDef


def dotted_name(node: ast.AST) -> str | None:
    """Return ``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        parent = dotted_name(node.value)
        return None if parent is None else f"{parent}.{node.attr}"
    return None


def _is_classmethod(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
        dotted_name(decorator) == "classmethod" for decorator in node.decorator_list)


def _scope_bindings(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Return name -> binding node of one scope (module or class body).

    The first binding in statement order wins, descending into ``if`` / ``with`` / ``try`` blocks (``try``
    body, ``else``, ``finally``, then handlers): the rule of :mod:`kda_patches.static_check`, so that a
    definition this reader finds is the one whose signature that reader reports.
    """
    bindings: dict[str, ast.AST] = {}

    def bind(name: str, node: ast.AST) -> None:
        bindings.setdefault(name, node)

    def visit(statements: list[ast.stmt]) -> None:
        for statement in statements:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(statement.name, statement)
            elif isinstance(statement, (ast.Import, ast.ImportFrom)):
                for alias in statement.names:
                    if alias.name != "*":
                        bind(alias.asname or alias.name.split(".")[0], statement)
            elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        bind(target.id, statement)
            elif isinstance(statement, (ast.If, ast.For, ast.While)):
                visit(statement.body + statement.orelse)
            elif isinstance(statement, (ast.With, ast.AsyncWith)):
                visit(statement.body)
            elif isinstance(statement, ast.Try):
                visit(statement.body + statement.orelse + statement.finalbody)
                for handler in statement.handlers:
                    visit(handler.body)

    visit(body)
    return bindings


class ReleaseSource:
    """AST view of one release folder (``root`` holds the top-level packages, e.g. ``root/vllm/...``)."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = pathlib.Path(root)
        self._trees: dict[str, ast.Module | None] = {}

    def module_path(self, module: str) -> pathlib.Path | None:
        """Return the file of ``module`` (``a/b.py`` or ``a/b/__init__.py``), or None when absent."""
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def module_tree(self, module: str) -> ast.Module | None:
        """Return the parsed module, or None when the module is absent (or does not parse).

        Trees come from :mod:`kda_patches.static_check`'s per-file cache, so a file is parsed once per process
        for both readers and for every stack that shares a release (parsing is most of conformance's time).
        """
        if module not in self._trees:
            path = self.module_path(module)
            self._trees[module] = static_check._tree(path) if path is not None else None
        return self._trees[module]

    def resolve(self, module: str, qualname: str) -> Definition | None:
        """Return what ``module:qualname`` is bound to, following module-level imports; None when absent."""
        return self._resolve(module, qualname, (), 0)

    def _resolve(self, module: str, qualname: str, via: tuple[str, ...], hops: int) -> Definition | None:
        tree = self.module_tree(module)
        path = self.module_path(module)
        if tree is None or path is None:
            return None
        first, *rest = qualname.split(".")
        binding = _scope_bindings(tree.body).get(first)
        if binding is None:
            return None
        if isinstance(binding, (ast.Import, ast.ImportFrom)):
            if hops >= _MAX_IMPORT_HOPS:
                return None
            origin = self._import_origin(module, path, binding, first)
            if origin is None:
                return None
            source_module, source_name = origin
            hop = (*via, f"{module}:{first}")
            if source_name is None:  # ``import a.b as c`` or ``from a import submodule``
                return self._resolve_in_module(source_module, rest, hop, hops + 1)
            found = self._resolve(source_module, ".".join([source_name, *rest]), hop, hops + 1)
            if found is None and not rest:
                return self._resolve_in_module(f"{source_module}.{source_name}", [], hop, hops + 1)
            return found
        node: ast.AST = binding
        names = [first]
        for part in rest:
            if not isinstance(node, ast.ClassDef):
                return None
            node = _scope_bindings(node.body).get(part)
            if node is None or isinstance(node, (ast.Import, ast.ImportFrom)):
                return None
            names.append(part)
        return self._definition(module, ".".join(names), path, node, via, bool(rest))

    def _resolve_in_module(self, module: str, rest: list[str], via: tuple[str, ...], hops: int) -> Definition | None:
        if not rest:
            tree, path = self.module_tree(module), self.module_path(module)
            if tree is None or path is None:
                return None
            return Definition("module", module, "", path, self._relative(path), tree, via)
        return self._resolve(module, ".".join(rest), via, hops)

    def _relative(self, path: pathlib.Path) -> str:
        return path.relative_to(self.root).as_posix()

    def _definition(self, module: str, qualname: str, path: pathlib.Path, node: ast.AST, via: tuple[str, ...],
                    in_class: bool) -> Definition:
        relative = self._relative(path)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Definition("function", module, qualname, path, relative, node, via,
                              in_class and _is_classmethod(node))
        if isinstance(node, ast.ClassDef):
            return Definition("class", module, qualname, path, relative, node, via)
        value = getattr(node, "value", None)
        return Definition("assignment", module, qualname, path, relative, value if value is not None else node, via)

    def _import_origin(self, module: str, path: pathlib.Path, node: ast.Import | ast.ImportFrom,
                       bound: str) -> tuple[str, str | None] | None:
        """Return ``(source module, source name or None for a module)`` of the import binding ``bound``."""
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname == bound:
                    return alias.name, None
                if alias.asname is None and alias.name.split(".")[0] == bound:
                    return bound, None
            return None
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        if node.level:
            parts = package.split(".")
            if node.level - 1 >= len(parts):
                return None
            base = ".".join(parts[: len(parts) - (node.level - 1)])
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module or ""
        for alias in node.names:
            if (alias.asname or alias.name) == bound:
                return source, alias.name
        return None

    def parameters(self, module: str, qualname: str) -> tuple[str, ...] | None:
        """Return the parameter names the registry would read for ``module:qualname``; None when not a def.

        Read by :func:`kda_patches.static_check.read_parameters` (the reader the registry's own group check
        uses), with this release folder as the place modules are found.
        """
        path = self.module_path(module)
        return None if path is None else read_parameters(path, qualname, module, locate=self.module_path)

    def classes(self, module: str) -> list[ClassInfo]:
        """Return the module-level classes of ``module`` in source order (empty when absent)."""
        tree = self.module_tree(module)
        if tree is None:
            return []
        return [ClassInfo(node.name, tuple(filter(None, (dotted_name(base) for base in node.bases))), node)
                for node in _scope_bindings(tree.body).values() if isinstance(node, ast.ClassDef)]

    def classes_defining(self, module: str, attribute: str) -> list[ClassInfo]:
        """Return the classes of ``module`` whose own body binds ``attribute`` (a method or class attribute)."""
        return [info for info in self.classes(module) if attribute in _scope_bindings(info.node.body)]

    def class_attribute(self, module: str, qualname: str) -> ast.AST | None:
        """Return the value node of a class-level assignment ``module:Class.attr``, or None."""
        found = self.resolve(module, qualname)
        return found.node if found is not None and found.kind == "assignment" else None
