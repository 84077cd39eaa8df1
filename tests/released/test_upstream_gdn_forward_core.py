"""vLLM's Qwen / Olmo hybrid GDN ``_forward_core`` (installed 0.32; released 0.33's files) on the CPU, A/B.

:mod:`upstream_child` in fresh processes (``KDA_PATCHES=0`` / ``1``, both STRICT), one per side for all the cases
of one vLLM source (:func:`released_batches.upstream`, shared with the Kimi layers' cases), each case with its own
fresh seed: the real layer class and module (vLLM's CPU causal convolution), only the fused Triton GDN kernels
stood in (:mod:`gdn_standins`). Prefill, mixed decode + prefill, decode-only and continued batches; both
conv-state layouts; FP32 and BF16 caches; INT32 and INT64 indices. The ``gdn_state_copy`` ledger must show every
prefill call routed through plans the overlay's startup hook prepared.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import released_ab
import released_batches
import torch
from batch_plan import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, PREFILL_CALLS
from released_batches import UPSTREAM_GDN_CASES as CASES
from runner_standin import PageSpec, poison_problems


@pytest.fixture(scope="module")
def upstream() -> Callable[[str], released_ab.BatchRun]:
    """``source -> its batch's run``: each source's processes run once, when a case first asks for them."""
    return lambda source: released_ab.run_batch(released_batches.upstream(source))


@pytest.mark.parametrize(("kind", "source", "cache_dtype", "conv_layout"), CASES, ids=["-".join(c) for c in CASES])
def test_gdn_forward_core_patched_equals_baseline(upstream: Callable, kind: str, source: str, cache_dtype: str,
                                                  conv_layout: str) -> None:
    run, case = upstream(source), released_batches.upstream_case(kind, cache_dtype, conv_layout)
    baseline, patched = run.pair(case)
    context = released_ab.note_run(f"vLLM {source} {baseline['class']}._forward_core ({baseline['layer_file']})",
                                   baseline)
    context += f"\n{run.context(case)}: {cache_dtype} cache, conv {conv_layout}"
    assert ("site-packages" in baseline["layer_file"]) == (source == "installed"), context  # whose code ran
    assert baseline["wrapped"] == "function" and patched["wrapped"] != "function", context
    assert baseline["conv"] == "causal_conv1d_fn_cpu", context

    spec = PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH, conv_layout=conv_layout)
    for side in (baseline, patched):  # conv state: written by the layer's own (CPU) convolution, compared below
        for name, raw in side["snapshots"][-1].items():
            problems = poison_problems(raw, spec, conv_rows=range(BLOCKS))
            assert not problems, context + f"\n{name}: {problems}"
    problems = released_ab.compare_runs(baseline, patched)
    assert not problems, context + "\n" + "\n".join(problems)

    seen = released_ab.counters(patched, "gdn_state_copy")
    assert seen.get("calls_seen") == seen.get("calls_routed") == PREFILL_CALLS, context + f"\nledger: {seen}"
    assert not seen.get("calls_bypassed"), context + f"\nledger: {seen}"
    # the stand-in chunk rule returns FP32 finals: a BF16 cache's `.to()` is folded into every routed scatter
    folds = PREFILL_CALLS if cache_dtype == "bfloat16" else 0
    assert seen.get("casts_folded", 0) == folds and not seen.get("casts_materialized"), context + f"\nledger: {seen}"
    facts = patched["ledger"].get("facts", {}).get("gdn_state_copy", {})
    assert all(facts.get(name, {}).get("plan_kind") for name in patched["snapshots"][-1]), context + f"\n{facts}"
