"""How ``make test`` spreads the suite over pytest-xdist workers: whole files, the engine files in two units.

pytest-xdist's own ``--dist loadgroup`` marks a group by appending ``@group`` to each item's node id, which
pytest 9 ignores (node ids are structured there), so its groups silently fall apart. This scheduler groups by
file instead (``--dist loadfile``'s unit: a module-scoped fixture such as the Ascend check's report runs once),
except that the real-engine files form two units (:data:`ENGINE_UNITS`): the kv_layout files, which share the
session's engine runs (``tests/kv_layout/conftest.py``), and the regress files. Each unit's engines run one after
another on one worker; the two units start first, one on each worker, and each worker's vLLM engines bind their
compute threads to that worker's own core (:func:`engine_core_binding`), so two engines never share a core's
OpenMP threads (vLLM's ``auto`` binding puts every single-rank engine on core 0). The files of ``tests/released``
are one unit too (with :data:`RELEASED_GUESTS`, files elsewhere that share one of its batches): their batches of
released-code processes run once per pytest process and several files assert on the same batch.
``tests/conftest.py`` refuses a run where a test marked ``engine`` lives in a file missing from the units.
"""

from __future__ import annotations

from typing import Any

ENGINE_UNITS = {
    "engine-kv": frozenset({
        "tests/kv_layout/test_kv_activation_paths.py",
        "tests/kv_layout/test_kv_engine_ab.py",
    }),
    "engine-regress": frozenset({
        "tests/regress/test_regress_engine.py",
        "tests/regress/test_regress_multiprocess.py",
        "tests/regress/test_serve_ab.py",
    }),
}
ENGINE_FILES = frozenset().union(*ENGINE_UNITS.values())


RELEASED_UNIT = "released"
RELEASED_FOLDER = "tests/released/"  # its batches run once per pytest process and serve several files
# files elsewhere that assert on a tests/released batch: vLLM 0.34's no-copy cases share the 0.34 layer batch (one
# baseline process for both: released_batches.upstream034)
RELEASED_GUESTS = frozenset({"tests/indexed_chunk/test_indexed_034_layers.py"})


def work_unit(nodeid: str) -> str:
    """Return the scheduling unit of a test: its :data:`ENGINE_UNITS` name for an engine file, ``released`` for every
    file of ``tests/released`` and each of :data:`RELEASED_GUESTS` (one worker runs each released-code batch once for
    all the files that assert on it), else its file."""
    path = nodeid.split("::", 1)[0]
    for unit, files in ENGINE_UNITS.items():
        if path in files:
            return unit
    return RELEASED_UNIT if path.startswith(RELEASED_FOLDER) or path in RELEASED_GUESTS else path


def queue_position(nodeid: str) -> int:
    """Return where a test's unit goes in a worker's collection: the engine units first, in :data:`ENGINE_UNITS`
    order (the longest first: xdist hands the first unit to the first worker), then everything else."""
    names = list(ENGINE_UNITS)
    unit = work_unit(nodeid)
    return names.index(unit) if unit in names else len(names)


def engine_core_binding(worker: str | None, cores: int | None) -> str | None:
    """Return the ``VLLM_CPU_OMP_THREADS_BIND`` value for the engines of xdist worker ``worker`` (``gw0``, ``gw1``,
    ...): its own core, ``index mod cores``; None outside xdist or where the core count is unknown."""
    if not worker or not worker.startswith("gw") or not cores:
        return None
    return str(int(worker[2:]) % cores)


def scheduler_class() -> type:
    """Return the scheduler class: ``loadfile`` with the engine units (imports pytest-xdist)."""
    from xdist.scheduler import LoadScopeScheduling

    class EngineFileScheduling(LoadScopeScheduling):
        """``loadfile`` with the engine files in their units (queued first: workers sort them first)."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return EngineFileScheduling


def make_scheduler(config: Any, log: Any) -> Any:
    """Return the scheduler for ``--dist loadfile`` runs (``pytest_xdist_make_scheduler``)."""
    return scheduler_class()(config, log)
