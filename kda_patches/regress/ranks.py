"""Per-rank check of a patched vLLM run: every process the engine must have wrote a patched ledger.

A workload that serves vLLM reports the engine's effective layout in its outputs (``"engine"``:
executor, tensor/pipeline parallel sizes, world size, whether the engine core is a separate
process). From it the expected processes follow:

- the engine core (``EngineCore``/``EngineCore_DP<i>``) when vLLM runs it in its own process;
- ``mp`` executor: one ``VllmWorker-<rank>`` process per rank ``0 .. tp*pp-1`` (vLLM names them so);
- ``ray`` executor: ``tp*pp`` Ray actor processes (Ray's ``default_worker.py``; their ranks are not in
  the process name, so they are counted);
- ``uni``: the worker runs inside the engine core (or the main process without multiprocessing).

A worker rank passes when its ledger has at least one patch ``applied`` and none ``failed`` or
``skipped``; the engine core must have written a ledger with the overlay enabled. Anything missing
or unpatched fails the A/B (exit 1), like an unmet expectation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RAY_WORKER_MARK = "default_worker.py"


@dataclass
class RankCheck:
    """One expected process and what its ledger showed.

    Attributes:
        label: ``rank 0`` / ``engine core`` / ``Ray actor 2``.
        role: the role the ledger was matched on (or expected).
        met: the process wrote a ledger and is patched (engine core: overlay enabled).
        detail: pid, applied patches and counters, or what is missing.
    """

    label: str
    role: str
    met: bool
    detail: str


def _is_ray_worker(summary: dict[str, Any]) -> bool:
    return any(RAY_WORKER_MARK in str(part) for part in summary.get("argv") or [])


def _describe(summary: dict[str, Any]) -> tuple[bool, str]:
    applied = [name for name, entry in summary["patches"].items() if entry["state"] == "applied"]
    bad = [f"{name} {entry['state']} ({entry['reason']})" for name, entry in summary["patches"].items()
           if entry["state"] in ("failed", "skipped")]
    counters = "; ".join(f"{path}: " + " ".join(f"{key}={value}" for key, value in sorted(values.items()))
                         for path, values in sorted(summary["counters"].items()))
    text = (f"pid {summary['pid']} applied {', '.join(applied) or 'NOTHING'}"
            + (f"; NOT applied: {', '.join(bad)}" if bad else "") + (f"; counters {counters}" if counters else ""))
    return bool(applied) and not bad, text


def check_ranks(engine: dict[str, Any], summaries: list[dict[str, Any]]) -> list[RankCheck]:
    """Check the patched run's ledgers against the processes ``engine`` implies.

    Args:
        engine: the workload's ``outputs["engine"]`` (see
            :func:`kda_patches.regress.vllm_workload.describe_engine`).
        summaries: the patched run's ledger summaries (:mod:`kda_patches.regress.ledgers`).
    Returns:
        One :class:`RankCheck` per expected process, engine core first.
    """
    executor = engine.get("executor") or "uni"
    world = int(engine.get("tensor_parallel_size", 1)) * int(engine.get("pipeline_parallel_size", 1))
    checks: list[RankCheck] = []
    cores = [s for s in summaries if str(s.get("role") or "").startswith("EngineCore")]
    if engine.get("multiprocessing", True):
        if not cores:
            checks.append(RankCheck("engine core", "EngineCore", False, "no ledger from an EngineCore process"))
        for core in cores:
            enabled = bool(core.get("enabled"))
            _, text = _describe(core)
            checks.append(RankCheck("engine core", core["role"], enabled,
                                    text + ("" if enabled else "; overlay NOT enabled in this process")))
    if executor == "mp":
        by_role = {s["role"]: s for s in summaries}
        for rank in range(world):
            role = f"VllmWorker-{rank}"
            if role not in by_role:
                checks.append(RankCheck(f"rank {rank}", role, False, "no ledger from this worker process"))
                continue
            met, text = _describe(by_role[role])
            checks.append(RankCheck(f"rank {rank}", role, met, text))
    elif executor == "ray":
        actors = [s for s in summaries if _is_ray_worker(s)]
        for index in range(max(world, len(actors))):
            if index >= len(actors):
                checks.append(RankCheck(f"Ray actor {index + 1} of {world}", "ray worker", False,
                                        f"only {len(actors)} Ray actor ledger(s) for world size {world}"))
                continue
            met, text = _describe(actors[index])
            checks.append(RankCheck(f"Ray actor {index + 1} of {world}", "ray worker", met, text))
    elif executor == "uni":
        hosts = cores if engine.get("multiprocessing", True) else [s for s in summaries if s["role"] == "main"]
        label = "rank 0 (in the engine core)" if engine.get("multiprocessing", True) else "rank 0 (in main)"
        if not hosts:
            checks.append(RankCheck(label, "EngineCore", False, "no ledger from the process that hosts the worker"))
        for host in hosts[:1]:
            met, text = _describe(host)
            checks.append(RankCheck(label, host["role"], met, text))
    else:
        checks.append(RankCheck("ranks", str(executor), False,
                                f"executor {executor!r}: its worker processes cannot be identified"))
    return checks
