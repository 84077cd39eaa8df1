"""vLLM's Kimi K3 KDA / Kimi Linear GDN ``_forward`` (installed 0.32; released 0.33's files) on the CPU, A/B.

:mod:`upstream_child` in fresh processes (``KDA_PATCHES=0`` / ``1``, both STRICT), one per side for all the cases
of one vLLM source (:func:`released_batches.upstream`, shared with the Qwen / Olmo cases), each case with its own
fresh seed: the real layer class and module (its ``gather_initial_states`` name, vLLM's CPU causal convolution),
only the CUDA kernels stood in. Prefill, mixed decode + prefill, decode-only and continued batches; both
conv-state layouts (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``); FP32 and BF16 caches; INT32 and INT64 indices.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import released_ab
import released_batches
import torch
from batch_plan import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, PREFILL_CALLS
from released_batches import UPSTREAM_KIMI_CASES as CASES
from runner_standin import PageSpec, poison_problems
from upstream_standins import LAYERS


@pytest.fixture(scope="module")
def upstream() -> Callable[[str], released_ab.BatchRun]:
    """``source -> its batch's run``: each source's processes run once, when a case first asks for them."""
    return lambda source: released_ab.run_batch(released_batches.upstream(source))


@pytest.mark.parametrize(("kind", "source", "cache_dtype", "conv_layout"), CASES, ids=["-".join(c) for c in CASES])
def test_kimi_forward_patched_equals_baseline(upstream: Callable, kind: str, source: str, cache_dtype: str,
                                              conv_layout: str) -> None:
    run, case = upstream(source), released_batches.upstream_case(kind, cache_dtype, conv_layout)
    baseline, patched = run.pair(case)
    section = LAYERS[kind][2]
    context = released_ab.note_run(f"vLLM {source} {baseline['class']}._forward ({baseline['layer_file']})", baseline)
    context += f"\n{run.context(case)}: {cache_dtype} cache, conv {conv_layout}"
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
    for side in (baseline, patched):
        for name, raw in side["snapshots"][-1].items():
            problems = poison_problems(raw, spec, conv_rows)
            assert not problems, context + f"\n{name}: {problems}"
    problems = released_ab.compare_runs(baseline, patched)
    assert not problems, context + "\n" + "\n".join(problems)

    seen = released_ab.counters(patched, section)
    assert seen.get("calls_seen") == seen.get("calls_routed") == PREFILL_CALLS, context + f"\nledger: {seen}"
    assert not seen.get("calls_bypassed"), context + f"\nledger: {seen}"
    facts = patched["ledger"].get("facts", {}).get(section, {})
    assert all(facts.get(name, {}).get("plan_kind") for name in patched["snapshots"][-1]), context + f"\n{facts}"
