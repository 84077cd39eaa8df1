"""Where the eager single-row gather's host-to-done time goes (CUDA only).

Times, with the synchronized host clock, the pieces of one ``FusedStatePlan.gather`` of one row:
an empty synchronize, the output allocation, the plan's checks, the direct compiled launch (enqueue and
to-done), and the whole call, so a miss of the eager latency target can be attributed to this host.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from kda_patches.bench.timing import median


def time_host(action: Callable[[], Any], device: torch.device, trials: int, synchronize_after: bool) -> list[float]:
    """Return ``trials`` host-clock samples (us) of ``action``, optionally until the device is done."""
    samples = []
    for _ in range(trials):
        torch.cuda.synchronize(device)
        begin = time.perf_counter_ns()
        result = action()
        if synchronize_after:
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter_ns() - begin) / 1000.0)
        del result
    return samples


def measure_host_breakdown(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """Measure the pieces of an eager one-row FP32 gather on a cache like the benchmark's.

    Returns:
        ``{piece: {"median_us": ..., "samples_us": [...]}}``.
    """
    from kda_patches.state_copy.plan import FusedStatePlan

    inner = args.inner
    payload = inner[0] * inner[1] * inner[2]
    rows = min(args.rows, 64)
    backing = torch.zeros(rows * (payload + args.gap_items), device=device)
    state = backing.as_strided((rows, *inner), (payload + args.gap_items, inner[1] * inner[2], inner[2], 1))
    plan = FusedStatePlan.prepare(state, 8).seal()
    indices = torch.tensor([3], dtype=torch.int32, device=device)
    out = torch.empty((1, *inner), device=device)
    variant = plan._gathers[torch.int32]
    grid = plan._grid(1)
    flags = plan._true_flags
    trials = max(args.trials * 4, 50)
    pieces = {
        "synchronize only": (lambda: None, True),
        "torch.empty + synchronize": (lambda: torch.empty((1, *inner), device=device), True),
        "plan checks (host only)": (lambda: plan._check_call(state, indices, None), False),
        "direct launch enqueue": (lambda: variant.launch(grid, state, out, indices, flags, rows), False),
        "direct launch + synchronize": (lambda: variant.launch(grid, state, out, indices, flags, rows), True),
        "plan.gather enqueue": (lambda: plan.gather(state, indices), False),
        "plan.gather + synchronize": (lambda: plan.gather(state, indices), True),
        "torch-native gather + synchronize": (lambda: state[indices], True),
    }
    for action, wait in pieces.values():  # warm up every piece
        time_host(action, device, 5, wait)
    result = {}
    for name, (action, wait) in pieces.items():
        samples = time_host(action, device, trials, wait)
        result[name] = {"median_us": median(samples), "samples_us": samples}
    return result
