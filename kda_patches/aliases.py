"""Module-level aliases of a wrapped function: found, rebound to the wrapper, recorded, restored.

``from M import f`` copies the object into the importing module's namespace. When the overlay wraps
``M.f`` after such a module was imported (the vLLM plugin activates inside ``EngineCore.__init__``, long
after ``vllm.v1.engine.core`` bound ``get_kv_cache_configs``), that module keeps calling the original:
the patch would be "applied" and never run. So when a patch wraps a function its module *defines*, every
other imported module whose namespace holds the very same object (under any name) is rebound to the
wrapper. Modules imported later need nothing: ``from M import f`` then reads the wrapper.

Only definitions propagate. A target that names a module's *import* of a function defined elsewhere
(``vllm_ascend.ops.kimi_kda:clear_ssm_states``: "the name that module calls") wraps that one name on
purpose; rebinding the definition's other users would change code the patch does not own.

Standard library only; scanning ``sys.modules`` is one identity test per module-level name, paid once
per wrapped definition when it is wrapped: tens of milliseconds with vLLM 0.32's 5,600 modules imported (the
plugin path, measured on the project's CPU machine; docs/NOTEBOOK.md, "Figures moved out of the code"), next to
nothing when the hook fires at the module's import.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

OWN_PACKAGE = "kda_patches"


class Alias:
    """One module-level name that held the original and now holds the wrapper.

    Attributes:
        module: the module object.
        name: the attribute name in it.
    """

    __slots__ = ("module", "name")

    def __init__(self, module: ModuleType, name: str) -> None:
        self.module = module
        self.name = name

    def __repr__(self) -> str:
        return f"{self.module.__name__}.{self.name}"


def defines(module: ModuleType, original: Any) -> bool:
    """Return whether ``original`` is defined by ``module`` (its ``__module__`` names it), not imported into it."""
    return getattr(original, "__module__", None) == module.__name__


def find_aliases(original: Any, owner: ModuleType) -> list[Alias]:
    """Return every module-level name, outside ``owner`` and this package, bound to ``original`` itself.

    Args:
        original: the object before wrapping.
        owner: the module the target was wrapped in (its own name is not an alias).
    Returns:
        The aliases, sorted by module and name.
    """
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or module is owner or not isinstance(module, ModuleType):
            continue
        if name == OWN_PACKAGE or name.startswith(OWN_PACKAGE + "."):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        found.extend(Alias(module, attribute) for attribute, value in list(namespace.items()) if value is original)
    return sorted(found, key=repr)


def rebind_aliases(original: Any, wrapper: Any, owner: ModuleType) -> list[Alias]:
    """Point every alias of ``original`` (a function ``owner`` defines) at ``wrapper``; return them.

    Returns an empty list when ``owner`` does not define ``original`` (see the module docstring).
    """
    if not defines(owner, original):
        return []
    aliases = find_aliases(original, owner)
    done = []
    try:
        for alias in aliases:
            setattr(alias.module, alias.name, wrapper)
            done.append(alias)
    except Exception:
        restore_aliases(done, original, wrapper)  # all or none
        raise
    return aliases


def restore_aliases(aliases: list[Alias], original: Any, wrapper: Any) -> list[Alias]:
    """Point each alias that still holds ``wrapper`` back at ``original``; return those left alone.

    An alias someone re-bound since (to another object) is not ours any more and keeps its value.
    """
    left = []
    for alias in aliases:
        if getattr(alias.module, alias.name, None) is wrapper:
            setattr(alias.module, alias.name, original)
        else:
            left.append(alias)
    return left
