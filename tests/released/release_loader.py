"""Execute a release's own ``.py`` files under their real module names, with declared imports only.

A :class:`ReleaseStack` maps module names to files of one downloaded release (``kda_patches.releases.fetch``)
and installs a meta-path finder that serves them through the ordinary import system, so the overlay's
post-import hooks (``kda_patches.hooks``) wrap them exactly as they would wrap the installed fork. Each
file is compiled from its release path (tracebacks and Triton's ``inspect.getsource`` read the release
file) and executed verbatim; the only thing changed is how its ``import`` statements resolve:

- ``release``: another file of the same release, executed the same way;
- ``real``: the module installed here (torch, einops, triton, the standard library);
- ``standin``: a namespace of ours with the named objects (device kernels, ``torch_npu``); each name a
  release imports from it must be declared, else the import fails naming it;
- ``inert``: a module whose imported names the executed path never uses (configs, linear layers, base
  classes): each becomes a placeholder class that raises :class:`StandInNotProvided` when called or
  instantiated, so an unexpected use fails loudly instead of computing something of ours.

One more thing may be declared per release file: ``lifted`` device guards, ``assert`` statements whose test
is exactly a given expression (e.g. ``state.is_cuda or state.is_xpu`` in vLLM 0.34's Triton state ops) are
left out of that file's compiled code, so its host function launches its kernel under the Triton interpreter
on CPU tensors; every other line is the release's. A declared guard the file does not contain fails the import
(recorded as ``lifted`` in :attr:`ReleaseStack.bound`). :func:`release_function` compiles one function or method
of a release file as written there, with a namespace of ours as its globals (a method of a class whose module is
too costly to execute).

Anything undeclared raises ImportError naming the release file and the module. Every name bound this way
is recorded in :attr:`ReleaseStack.bound` (printed by the tests). The stack also answers
``importlib.metadata`` for the release's distribution, which is where the overlay reads the version of a
stack whose package has no ``__version__``. Nothing is added to ``sys.path``.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import pathlib
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any


class StandInNotProvided(RuntimeError):
    """The executed release code used a name the harness declared as unused (inert)."""


def placeholder(module: str, name: str) -> type:
    """Return a class named ``name`` that raises :class:`StandInNotProvided` when called or instantiated."""
    def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise StandInNotProvided(f"{module}.{name} is declared inert (unused by the executed path) but the "
                                 f"release code used it ({cls.__name__}); stand it in or run another path")

    return type(name, (), {"__new__": refuse, "__module__": module, "__qualname__": name, "_kda_inert": True})


class InertModule(types.ModuleType):
    """A module whose every attribute is a fresh :func:`placeholder` (recorded by the stack)."""

    def __init__(self, name: str, record: Any) -> None:
        super().__init__(name)
        self._record = record

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        value = placeholder(self.__name__, attribute)
        setattr(self, attribute, value)
        self._record(self.__name__, attribute, "inert")
        return value


class _Distribution(importlib.metadata.Distribution):
    """Metadata of the release's distribution, as an installed fork would report it."""

    def __init__(self, name: str, version: str) -> None:
        self._text = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"

    def read_text(self, filename: str) -> str | None:
        return self._text if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path: Any) -> pathlib.Path:
        return pathlib.Path(str(path))


class ReleaseStack(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """One release's files, served under their real module names (see the module docstring).

    Args:
        root: the release folder (package folders at its root).
        dist: distribution name (``vllm-ascend``), answered by ``importlib.metadata``; "" answers nothing
            (the installed distribution's own metadata is used).
        version: the release version.
        release: module names executed from ``root``.
        real: module-name prefixes imported for real.
        standins: module name -> {name: object}; the object under the key ``""`` stands in for the module
            itself (``import torch_npu``); ``"*": True`` makes every other name of that module inert.
        inert: module-name prefixes whose names become placeholders.
        modules: module name -> ready-made module object served under that name (stand-in modules of
            ours that the overlay must see, e.g. a runner module; recorded as ``standin``).
        absent_inert: a ``real`` module or name the installed packages lack becomes inert (a newer
            release's file on an older install: what it imports that is new must then stay unused).
        lifted: release module -> the ``assert`` tests (source text, as ``ast.unparse`` writes them) left out
            of its code (device guards; see the module docstring).
    """

    def __init__(self, root: pathlib.Path, dist: str, version: str, release: Iterable[str],
                 real: Iterable[str] = (), standins: Mapping[str, Mapping[str, Any]] | None = None,
                 inert: Iterable[str] = (), modules: Mapping[str, types.ModuleType] | None = None,
                 absent_inert: bool = False, lifted: Mapping[str, Iterable[str]] | None = None) -> None:
        self.root = pathlib.Path(root)
        self.absent_inert = absent_inert
        self.lifted = {module: tuple(tests) for module, tests in (lifted or {}).items()}
        self.dist, self.version = dist, version
        self.release = set(release)
        self.real = tuple(real)
        self.standins = dict(standins or {})
        self.inert = tuple(inert)
        self.modules = dict(modules or {})
        self.bound: dict[str, dict[str, str]] = {}  # module -> {name: release|real|standin|inert}
        self._served = self.release | set(self.modules)
        self._packages = {".".join(name.split(".")[:i]) for name in self._served
                          for i in range(1, name.count(".") + 1)} - self._served

    # -- lifecycle -------------------------------------------------------------------------------
    def install(self) -> ReleaseStack:
        """Put this finder on ``sys.meta_path`` just before the path finder (so after the overlay's finder,
        which must see and wrap the loader, and before the installed vLLM packages)."""
        position = next((i for i, finder in enumerate(sys.meta_path) if finder is importlib.machinery.PathFinder),
                        len(sys.meta_path))
        sys.meta_path.insert(position, self)
        return self

    def uninstall(self) -> None:
        """Remove the finder and forget every module it served."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for name in self._served | self._packages:
            sys.modules.pop(name, None)

    def record(self, module: str, name: str, kind: str) -> None:
        """Note that a release file bound ``module.name`` as ``kind``."""
        self.bound.setdefault(module, {})[name] = kind

    # -- import system ---------------------------------------------------------------------------
    def path_of(self, module: str) -> pathlib.Path:
        """Return the release file of ``module`` (``a/b/c.py`` or ``a/b/c/__init__.py``)."""
        base = self.root.joinpath(*module.split("."))
        return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in self._served:
            origin = str(self.path_of(fullname)) if fullname in self.release else None
            return importlib.machinery.ModuleSpec(fullname, self, origin=origin,
                                                  is_package=origin is not None and origin.endswith("__init__.py"))
        if fullname in self._packages:  # parent packages: empty, their __init__ is not executed
            parent = sys.modules.get(fullname.rpartition(".")[0]) if "." in fullname else None
            ours = parent is not None and getattr(parent.__spec__, "loader", None) is self
            if not ours and importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
                return None  # installed here (vLLM's own packages): the real one loads
            spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            # A top-level package points at its release folder, as an installed one would, so that code
            # reading sources without importing (the overlay's static checks) finds the release's files.
            folder = self.root / fullname
            spec.submodule_search_locations = [str(folder)] if "." not in fullname and folder.is_dir() else []
            return spec
        top = sys.modules.get(fullname.split(".")[0])
        if top is not None and getattr(top.__spec__, "loader", None) is self and self.release:
            raise ModuleNotFoundError(f"{fullname} is not executed by this harness (release {self.dist} "
                                      f"{self.version}: only {sorted(self._served)} are)", name=fullname)
        return None

    def find_distributions(self, context: Any = None) -> Iterable[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if self.dist and name is not None and name.replace("_", "-").lower() == self.dist:
            return [_Distribution(self.dist, self.version)]
        return []

    def create_module(self, spec: Any) -> types.ModuleType | None:
        return self.modules.get(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        if name in self.modules or name in self._packages:
            if name in self.modules:
                self.record(name, "*", "standin")
            return
        path = self.path_of(name)
        source: Any = path.read_text()
        if name in self.lifted:
            source = self._without_guards(name, path, source)
        code = compile(source, str(path), "exec", dont_inherit=True)
        module.__file__ = str(path)
        namespace = dict(vars(builtins))
        namespace["__import__"] = self._importer(name, str(path))
        module.__builtins__ = namespace
        exec(code, module.__dict__)

    def _without_guards(self, name: str, path: pathlib.Path, source: str) -> ast.Module:
        """Return ``source`` parsed, without the ``assert`` statements declared lifted for ``name``.

        Raises:
            ImportError: a declared guard is not in the file (the release changed: re-read it).
        """
        tree = ast.parse(source, str(path))
        wanted, found = set(self.lifted[name]), set()

        class Lift(ast.NodeTransformer):
            def visit_Assert(self, node: ast.Assert) -> Any:
                text = ast.unparse(node.test)
                if text in wanted:
                    found.add(text)
                    return None
                return node

        tree = Lift().visit(tree)
        missing = sorted(wanted - found)
        if missing:
            raise ImportError(f"{path}: declared lifted guard(s) {missing} not found (assert tests there differ)")
        for text in sorted(found):
            self.record(name, f"assert {text}", "lifted")
        return ast.fix_missing_locations(tree)

    # -- import resolution inside release files --------------------------------------------------
    def _importer(self, importer: str, filename: str) -> Any:
        package = importer if self.path_of(importer).name == "__init__.py" else importer.rpartition(".")[0]

        def release_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (),
                           level: int = 0) -> Any:
            if level:
                base = package.rsplit(".", level - 1)[0] if level > 1 else package
                name = f"{base}.{name}" if name else base
            return self.resolve(name, tuple(fromlist or ()), filename)

        return release_import

    def _matches(self, name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)

    def resolve(self, name: str, fromlist: tuple[str, ...], filename: str) -> Any:
        """Return what ``import name`` / ``from name import fromlist`` gives a release file."""
        if name in self.release or name in self.modules:
            module = importlib.import_module(name)
            kind = "release" if name in self.release else "standin"
            for item in fromlist:
                if not hasattr(module, item) and f"{name}.{item}" in self.release | set(self.modules):
                    importlib.import_module(f"{name}.{item}")
                self.record(name, item, kind)
            return module if fromlist else sys.modules[name.split(".")[0]]
        if name in self.standins:
            namespace = self.standins[name]
            if "" in namespace:  # the module itself is a stand-in object
                self.record(name, "*", "standin")
                return namespace[""]
            if namespace.get("*"):  # the other names of this module are inert
                namespace = {**{item: placeholder(name, item) for item in fromlist}, **namespace}
            missing = [item for item in fromlist if item not in namespace]
            if missing:
                raise ImportError(f"{filename}: 'from {name} import {', '.join(missing)}' is not stood in; "
                                  "declare it in the release's stand-in table")
            module = types.ModuleType(name)
            module.__dict__.update(namespace)
            for item in fromlist:
                self.record(name, item, "inert" if getattr(namespace[item], "_kda_inert", False) else "standin")
            return module
        if self._matches(name, self.real):
            try:
                module = builtins.__import__(name, None, None, fromlist, 0)
            except ModuleNotFoundError:
                if not self.absent_inert:
                    raise
                module = InertModule(name, self.record)
                for item in fromlist:
                    getattr(module, item)
                return module
            absent = [item for item in fromlist if self.absent_inert and not hasattr(module, item)]
            if absent:  # a view of the real module with placeholders added (the real one is left as it is)
                view = types.ModuleType(name)
                view.__dict__.update(vars(module))
                for item in absent:
                    setattr(view, item, placeholder(name, item))
                module = view
            for item in fromlist or ("*",):
                self.record(name, item, "inert" if item in absent else "real")
            return module
        if self._matches(name, self.inert):
            module = InertModule(name, self.record)
            for item in fromlist:
                getattr(module, item)
            return module
        raise ImportError(f"{filename}: import of {name!r} is not declared (release, real, stand-in or inert) in "
                          "the harness's table for this release")


def read_parameters(path: pathlib.Path, qualname: str) -> tuple[str, ...]:
    """Return the parameter names of ``Class.method`` (or ``function``) as written in a release file (AST)."""
    tree = ast.parse(path.read_text(), str(path))
    *classes, function = qualname.split(".")
    body = tree.body
    for cls in classes:
        body = next(node.body for node in body if isinstance(node, ast.ClassDef) and node.name == cls)
    node = next(node for node in body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name == function)
    args = node.args
    return tuple(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))


def classes_defining(path: pathlib.Path, method: str) -> list[str]:
    """Return the names of the top-level classes of a release file that define ``method`` (AST)."""
    tree = ast.parse(path.read_text(), str(path))
    return [node.name for node in tree.body if isinstance(node, ast.ClassDef)
            and any(isinstance(item, ast.FunctionDef) and item.name == method for item in node.body)]


def release_function(path: pathlib.Path, qualname: str, namespace: dict[str, Any]) -> Any:
    """Return ``Class.method`` (or ``function``) of a release file, compiled as written there, decorators left out.

    Its globals are ``namespace`` (a stand-in module's ``__dict__``, holding the names the body reads), its
    code carries the release file's name and line numbers; nothing else of the file is executed.
    """
    tree = ast.parse(path.read_text(), str(path))
    *classes, function = qualname.split(".")
    body = tree.body
    for cls in classes:
        body = next(node.body for node in body if isinstance(node, ast.ClassDef) and node.name == cls)
    node = next((node for node in body if isinstance(node, ast.FunctionDef) and node.name == function), None)
    if node is None:
        raise LookupError(f"{path} defines no {qualname}")
    node.decorator_list = []
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)  # annotations not evaluated
    previous = namespace.get(function, namespace)
    exec(code, namespace)
    made = namespace.pop(function)
    if previous is not namespace:  # a module-level name of the same name (an alias the method calls) is kept
        namespace[function] = previous
    return made


def function_stubs(path: pathlib.Path, names: Iterable[str]) -> dict[str, Any]:
    """Return stubs of module-level functions of a release file, with the release's parameter lists.

    For a stand-in module (a release module whose imports are too costly or absent here, executed path never
    calls it) that the overlay must still see with the release's signatures; see :func:`method_stubs`.
    """
    tree = ast.parse(path.read_text(), str(path))
    wanted = set(names)
    stubs = _stubs(path, "<module>", [item for item in tree.body if getattr(item, "name", None) in wanted])
    missing = sorted(wanted - set(stubs))
    if missing:
        raise LookupError(f"{path} defines no module-level function {missing}")
    return stubs


def method_stubs(path: pathlib.Path, cls: str, skip: Iterable[str] = ()) -> dict[str, Any]:
    """Return stubs of every method ``cls`` defines in a release file, with the release's parameter lists.

    A stand-in class (a runner whose release body cannot run here) carries them so that the overlay's
    registry sees the same attributes and signatures as on the real class; calling one raises
    :class:`StandInNotProvided`. Defaults become ``None`` (only names and kinds are part of a fingerprint).
    """
    tree = ast.parse(path.read_text(), str(path))
    node = next(item for item in tree.body if isinstance(item, ast.ClassDef) and item.name == cls)
    skipped = set(skip)
    return _stubs(path, cls, [item for item in node.body if getattr(item, "name", None) not in skipped])


def _stubs(path: pathlib.Path, cls: str, definitions: list[ast.stmt]) -> dict[str, Any]:
    """Stubs of the function definitions among ``definitions`` (the first definition of a repeated name is kept);
    ``cls`` is the class they belong to, or ``"<module>"``."""
    stubs: dict[str, Any] = {}
    owner = "module" if cls == "<module>" else "class"
    for item in definitions:
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) or item.name in stubs:
            continue  # (a property's setter repeats its name: the first definition is kept)
        args = item.args
        arguments = ast.arguments(
            posonlyargs=args.posonlyargs, args=args.args, vararg=args.vararg, kwonlyargs=args.kwonlyargs,
            kw_defaults=[None if d is None else ast.Constant(None) for d in args.kw_defaults],
            kwarg=args.kwarg, defaults=[ast.Constant(None) for _ in args.defaults])
        for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
            arg.annotation = None
        for extra in (arguments.vararg, arguments.kwarg):
            if extra is not None:
                extra.annotation = None
        where = item.name if cls == "<module>" else f"{cls}.{item.name}"
        message = f"{where} of {path} is a stub of the stand-in {owner} (not executed here)"
        body = [ast.Raise(exc=ast.Call(func=ast.Name("StandInNotProvided", ast.Load()),
                                       args=[ast.Constant(message)], keywords=[]), cause=None)]
        function = ast.FunctionDef(name=item.name, args=arguments, body=body, decorator_list=[], returns=None)
        module = ast.fix_missing_locations(ast.Module(body=[function], type_ignores=[]))
        namespace: dict[str, Any] = {"StandInNotProvided": StandInNotProvided}
        exec(compile(module, f"<stub of {path}:{cls}.{item.name}>", "exec"), namespace)
        stub = namespace[item.name]
        if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in item.decorator_list):
            stub = staticmethod(stub)
        elif any(isinstance(d, ast.Name) and d.id == "classmethod" for d in item.decorator_list):
            stub = classmethod(stub)
        elif any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
            stub = property(stub)
        stubs[item.name] = stub
    return stubs
