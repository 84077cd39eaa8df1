"""vLLM's Kimi K3 KDA / Kimi Linear GDN ``_forward`` (installed 0.32; released 0.33's files) on the CPU, A/B.

:mod:`upstream_kimi_child` in two fresh processes (``KDA_PATCHES=0`` / ``1``, both STRICT), same fresh seed:
the real layer class and module (its ``gather_initial_states`` name, vLLM's CPU causal convolution), only
the CUDA kernels stood in. Prefill, mixed decode + prefill, decode-only and continued batches; both
conv-state layouts (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``); FP32 and BF16 caches; INT32 and INT64 indices.
"""

from __future__ import annotations

import pytest
import released_ab
import torch
from batch_plan import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, PREFILL_CALLS
from runner_standin import PageSpec, poison_problems
from upstream_standins import LAYERS

CASES = [("k3", "installed", "float32", "SD"), ("k3", "installed", "bfloat16", "DS"),
         ("k3", "0.33.0", "bfloat16", "SD"), ("linear", "installed", "float32", "SD"),
         ("linear", "0.33.0", "float32", "DS")]
# Kimi Linear scatters ``recurrent_state[idx] = last`` without a cast: with a BF16 cache and the FP32 final
# state FLA returns, vLLM's own code raises (index_put dtype mismatch) while the routed scatter would cast,
# so that layer runs on FP32 caches here (the divergence is reported, not asserted).


@pytest.mark.parametrize(("kind", "source", "cache_dtype", "conv_layout"), CASES, ids=["-".join(c) for c in CASES])
def test_kimi_forward_patched_equals_baseline(kind: str, source: str, cache_dtype: str, conv_layout: str) -> None:
    seed = released_ab.fresh_seed()
    baseline, patched = released_ab.run_pair("upstream_kimi_child.py",
                                             [kind, source, str(seed), cache_dtype, conv_layout])
    section = LAYERS[kind][2]
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

    seen = released_ab.counters(patched, section)
    assert seen.get("calls_seen") == seen.get("calls_routed") == PREFILL_CALLS, context + f"\nledger: {seen}"
    assert not seen.get("calls_bypassed"), context + f"\nledger: {seen}"
    facts = patched["ledger"].get("facts", {}).get(section, {})
    assert all(facts.get(name, {}).get("plan_kind") for name in patched["snapshots"][-1]), context + f"\n{facts}"
