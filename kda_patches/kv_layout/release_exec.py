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

The pieces: :mod:`~kda_patches.kv_layout.release_module` (one lazily compiled release module),
:mod:`~kda_patches.kv_layout.release_classes` (partial classes built from release methods),
:mod:`~kda_patches.kv_layout.release_compile` (compiling at release line numbers; definition-time names); this
module is the tree (name resolution, stand-ins, inert placeholders, patch installation, the record).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pathlib
import sys
import types
from typing import Any

from kda_patches.kv_layout.release_classes import ReleaseClasses
from kda_patches.kv_layout.release_compile import absolute_name, compile_at
from kda_patches.kv_layout.release_module import LazyModule

REAL_TOP_LEVEL = frozenset(sys.stdlib_module_names) | {"torch", "numpy", "typing_extensions"}


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


class ReleaseTree(ReleaseClasses):
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
                name = absolute_name(package, name, level)
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

    def lazy_module(self, module: str) -> LazyModule | None:
        """The release module ``module``, or None when it is not a file of the tree (or is stood in)."""
        if not self.has_module(module):
            return None
        lazy = self.module(module)
        return lazy if isinstance(lazy, LazyModule) else None

    def install(self, module: str) -> list[str]:
        """Run a patch module's import-time statements as the fork runs them when it is imported.

        Definitions and imports stay lazy; every other top-level statement (assignments, including those that
        keep an original before replacing it and those to attributes of other modules -- the monkeypatches --,
        ``if`` blocks, expressions) is executed in order, at its release line, as the import would. Returns the
        source of each statement run (recorded as ``installed``).
        """
        lazy = self.module(module)
        assert isinstance(lazy, LazyModule)
        ran = []
        for node in lazy.kda_statements():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # the docstring
            source, start = lazy.source_of(node)
            lazy.kda_prepare(source)
            exec(compile_at(source, start, str(lazy.__file__)), lazy.kda_namespace)
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
