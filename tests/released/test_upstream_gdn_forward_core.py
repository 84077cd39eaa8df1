"""vLLM's Qwen / Olmo hybrid GDN ``_forward_core`` (installed 0.32; released 0.33's files) on the CPU, A/B.

:mod:`upstream_gdn_child` in two fresh processes (``KDA_PATCHES=0`` / ``1``, both STRICT), same fresh seed:
the real layer class and module (vLLM's CPU causal convolution), only the fused Triton GDN kernels stood in
(:mod:`gdn_standins`). Prefill, mixed decode + prefill, decode-only and continued batches; both conv-state
layouts; FP32 and BF16 caches; INT32 and INT64 indices. The ``gdn_state_copy`` ledger must show every
prefill call routed through plans the overlay's startup hook prepared.
"""

from __future__ import annotations

import pytest
import released_ab
import torch
from batch_plan import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, PREFILL_CALLS
from runner_standin import PageSpec, poison_problems

CASES = [("qwen", "installed", "float32", "SD"), ("qwen", "installed", "bfloat16", "DS"),
         ("qwen", "0.33.0", "float32", "DS"), ("olmo", "installed", "bfloat16", "SD"),
         ("olmo", "0.33.0", "float32", "DS")]


@pytest.mark.parametrize(("kind", "source", "cache_dtype", "conv_layout"), CASES, ids=["-".join(c) for c in CASES])
def test_gdn_forward_core_patched_equals_baseline(kind: str, source: str, cache_dtype: str, conv_layout: str) -> None:
    seed = released_ab.fresh_seed()
    baseline, patched = released_ab.run_pair("upstream_gdn_child.py",
                                             [kind, source, str(seed), cache_dtype, conv_layout])
    context = released_ab.note_run(f"vLLM {source} {baseline['class']}._forward_core ({baseline['layer_file']})",
                                   baseline)
    context += f"\nseed {seed}, {cache_dtype} cache, conv {conv_layout}"
    assert ("site-packages" in baseline["layer_file"]) == (source == "installed"), context  # whose code ran
    assert baseline["wrapped"] == "function" and patched["wrapped"] != "function", context
    assert baseline["conv"] == "causal_conv1d_fn_cpu", context

    spec = PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH, conv_layout=conv_layout)
    for run in (baseline, patched):  # conv state: written by the layer's own (CPU) convolution, compared below
        for name, raw in run["snapshots"][-1].items():
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
