"""Release classes rebuilt with only the methods a caller needs, each compiled from the release file.

:class:`ReleaseClasses` is the part of :class:`~kda_patches.kv_layout.release_exec.ReleaseTree` that follows a
release class's bases through the release's imports (:meth:`~ReleaseClasses.ancestors`,
:meth:`~ReleaseClasses.find_method`) and builds partial classes: :meth:`~ReleaseClasses.partial_class` (the named
methods, ``super()`` working) and :meth:`~ReleaseClasses.lazy_class` (any other method compiled on first use).
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

from kda_patches.kv_layout.release_compile import compile_at
from kda_patches.kv_layout.release_module import LazyModule

_SUPER_CALL = re.compile(r"\bsuper\(\)\.(\w+)")


class ReleaseClasses:
    """Class building over a release tree; mixed into :class:`~kda_patches.kv_layout.release_exec.ReleaseTree`,
    whose ``module``, ``lazy_module``, ``has_module``, ``record`` and ``bound`` it uses."""

    def base_names(self, module: str, class_name: str) -> list[tuple[str, str]]:
        """Return ``(module, class)`` of each base of a release class, following imports (release bases only)."""
        lazy = self.lazy_module(module)
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
            lazy = self.lazy_module(module)
            if lazy is None:
                return None
            entry = lazy.kda_entry(name)
            if entry is None:
                return None
            if entry.node is not None:
                return module, name
            if entry.attribute is None:
                return entry.module, ""
            module, name = entry.module, entry.attribute
            source = self.lazy_module(module)
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
            lazy = self.lazy_module(current[0])
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
        code = compile_at(text, 1, str(lazy.__file__))
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
