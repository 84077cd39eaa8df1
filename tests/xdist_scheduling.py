"""How ``make test`` spreads the suite over pytest-xdist workers: whole files, all engine files on one worker.

pytest-xdist's own ``--dist loadgroup`` marks a group by appending ``@group`` to each item's node id, which
pytest 9 ignores (node ids are structured there), so its groups silently fall apart. This scheduler groups by
file instead (``--dist loadfile``'s unit: a module-scoped fixture such as the Ascend check's report runs once),
except that every file in :data:`ENGINE_FILES` is one unit: one worker runs the real-engine tests in turn,
so two vLLM engines never share the machine's 2 cores, while the other worker takes the remaining files. The
files of ``tests/released`` are one unit too: their batches of released-code processes run once per pytest
process and several files assert on the same batch.
``tests/conftest.py`` refuses a run where a test marked ``engine`` lives in a file missing from the list.
"""

from __future__ import annotations

from typing import Any

ENGINE_UNIT = "engine"
ENGINE_FILES = frozenset({
    "tests/kv_layout/test_kv_activation_paths.py",
    "tests/kv_layout/test_kv_engine_ab.py",
    "tests/regress/test_regress_engine.py",
    "tests/regress/test_regress_multiprocess.py",
    "tests/regress/test_serve_ab.py",
})


RELEASED_UNIT = "released"
RELEASED_FOLDER = "tests/released/"  # its batches run once per pytest process and serve several files


def work_unit(nodeid: str) -> str:
    """Return the scheduling unit of a test: ``engine`` for the engine files, ``released`` for every file of
    ``tests/released`` (one worker runs each released-code batch once for all the files that assert on it),
    else its file."""
    path = nodeid.split("::", 1)[0]
    if path in ENGINE_FILES:
        return ENGINE_UNIT
    return RELEASED_UNIT if path.startswith(RELEASED_FOLDER) else path


def scheduler_class() -> type:
    """Return the scheduler class: ``loadfile`` with the engine files as one unit (imports pytest-xdist)."""
    from xdist.scheduler import LoadScopeScheduling

    class EngineFileScheduling(LoadScopeScheduling):
        """``loadfile`` with the engine files as one unit (queued first: workers sort it first)."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return EngineFileScheduling


def make_scheduler(config: Any, log: Any) -> Any:
    """Return the scheduler for ``--dist loadfile`` runs (``pytest_xdist_make_scheduler``)."""
    return scheduler_class()(config, log)
