"""Post-import hooks: run a callback right after a named module finishes importing.

Same contract as ``wrapt.register_post_import_hook`` (immediate call when the module is already
imported; otherwise once, after the module body ran, before the importer gets it back), but in a
few stdlib lines: importing wrapt costs tens of milliseconds (it pulls in asyncio and importlib.metadata), and
``import kda_patches`` runs in every Python process of the environment. wrapt itself is imported
only when a target module is imported, to build the wrappers.
"""

from __future__ import annotations

import _thread
import sys

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here

if TYPE_CHECKING:
    from typing import Any, Callable

    Callback = Callable[[Any], None]

_callbacks: dict[str, list[Callback]] = {}
_searching: set[str] = set()
_lock = _thread.RLock()


class _HookedLoader:
    """Delegates to the real loader, then fires the module's post-import callbacks."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # Put the real loader back first, so the module looks as if we were never there.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        fire_callbacks(module.__name__, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PostImportFinder:
    """Meta-path finder that intercepts only modules with pending callbacks."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _callbacks or fullname in _searching:
            return None
        _searching.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):  # ask the finders after us, as the import system would
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            _searching.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _HookedLoader(spec.loader)
        return spec


_FINDER = _PostImportFinder()


def fire_callbacks(name: str, module: Any) -> None:
    """Run (once) every callback registered for ``name`` with the imported ``module``."""
    with _lock:
        pending = _callbacks.pop(name, [])
    for callback in pending:
        callback(module)


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` after module ``name`` is imported (now, if it already is).

    Args:
        name: absolute module name.
        callback: receives the module object; exceptions propagate to the importer.
    """
    with _lock:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        module = sys.modules.get(name)
        if module is None:
            _callbacks.setdefault(name, []).append(callback)
            return
    callback(module)


def imported_module(name: str) -> Any:
    """Return module ``name`` when it is fully imported, else None (never imports it).

    A module whose body is still executing (``__spec__._initializing``, set by the import system while
    loading) counts as not imported: its attributes may not exist yet.
    """
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module
