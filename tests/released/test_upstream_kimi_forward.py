"""vLLM's ``KimiK3DeltaAttention._forward`` (installed 0.32; released 0.33's file) on the CPU, overlay off vs on.

:mod:`upstream_kimi_child` in two fresh processes (``KDA_PATCHES=0`` / ``1``, both STRICT), same fresh seed:
the real layer class and module (its ``gather_initial_states`` name, vLLM's CPU causal convolution), only
the CUDA kernels stood in. Prefill, mixed decode + prefill, decode-only and continued batches; both
conv-state layouts (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``); FP32 and BF16 caches; INT32 and INT64 indices.
"""

from __future__ import annotations

import pytest
import released_ab
import torch
from runner_standin import PageSpec, poison_problems
from upstream_kimi_child import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, PREFILL_CALLS

CASES = [("installed", "float32", "SD"), ("installed", "bfloat16", "DS"), ("0.33.0", "bfloat16", "SD")]


@pytest.mark.parametrize(("source", "cache_dtype", "conv_layout"), CASES, ids=["-".join(case) for case in CASES])
def test_kimi_forward_patched_equals_baseline(source: str, cache_dtype: str, conv_layout: str) -> None:
    seed = released_ab.fresh_seed()
    baseline, patched = released_ab.run_pair("upstream_kimi_child.py", [source, str(seed), cache_dtype, conv_layout])
    context = released_ab.note_run(f"vLLM {source} {baseline['class']}._forward ({baseline['layer_file']})", baseline)
    context += f"\nseed {seed}, {cache_dtype} cache, conv {conv_layout}"
    assert ("site-packages" in baseline["layer_file"]) == (source == "installed"), context  # whose code ran
    assert baseline["wrapped"] == "function" and patched["wrapped"] != "function", context
    assert patched["gather_wrapped"] != "function", context + "\nthe module's gather_initial_states is not wrapped"
    assert baseline["conv"] == "causal_conv1d_fn_cpu", context  # vLLM's own CPU convolution ran

    spec = PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH, conv_layout=conv_layout)
    # The layer's own convolution writes conv state: prefill rows, and in the decode-only batch vLLM's CPU
    # kernel (causal_conv1d_update_cpu_vec) rewrites every block's conv state through the input dtype (seen:
    # NaN 0xffc0c0c0 -> 0xffff0000 in the SD layout). So conv bytes are compared between the runs only;
    # gaps and the storage offset must keep their poison.
    conv_rows = range(BLOCKS)
    for run in (baseline, patched):
        for name, raw in run["snapshots"][-1].items():
            problems = poison_problems(raw, spec, conv_rows)
            assert not problems, context + f"\n{name}: {problems}"
    problems = released_ab.compare_runs(baseline, patched)
    assert not problems, context + "\n" + "\n".join(problems)

    seen = released_ab.counters(patched, "kimi_prefill")
    assert seen.get("calls_seen") == seen.get("calls_routed") == PREFILL_CALLS, context + f"\nledger: {seen}"
    assert not seen.get("calls_bypassed"), context + f"\nledger: {seen}"
    facts = patched["ledger"].get("facts", {}).get("kimi_prefill", {})
    assert all(facts.get(name, {}).get("plan_kind") for name in patched["snapshots"][-1]), context + f"\n{facts}"
