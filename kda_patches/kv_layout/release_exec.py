"""Released source files executed definition by definition, under private module names.

A :class:`ReleaseTree` maps top-level packages (``vllm``, ``vllm_ascend``) to the folders of downloaded releases
(:func:`kda_patches.releases.fetch.release_dir`) and serves their modules as :class:`LazyModule` objects registered
under private names (``_kda_release.<tag>.<module>``; nothing is added to ``sys.path``, the installed vLLM is never
touched). A module is not executed as a whole: a name is compiled from the release file only when something asks
for it (an attribute access, an import, a global read by running release code: each module's namespace is a dict
whose ``__missing__`` compiles the name), so a release whose heavy modules cannot import here (device extensions,
``torch_npu``) still runs the definitions a test needs. Each definition is compiled from the release file with
that file's name and line numbers (tracebacks point into the release) and executed in its module's namespace.

How a name resolves, first match wins:

- a declared stand-in (``standins``: ``"module:name"`` or ``"module"``) -- recorded ``standin``;
- a definition, assignment or import of the release file -- ``release`` (imports recurse into the tree);
- a module of the standard library, torch, numpy or typing_extensions -- ``real``;
- anything else becomes an inert placeholder class that raises when called or instantiated -- ``inert`` (so a
  release path that needs it fails loudly, naming it).

A definition whose compilation fails raises where it is first used; a name the file does not define is a
``NameError`` there. Every resolution is recorded in :attr:`ReleaseTree.bound`, which is how a caller reports
what ran and what was stood in. Torch and vLLM-free apart from what the release files themselves import.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import importlib
import pathlib
import re
import symtable
import sys
import textwrap
import types
from typing import Any

REAL_TOP_LEVEL = frozenset(sys.stdlib_module_names) | {"torch", "numpy", "typing_extensions"}
_FLAGS = __future__.annotations.compiler_flag
_SUPER_CALL = re.compile(r"\bsuper\(\)\.(\w+)")


class StoodInUse(RuntimeError):
    """Release code used a name that was resolved to an inert or broken placeholder."""


def placeholder(module: str, name: str, why: str) -> type:
    """Return a class named ``name`` that raises :class:`StoodInUse` when called or instantiated."""
    def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise StoodInUse(f"{module}.{name} is {why}; the executed release path used it")

    return type(name, (), {"__new__": refuse, "__module__": module, "__qualname__": name, "_kda_placeholder": why})


class InertModule(types.ModuleType):
    """A module none of whose names is available: each attribute is a placeholder (recorded)."""

    def __init__(self, name: str, tree: ReleaseTree) -> None:
        super().__init__(name)
        self._tree = tree

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        value = placeholder(self.__name__, attribute, "inert (not executed here)")
        setattr(self, attribute, value)
        self._tree.record(self.__name__, attribute, "inert")
        return value


def _strip_annotations(tree: ast.AST) -> ast.AST:
    """Remove annotations (never evaluated under ``from __future__ import annotations``) before name analysis."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
                        node.args.kwarg]:
                if arg is not None:
                    arg.annotation = None
        elif isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant(value=None)
    return tree


def definition_time_names(source: str) -> set[str]:
    """Globals a top-level statement reads while it executes (its own code and class bodies, not functions).

    Those are read with ``LOAD_NAME``, which does not consult a namespace's ``__missing__``; function bodies read
    globals with ``LOAD_GLOBAL``, which does, so they resolve lazily.
    """
    table = symtable.symtable(ast.unparse(_strip_annotations(ast.parse(source))), "<release>", "exec")
    found: set[str] = set()

    def visit(scope: symtable.SymbolTable) -> None:
        top = scope.get_type() == "module"
        for symbol in scope.get_symbols():
            if top and symbol.is_referenced() and not symbol.is_assigned() and not symbol.is_imported():
                found.add(symbol.get_name())
            elif not top and symbol.is_referenced() and (symbol.is_global() or not symbol.is_assigned()):
                found.add(symbol.get_name())
        for child in scope.get_children():
            if child.get_type() == "class":
                visit(child)

    visit(table)
    return found


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
        if not level:
            return module or ""
        package = self._kda["name"] if self._kda["package"] else self._kda["name"].rpartition(".")[0]
        base = package.rsplit(".", level - 1)[0] if level > 1 else package
        return f"{base}.{module}" if module else base

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
            (source := tree._source(star)) is not None and source.defines(name) for star in self._kda["stars"])

    def node_of(self, name: str) -> ast.stmt | None:
        entry = self._index().get(name)
        return None if entry is None else entry.node

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
                source = tree._source(star)
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
            code = compile("\n" * (start - 1) + source, str(state["path"]), "exec", flags=_FLAGS, dont_inherit=True)
            exec(code, state["ns"])
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


class ReleaseTree:
    """Packages of downloaded releases served lazily under private names (see the module docstring).

    Args:
        tag: distinguishes this tree's private module names (one per release pairing).
        roots: top-level package -> the release folder holding it (``{"vllm": .../vllm-0.30.0}``).
        standins: ``"module:name"`` or ``"module"`` -> the object served instead (recorded ``standin``).
    """

    MISSING = object()

    def __init__(self, tag: str, roots: dict[str, pathlib.Path], standins: dict[str, Any] | None = None) -> None:
        self.tag = tag
        self.roots = {name: pathlib.Path(path) for name, path in roots.items()}
        self.standins = dict(standins or {})
        self.bound: dict[str, str] = {}
        self._modules: dict[str, types.ModuleType] = {}

    def record(self, module: str, name: str, kind: str) -> None:
        """Note how ``module.name`` was resolved (first record wins)."""
        self.bound.setdefault(f"{module}:{name}", kind)

    def standins_for(self, module: str) -> set[str]:
        """Names of ``module`` that have a declared stand-in."""
        prefix = f"{module}:"
        return {key[len(prefix):] for key in self.standins if key.startswith(prefix)}

    def standin(self, module: str, name: str) -> Any:
        key = f"{module}:{name}"
        if key in self.standins:
            self.record(module, name, "standin")
            return self.standins[key]
        return self.MISSING

    # -- modules --------------------------------------------------------------------------------------------
    def _file_of(self, module: str) -> tuple[pathlib.Path | None, bool] | None:
        top = module.split(".")[0]
        if top not in self.roots:
            return None
        base = self.roots[top].joinpath(*module.split("."))
        if (base / "__init__.py").is_file():
            return base / "__init__.py", True
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py"), False
        if base.is_dir():
            return None, True
        return None

    def has_module(self, module: str) -> bool:
        """Whether ``module`` is a file or package folder of the tree."""
        return self._file_of(module) is not None

    def module(self, module: str) -> types.ModuleType:
        """Return the module object a release file gets for ``import module``."""
        if module in self._modules:
            return self._modules[module]
        if module in self.standins:
            value = self.standins[module]
            self.record(module, "*", "standin")
        elif module.split(".")[0] in self.roots:
            found = self._file_of(module)
            if found is None:  # as a real import of a module the release does not ship (try/except fallbacks)
                raise ModuleNotFoundError(f"No module named {module!r} in the release", name=module)
            value = LazyModule(self, module, found[0], found[1])
        elif module.split(".")[0] in REAL_TOP_LEVEL:
            try:
                value = importlib.import_module(module)
                self.record(module, "*", "real")
            except ImportError:
                value = InertModule(module, self)
        else:
            value = InertModule(module, self)
        self._modules[module] = value
        return value

    def import_value(self, module: str, attribute: str | None) -> Any:
        """Return what ``from module import attribute`` (or ``import module`` when None) binds."""
        if attribute is None:
            return self.module(module)
        standin = self.standin(module, attribute)
        if standin is not self.MISSING:
            return standin
        target = self.module(module)
        if isinstance(target, LazyModule):
            return target.kda_resolve(attribute)
        try:
            return getattr(target, attribute)
        except AttributeError:
            if self.has_module(f"{module}.{attribute}") or module.split(".")[0] in REAL_TOP_LEVEL:
                try:
                    return importlib.import_module(f"{module}.{attribute}")
                except ImportError:
                    pass
            value = placeholder(module, attribute, "inert (absent here)")
            self.record(module, attribute, "inert")
            return value

    def builtins_for(self, importer: str, is_package: bool) -> dict[str, Any]:
        """Builtins of a release module whose ``__import__`` resolves through this tree (for local imports)."""
        package = importer if is_package else importer.rpartition(".")[0]
        tree = self

        def release_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (),
                           level: int = 0) -> Any:
            if level:
                base = package.rsplit(".", level - 1)[0] if level > 1 else package
                name = f"{base}.{name}" if name else base
            if fromlist:
                target = tree.module(name)
                for item in fromlist:
                    if isinstance(target, LazyModule):
                        continue  # resolved by attribute access
                    if not hasattr(target, item) and tree.has_module(f"{name}.{item}"):
                        setattr(target, item, tree.module(f"{name}.{item}"))
                return target
            top = name.split(".")[0]
            tree.module(name)
            return tree.module(top)

        namespace = dict(vars(builtins))
        namespace["__import__"] = release_import
        return namespace

    # -- definitions ----------------------------------------------------------------------------------------
    def get(self, module: str, name: str) -> Any:
        """Return ``module.name`` (compiled from the release on first use)."""
        return self.import_value(module, name)

    def _source(self, module: str) -> LazyModule | None:
        """The release module ``module``, or None when it is not a file of the tree."""
        if not self.has_module(module):
            return None
        lazy = self.module(module)
        return lazy if isinstance(lazy, LazyModule) else None

    def base_names(self, module: str, class_name: str) -> list[tuple[str, str]]:
        """Return ``(module, class)`` of each base of a release class, following imports (release bases only)."""
        lazy = self._source(module)
        node = lazy.node_of(class_name) if lazy is not None else None
        if not isinstance(node, ast.ClassDef):
            return []
        found = []
        for base in node.bases:
            text = ast.unparse(base)
            head, _, rest = text.partition(".")
            where = self._where(module, head)
            if where is None:
                continue
            if rest:  # module.Class
                found.append((f"{where[0]}.{where[1]}" if where[1] else where[0], rest))
            else:
                found.append(where)
        return found

    def _where(self, module: str, name: str) -> tuple[str, str] | None:
        """Follow imports of ``name`` in ``module`` to the module that defines it."""
        for _ in range(16):
            lazy = self._source(module)
            if lazy is None:
                return None
            entry = lazy._index().get(name)
            if entry is None:
                return None
            if entry.node is not None:
                return module, name
            if entry.attribute is None:
                return entry.module, ""
            module, name = entry.module, entry.attribute
            source = self._source(module)
            if self.has_module(f"{module}.{name}") and (source is None or not source.defines(name)):
                return f"{module}.{name}", ""
        return None

    def ancestors(self, module: str, class_name: str) -> list[tuple[str, str]]:
        """Return ``(module, class)`` of a release class and of its release bases, depth first."""
        seen: list[tuple[str, str]] = []
        stack = [(module, class_name)]
        while stack:
            current = stack.pop(0)
            if current not in seen:
                seen.append(current)
                stack[0:0] = self.base_names(*current)
        return seen

    def find_method(self, module: str, class_name: str, method: str) -> tuple[str, str] | None:
        """Return ``(module, class)`` of the first class in the release MRO (depth first) defining ``method``."""
        seen = set()
        stack = [(module, class_name)]
        while stack:
            current = stack.pop(0)
            if current in seen:
                continue
            seen.add(current)
            lazy = self._source(current[0])
            if lazy is not None and lazy.kda_method_source(current[1], method) is not None:
                return current
            stack[0:0] = self.base_names(*current)
        return None

    def partial_class(self, module: str, class_name: str, methods: list[str], bases: tuple[type, ...] = (),
                      extra: dict[str, Any] | None = None) -> type:
        """Build a class named like the release's with only ``methods``, each compiled from the release file.

        The methods are compiled together inside one ``class`` statement (so ``super()`` works) in the namespace
        of the module that defines them, at their release line numbers. Methods the class does not define
        itself are looked up along its release bases (:meth:`find_method`) and compiled into a base built the
        same way. ``extra`` adds attributes of ours (stood in; the caller records them).
        """
        own, inherited = [], {}
        lazy = self.module(module)
        assert isinstance(lazy, LazyModule)
        for method in methods:
            where = self.find_method(module, class_name, method)
            if where is None:
                raise AttributeError(f"{module}.{class_name}.{method}: not defined by the release class or bases")
            if where == (module, class_name):
                own.append(method)
            else:
                inherited.setdefault(where, []).append(method)
        for method in own:  # what ``super().name`` reaches must exist in the bases built here
            for name in sorted(set(_SUPER_CALL.findall(lazy.kda_method_source(class_name, method)[0]))):
                for base in self.base_names(module, class_name):
                    where = self.find_method(*base, name)
                    if where is not None:
                        if name not in inherited.setdefault(where, []):
                            inherited[where].append(name)
                        break
        parents = tuple(self.partial_class(where[0], where[1], names) for where, names in inherited.items())
        pieces = [(lazy.kda_method_source(class_name, m), m) for m in own]
        pieces += [piece for piece in lazy.kda_literal_attributes(class_name) if piece[1] not in own]
        pieces.sort(key=lambda item: item[0][1])
        first_line = pieces[0][0][1] if pieces else 2
        text = "\n" * max(first_line - 2, 0) + f"class {class_name}(*__kda_bases__):\n"
        line = max(first_line - 2, 0) + 2
        for (source, start), name in pieces:
            text += "\n" * max(start - line, 0) + textwrap.indent(source, "    ")
            line = max(start, line) + source.count("\n")
            self.record(module, f"{class_name}.{name}", "release")
        if not pieces:
            text += "    pass\n"
        for (source, _), _name in pieces:
            lazy.kda_prepare(source)
        namespace = {"__kda_bases__": (*bases, *parents) or (object,)}
        code = compile(text, str(lazy.__file__), "exec", flags=_FLAGS, dont_inherit=True)
        exec(code, lazy.kda_namespace, namespace)
        built = namespace[class_name]
        for key, value in (extra or {}).items():
            setattr(built, key, value)
        return built

    def lazy_class(self, module: str, class_name: str, methods: list[str], bases: tuple[type, ...] = ()) -> type:
        """:meth:`partial_class`, and any other method or property of the release class (or its release bases)
        is compiled from the release the first time an instance reads it (recorded ``release (on use)``)."""
        tree = self
        built = self.partial_class(module, class_name, methods, bases)

        def release_getattr(instance: Any, name: str) -> Any:
            if name.startswith("__") or name in lazy_seen:
                raise AttributeError(name)
            lazy_seen.add(name)
            where = tree.find_method(module, class_name, name)
            if where is None:
                raise AttributeError(f"{class_name!r} object has no attribute {name!r} (nor does the release class)")
            holder = tree.partial_class(where[0], where[1], [name])
            setattr(type(instance), name, vars(holder)[name])
            tree.bound[f"{where[0]}:{where[1]}.{name}"] = "release (on use)"
            return getattr(instance, name)

        lazy_seen: set[str] = set()
        built.__getattr__ = release_getattr
        return built

    def install(self, module: str) -> list[str]:
        """Run a patch module's import-time statements as the fork runs them when it is imported.

        Definitions and imports stay lazy; every other top-level statement (assignments, including those that
        keep an original before replacing it and those to attributes of other modules -- the monkeypatches --,
        ``if`` blocks, expressions) is executed in order, at its release line, as the import would. Returns the
        source of each statement run (recorded as ``installed``).
        """
        lazy = self.module(module)
        assert isinstance(lazy, LazyModule)
        lazy._index()
        tree = ast.parse("".join(lazy._kda["lines"]), str(lazy.__file__))
        ran = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # the docstring
            source, start = lazy.source_of(node)
            lazy.kda_prepare(source)
            exec(compile("\n" * (start - 1) + source, str(lazy.__file__), "exec", flags=_FLAGS, dont_inherit=True),
                 lazy.kda_namespace)
            ran.append(source.strip())
            self.record(module, f"line {start}", "installed")
        return ran

    def report(self) -> dict[str, list[str]]:
        """Return the recorded names by kind (``release``, ``release (on use)``, ``standin``, ``real``, ``inert``,
        ``installed``)."""
        kinds: dict[str, list[str]] = {}
        for name, kind in sorted(self.bound.items()):
            kinds.setdefault("broken" if kind.startswith("broken") else kind, []).append(name)
        return kinds
