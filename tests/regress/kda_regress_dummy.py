"""A cheap workload for the A/B runner tests whose outputs depend on a dummy patch being active.

When the overlay is enabled the workload registers ``dummy_offset``, a real registry patch that wraps
:mod:`kda_regress_dummy_target`'s functions and counts every call in the ledger. ``mode`` picks what
the wrapper does: ``none`` (counts only: outputs equal), ``token`` (token 5 is off by one), ``drift``
(floats move by 1e-6), ``drifted-signature`` (the patch's fingerprint does not match, so STRICT
raises), ``raise`` (the workload itself fails), ``hang`` (sleeps, for the timeout), ``unstable`` (the
first token is the process id: every run differs from every other, patched or not).
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import kda_patches
from kda_patches.ledger import get_ledger
from kda_patches.registry import Patch, Target, register_patch

COUNTERS_PATH = "dummy_offset"
_MODE = {"value": "none"}


def wrap_target(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper: run the original, count the call, perturb the result as the mode says."""
    value = wrapped(*args, **kwargs)
    get_ledger().count(COUNTERS_PATH, "calls_routed")
    mode = _MODE["value"]
    if mode == "token" and isinstance(value, int) and args[0] == 5:
        return value + 1
    if mode == "drift" and isinstance(value, float):
        return value + 1e-6
    return value


def install_dummy_patch(mode: str) -> None:
    """Register ``dummy_offset`` when the overlay is enabled in this process (STRICT honoured)."""
    _MODE["value"] = mode
    flags = kda_patches.current_flags()
    if not flags.enabled:
        return
    parameters = ("step", "unexpected") if mode == "drifted-signature" else ("step",)
    targets = tuple(Target(module="kda_regress_dummy_target", qualname=name, wrapper=wrap_target,
                           stack="test", parameters=parameters) for name in ("next_token", "score"))
    register_patch(Patch(name="dummy_offset", summary="test-only patch", targets=targets), strict=flags.strict)


def run_steps(mode: str, steps: int) -> tuple[list[int], list[float]]:
    """Install the patch (if enabled) and call the target functions ``steps`` times."""
    install_dummy_patch(mode)
    import kda_regress_dummy_target as target

    return [target.next_token(i) for i in range(steps)], [target.score(i) for i in range(steps)]


def compute(mode: str = "none", steps: int = 8, processes: int = 1) -> dict[str, Any]:
    """The workload: tokens (exact) and a numpy score tensor (tolerance) from the patched target.

    Args:
        mode: see the module docstring.
        steps: how many values to produce.
        processes: >1 also runs the same steps in that many spawned child processes (each writes
            its own ledger), to exercise ledger aggregation across processes.
    """
    import numpy

    if mode == "raise":
        raise RuntimeError("dummy workload failed on purpose")
    if mode == "hang":
        import time

        time.sleep(120)
    tokens, scores = run_steps(mode, steps)
    if mode == "unstable":
        import os

        tokens[0] = os.getpid()
    context = multiprocessing.get_context("spawn")
    for _ in range(processes - 1):
        child = context.Process(target=run_steps, args=(mode, steps))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"spawned child exited with {child.exitcode}")
    return {"tokens": tokens, "scores": numpy.asarray(scores, dtype=numpy.float64), "label": "dummy"}
