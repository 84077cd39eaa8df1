"""What the released-layer no-copy A/Bs check of both sides' pages (0.34's layers and the pre-0.34 ones)."""

from __future__ import annotations

import released_ab
import torch
from batch_plan import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS
from runner_standin import PageSpec, poison_problems


def page_problems(baseline: dict, indexed: dict, cache_dtype: str, conv_layout: str) -> list[str]:
    """Return every difference between the two runs' outputs and cache snapshots, and every poisoned byte either run's
    last snapshot touched (empty when the pages are bitwise equal and the poison is intact).

    Args:
        baseline, indexed: one case's run on each side (``released_ab.BatchRun.case``).
        cache_dtype: the recurrent-state cache dtype's torch name.
        conv_layout: the conv-state layout of the case (``SD`` / ``DS``).
    """
    problems = released_ab.compare_runs(baseline, indexed)
    spec = PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH, conv_layout=conv_layout)
    for side, run in (("baseline", baseline), ("indexed", indexed)):
        for name, raw in run["snapshots"][-1].items():
            problems += [f"{side} {name}: {problem}" for problem in
                         poison_problems(raw, spec, conv_rows=range(BLOCKS))]
    return problems
