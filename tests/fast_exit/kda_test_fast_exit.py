"""Test-only: vLLM's spawned processes end without Python's interpreter teardown once their work is done.

The real-engine tests start many short vLLM engines. Each engine's processes (the engine core, each worker,
spawned by ``multiprocessing``'s spawn start method) spend seconds after their last useful step: the
interpreter tears down hundreds of thousands of torch/vLLM objects, and vLLM's executor waits up to
``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` for a worker still in that teardown before it sends SIGTERM (seen here:
about 5 s of a 6-10 s shutdown per engine, on this 2-core machine).

:func:`install` wraps ``multiprocessing.spawn._main`` (what a spawned child runs; it returns the exit code
that ``spawn_main`` would pass to ``sys.exit``): after the child's own work, including vLLM's shutdown of its
workers, it runs every ``atexit`` handler (the overlay's ledger flush is one), flushes stdout/stderr and
leaves with ``os._exit(code)`` — the same exit code, only the teardown skipped. Nothing the tests assert on
(outputs, ledgers, exit codes) is written during the teardown. Processes started with the fork method never
reach Python's teardown anyway (``os._exit`` in ``multiprocessing.popen_fork``).

It is put in place by ``sitecustomize.py`` in this folder (``PYTHONPATH``, see :data:`FOLDER` and
:func:`with_fast_exit`), or by another test shim's ``sitecustomize`` that calls :func:`install` itself.
It imports no part of the overlay, torch or vLLM.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

FOLDER = os.path.dirname(os.path.abspath(__file__))
MARK = "_kda_test_fast_exit"


def finish(code: Any) -> None:
    """Run the atexit handlers, flush the standard streams, and end the process with ``code``'s status.

    Args:
        code: what ``sys.exit`` would get: an int (its status), None (0), anything else (1, as Python does).
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be written to it
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def install() -> bool:
    """Make every spawned child of this interpreter end through :func:`finish`; return False if already done."""
    import multiprocessing.spawn as spawn

    if getattr(spawn._main, MARK, False):
        return False
    original = spawn._main

    def main_then_finish(*args: Any, **kwargs: Any) -> None:
        finish(original(*args, **kwargs))

    setattr(main_then_finish, MARK, True)
    spawn._main = main_then_finish
    return True


def with_fast_exit(env: dict[str, str]) -> dict[str, str]:
    """Return ``env`` with this folder first on ``PYTHONPATH`` (its ``sitecustomize`` calls :func:`install`)."""
    paths = [FOLDER, *[path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path and path != FOLDER]]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}
