"""A release module served lazily: its names compiled from the release file on first use.

:class:`LazyModule` indexes the top-level names of one release file (definitions, assignments, imports, names
bound inside ``if`` / ``try`` blocks, star imports) and compiles a name's statement into the module's namespace
the first time something reads it; its namespace (a dict whose ``__missing__`` compiles) makes the release code's
own global reads lazy too. Resolution across modules, stand-ins and the record of what ran are the
:class:`~kda_patches.kv_layout.release_exec.ReleaseTree`'s (see that module's docstring).
"""

from __future__ import annotations

import ast
import pathlib
import sys
import textwrap
import types
from typing import TYPE_CHECKING, Any

from kda_patches.kv_layout.release_compile import absolute_name, compile_at, definition_time_names

if TYPE_CHECKING:
    from kda_patches.kv_layout.release_exec import ReleaseTree


class _Namespace(dict):
    """A release module's globals: a name not yet bound is compiled (or imported) from the release on first read."""

    def __init__(self, module: LazyModule) -> None:
        super().__init__()
        self.kda_module = module

    def __missing__(self, name: str) -> Any:
        module = self.kda_module
        if name in module._kda["busy"] or not module.defines(name):
            if name in module._kda["tree"].standins_for(module._kda["name"]):
                return module.kda_resolve(name)
            raise KeyError(name)  # builtins next, else NameError where the release reads it
        return module.kda_resolve(name)


class _Entry:
    """Where a top-level name of a module comes from: a statement, or an import (module, attribute)."""

    __slots__ = ("attribute", "module", "node")

    def __init__(self, node: ast.stmt | None = None, module: str | None = None, attribute: str | None = None):
        self.node, self.module, self.attribute = node, module, attribute


class LazyModule(types.ModuleType):
    """A release module whose names are compiled on first use (see the module docstring)."""

    def __init__(self, tree: ReleaseTree, name: str, path: pathlib.Path | None, is_package: bool) -> None:
        super().__init__(f"_kda_release.{tree.tag}.{name}")
        namespace = _Namespace(self)
        object.__setattr__(self, "_kda", {"tree": tree, "name": name, "path": path, "package": is_package,
                                          "index": None, "lines": None, "busy": set(), "ns": namespace,
                                          "stars": []})
        namespace.update(__name__=self.__name__, __builtins__=tree.builtins_for(name, is_package),
                         __package__=name if is_package else name.rpartition(".")[0])
        if path is not None:
            self.__file__ = namespace["__file__"] = str(path)
        sys.modules[self.__name__] = self

    def __setattr__(self, attribute: str, value: Any) -> None:
        """Assignments to a release module (the forks' monkeypatches) rebind the name its code reads."""
        if not attribute.startswith("__"):
            self._kda["ns"][attribute] = value
        object.__setattr__(self, attribute, value)

    @property
    def kda_namespace(self) -> dict[str, Any]:
        """The globals of the module's compiled definitions."""
        return self._kda["ns"]

    # -- index ----------------------------------------------------------------------------------------------
    def _index(self) -> dict[str, _Entry]:
        state = self._kda
        if state["index"] is not None:
            return state["index"]
        index: dict[str, _Entry] = {}
        path = state["path"]
        if path is not None:
            text = path.read_text(encoding="utf-8")
            state["lines"] = text.splitlines(keepends=True)
            self._walk(ast.parse(text, str(path)).body, index)
        state["index"] = index
        return index

    def _absolute(self, module: str | None, level: int) -> str:
        package = self._kda["name"] if self._kda["package"] else self._kda["name"].rpartition(".")[0]
        return absolute_name(package, module, level)

    def _walk(self, body: list[ast.stmt], index: dict[str, _Entry]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                index.setdefault(node.name, _Entry(node))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            index.setdefault(name.id, _Entry(node))
            elif isinstance(node, ast.ImportFrom):
                module = self._absolute(node.module, node.level)
                for alias in node.names:
                    if alias.name == "*":
                        self._kda["stars"].append(module)
                    else:
                        index.setdefault(alias.asname or alias.name, _Entry(module=module, attribute=alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        index.setdefault(alias.asname, _Entry(module=alias.name))
                    else:
                        top = alias.name.split(".")[0]
                        index.setdefault(top, _Entry(module=top))
            elif isinstance(node, (ast.Try, ast.If)):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    self._walk(node.orelse, index)
                    continue
                # names bound inside run the whole statement (its condition or handlers decide)
                for name in self._bound_names(node):
                    index.setdefault(name, _Entry(node))

    def _bound_names(self, node: ast.stmt) -> set[str]:
        inner: dict[str, _Entry] = {}
        if isinstance(node, (ast.Try, ast.If)):
            bodies = [node.body, node.orelse, *(handler.body for handler in getattr(node, "handlers", []))]
            for body in bodies:
                self._walk(body, inner)
        else:
            self._walk([node], inner)
        return set(inner)

    def defines(self, name: str) -> bool:
        """Whether the release file has a top-level definition, assignment or import of ``name`` (star imports
        of release modules included)."""
        if name in self._index():
            return True
        tree = self._kda["tree"]
        return not name.startswith("_") and any(
            (source := tree.lazy_module(star)) is not None and source.defines(name) for star in self._kda["stars"])

    def node_of(self, name: str) -> ast.stmt | None:
        """The top-level statement of the release file that binds ``name``, or None (absent, or imported)."""
        entry = self.kda_entry(name)
        return None if entry is None else entry.node

    def kda_entry(self, name: str) -> _Entry | None:
        """Where the release file binds ``name`` (a statement, or an import), or None."""
        return self._index().get(name)

    def kda_statements(self) -> list[ast.stmt]:
        """The top-level statements of the release file, parsed with its file name."""
        self._index()
        return ast.parse("".join(self._kda["lines"]), str(self.__file__)).body

    # -- resolution -----------------------------------------------------------------------------------------
    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute not in ("__getattr__",):
            raise AttributeError(attribute)
        return self.kda_resolve(attribute)

    def kda_resolve(self, attribute: str) -> Any:
        """Return the module's ``attribute``, compiling or importing it on first use."""
        namespace = self._kda["ns"]
        if dict.__contains__(namespace, attribute):
            return dict.__getitem__(namespace, attribute)
        state, tree = self._kda, self._kda["tree"]
        standin = tree.standin(state["name"], attribute)
        if standin is not tree.MISSING:
            namespace[attribute] = standin
            return standin
        entry = self._index().get(attribute)
        if entry is None and not attribute.startswith("_"):
            for star in state["stars"]:
                source = tree.lazy_module(star)
                if source is not None and source.defines(attribute):
                    entry = _Entry(module=star, attribute=attribute)
                    break
        if entry is None:
            submodule = f"{state['name']}.{attribute}"
            if tree.has_module(submodule):
                value = tree.module(submodule)
                namespace[attribute] = value
                return value
            if "__getattr__" in self._index() and attribute != "__getattr__":
                return self.kda_resolve("__getattr__")(attribute)
            raise AttributeError(f"release module {state['name']} has no {attribute!r}")
        if entry.node is None:
            value = tree.import_value(entry.module, entry.attribute)
            namespace[attribute] = value
            return value
        self.kda_compile(entry.node)
        if not dict.__contains__(namespace, attribute):
            raise AttributeError(f"release module {state['name']}: compiling {attribute!r} did not bind it")
        return dict.__getitem__(namespace, attribute)

    def source_of(self, node: ast.stmt) -> tuple[str, int]:
        """Return the release text of ``node`` (decorators included) and its first line number."""
        self._index()
        lines = self._kda["lines"]
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        return "".join(lines[start - 1:node.end_lineno]), start

    def kda_prepare(self, source: str) -> None:
        """Bind the globals ``source`` reads at definition time (see :func:`definition_time_names`)."""
        namespace = self._kda["ns"]
        for name in sorted(definition_time_names(source)):
            if dict.__contains__(namespace, name) or name in self._kda["busy"]:
                continue
            if self.defines(name) or name in self._kda["tree"].standins_for(self._kda["name"]):
                self.kda_resolve(name)

    def kda_compile(self, node: ast.stmt) -> None:
        """Compile one top-level statement of the release file into this module's namespace.

        Globals its code reads resolve lazily (:class:`_Namespace`), at definition time (bases, decorators,
        defaults) or when a function runs.
        """
        state, tree = self._kda, self._kda["tree"]
        names = self._bound_names(node)
        if names & state["busy"]:
            return
        state["busy"] |= names
        try:
            source, start = self.source_of(node)
            self.kda_prepare(source)
            exec(compile_at(source, start, str(state["path"])), state["ns"])
            for name in names:
                tree.record(state["name"], name, "release")
        finally:
            state["busy"] -= names

    def kda_literal_attributes(self, class_name: str) -> list[tuple[tuple[str, int], str]]:
        """``((source, line), name)`` of the class body's assignments of literal values (flags, constants)."""
        node = self.node_of(class_name)
        found = []
        for child in getattr(node, "body", []):
            if not isinstance(child, (ast.Assign, ast.AnnAssign)) or child.value is None:
                continue
            targets = child.targets if isinstance(child, ast.Assign) else [child.target]
            if len(targets) != 1 or not isinstance(targets[0], ast.Name):
                continue
            try:
                ast.literal_eval(child.value)
            except ValueError:
                continue
            source, start = self.source_of(child)
            found.append(((textwrap.dedent(source), start), targets[0].id))
        return found

    def kda_method_source(self, class_name: str, method: str) -> tuple[str, int] | None:
        """Return the release text (dedented) and first line of ``class_name.method``, or None if not defined."""
        node = self.node_of(class_name)
        if not isinstance(node, ast.ClassDef):
            return None
        for child in node.body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == method:
                source, start = self.source_of(child)
                return textwrap.dedent(source), start
        return None
