"""vllm-ascend's released ``AscendGatedDeltaNetAttention._forward_core`` (0.26.0rc1-0.29.0rc1) on the CPU, A/B.

:mod:`ascend_child` in fresh processes (``KDA_PATCHES=0`` / ``1``, both STRICT), one per side for all the cases of
one release and prefill variant (:func:`released_batches.ascend`, shared with that release's Kimi case), each case
with its own fresh seed: the release's own ``gdn.py`` and ``clear_ssm_states`` (Triton kernel under the
interpreter), both of its prefill variants -- ``fused`` (CANN fused chunk present: gather/scatter on the cache
layout) and ``triton`` (``.transpose(-1, -2).contiguous()`` around the Triton chunk; 0.26 has only this one) --
with prefill, mixed decode + prefill, decode-only and continued batches, INT32 and INT64 indices, FP32 and BF16
caches. The conv state is the fork's SD layout (its AscendC kernel's only layout; the kernel is stood in).
vllm-ascend 0.30 is not a ``gdn_state_copy`` target by default (its NPU paths copy with its own kernels):
:mod:`test_ascend_gdn030_overlay`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import released_ab
import released_batches
import torch
from batch_plan import BATCHES, BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, PREFILL_CALLS
from released_batches import ASCEND_GDN_CASES as CASES
from runner_standin import PageSpec, poison_problems


@pytest.fixture(scope="module")
def ascend() -> Callable[[str, str], released_ab.BatchRun]:
    """``(release, variant) -> its batch's run``: each batch's processes run once, when a case first asks."""
    return lambda release, variant: released_ab.run_batch(released_batches.ascend(release, variant))


@pytest.mark.parametrize(("release", "variant", "cache_dtype"), CASES, ids=[f"{r}-{v}" for r, v, _ in CASES])
def test_released_gdn_forward_core_patched_equals_baseline(ascend: Callable, release: str, variant: str,
                                                           cache_dtype: str) -> None:
    run, case = ascend(release, variant), f"gdn:{cache_dtype}"
    baseline, patched = run.pair(case)
    context = released_ab.note_run(f"vllm-ascend {release} {baseline['class']}._forward_core ({variant})", baseline)
    context += f"\n{run.context(case)}: {cache_dtype} cache"
    assert baseline["fused"] == patched["fused"] == (variant == "fused"), context + "\nwrong prefill variant ran"
    assert baseline["wrapped"] == "function" and patched["wrapped"] != "function", context

    spec = PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH, conv_layout="SD")
    rows = {row for batch in BATCHES for row in batch[0]}  # the fork's convolution writes these conv rows
    for side in (baseline, patched):
        for name, raw in side["snapshots"][-1].items():
            problems = poison_problems(raw, spec, conv_rows=rows)
            assert not problems, context + f"\n{name}: {problems}"
    problems = released_ab.compare_runs(baseline, patched)
    assert not problems, context + "\n" + "\n".join(problems)

    seen = released_ab.counters(patched, "gdn_state_copy")
    assert seen.get("calls_seen") == seen.get("calls_routed") == PREFILL_CALLS, context + f"\nledger: {seen}"
    assert not seen.get("calls_bypassed"), context + f"\nledger: {seen}"
    # the fused variant's chunk (wrapped for the folded cast) runs under the overlay, but its stand-in returns
    # finals in the cache dtype (the fused op's real final dtype is unknown here): `.to()` is a no-op, no fold
    assert not seen.get("casts_folded") and not seen.get("casts_materialized"), context + f"\nledger: {seen}"
    facts = patched["ledger"].get("facts", {}).get("gdn_state_copy", {})
    assert all(facts.get(name, {}).get("plan_kind") for name in patched["snapshots"][-1]), context + f"\n{facts}"
