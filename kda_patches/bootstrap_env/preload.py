"""Preload shared libraries by absolute path with ``RTLD_LOCAL | RTLD_NOW``, once per process.

Why: CANN's aclnn adapter ``dlopen``s ``libcust_opapi.so`` by bare name, and a bare name only searches
the ``LD_LIBRARY_PATH`` the process *started* with (glibc reads it once). A library that is already
loaded is found by its SONAME instead, so loading it early by absolute path makes the later bare-name
lookup succeed. ``RTLD_LOCAL`` keeps its symbols out of the global namespace (``RTLD_GLOBAL`` leads
to a double free at process exit with these libraries). ``ctypes`` is imported only here, and only
when there is something to load.
"""

from __future__ import annotations

import _thread
import os

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any

#: dlopen flags used for every preload (never RTLD_GLOBAL).
PRELOAD_MODE = os.RTLD_LOCAL | os.RTLD_NOW

_handles: dict[str, Any] = {}  # realpath -> ctypes.CDLL (kept alive; CDLL never dlcloses)
_results: dict[str, dict[str, Any]] = {}  # realpath -> last result record
_lock = _thread.allocate_lock()


def preload_library(path: str, source: str) -> dict[str, Any]:
    """Load ``path`` with :data:`PRELOAD_MODE` unless this process already preloaded it.

    Args:
        path: absolute path of the shared library.
        source: who asked for it (``KDA_PATCHES_PRELOAD``, ``vllm_ascend``, ...), for the report.
    Returns:
        ``{"path", "source", "status", "message"}`` with status ``loaded``, ``already-loaded`` (an
        earlier call loaded the same file; nothing happened), ``failed`` (``message`` is the loader's
        error) or ``invalid`` (not an absolute path; nothing was attempted).
    """
    if not os.path.isabs(path):
        return {"path": path, "source": source, "status": "invalid",
                "message": "not an absolute path; a bare name would search the startup LD_LIBRARY_PATH"}
    key = os.path.realpath(path)
    with _lock:
        if key in _handles:
            return {"path": path, "source": source, "status": "already-loaded", "message": ""}
        import ctypes  # deferred: only processes that preload something pay for ctypes

        try:
            handle = ctypes.CDLL(path, mode=PRELOAD_MODE)
        except OSError as error:
            result = {"path": path, "source": source, "status": "failed", "message": str(error)}
        else:
            _handles[key] = handle
            result = {"path": path, "source": source, "status": "loaded", "message": ""}
        _results[key] = result
        return dict(result)


def loaded_handle(path: str) -> Any:
    """Return the ``ctypes.CDLL`` this module loaded for ``path``, or None."""
    return _handles.get(os.path.realpath(path))


def preload_results() -> list[dict[str, Any]]:
    """Return the outcome of every preload attempted in this process (one record per library file)."""
    with _lock:
        return [dict(result) for result in _results.values()]


def mapped_libraries(paths: list[str]) -> dict[str, bool]:
    """Return, for each path, whether the file is mapped into this process (``/proc/self/maps``).

    Args:
        paths: library paths to look for (compared by real path).
    Returns:
        ``{path: bool}``; every value is False where ``/proc/self/maps`` cannot be read.
    """
    try:
        with open("/proc/self/maps") as handle:
            mapped = {line.split(None, 5)[5].strip() for line in handle if len(line.split(None, 5)) == 6}
    except OSError:
        mapped = set()
    return {path: os.path.realpath(path) in mapped for path in paths}
