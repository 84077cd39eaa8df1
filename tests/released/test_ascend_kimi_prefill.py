"""vllm-ascend's released Kimi ``_run_prefill`` (0.26.0rc1-0.29.0rc1) executed on the CPU, overlay off vs on.

Each case runs :mod:`ascend_kimi_child` twice in fresh processes (``KDA_PATCHES=0`` / ``1``, both STRICT)
with the same fresh seed: the release's own ``kimi_kda.py`` and ``clear_ssm_states`` (its Triton kernel
under the interpreter), imported under their real names so the overlay's registry wraps them; plans
prepared by the overlay's startup hook on the stand-in runner. Five batches per layer: fresh prefills,
chunked continuations of cached rows, ``keep_meta`` compaction, INT32 and INT64 indices; idle rows,
page gaps, the storage offset and the conv state (NaN patterns) must keep their bits.
"""

from __future__ import annotations

import pytest
import released_ab
import torch
from ascend_kimi_child import BATCHES, BLOCKS, HEAD_DIM, HEADS, LAYERS
from runner_standin import PageSpec, poison_problems

RELEASES = [("0.26.0rc1", "float32"), ("0.27.1rc1", "bfloat16"), ("0.28.0rc1", "float32"), ("0.29.0rc1", "bfloat16")]
FORK_RELEASES = ["0.30.0rc1", "0.30.0rc2"]


@pytest.mark.parametrize(("release", "cache_dtype"), RELEASES)
def test_released_run_prefill_patched_equals_baseline(release: str, cache_dtype: str) -> None:
    seed = released_ab.fresh_seed()
    baseline, patched = released_ab.run_pair("ascend_kimi_child.py", [release, str(seed), cache_dtype])
    context = released_ab.note_run(f"vllm-ascend {release} {baseline['class']}._run_prefill", baseline)
    context += f"\nseed {seed}, {cache_dtype} cache"
    assert baseline["init_error"] is None, context + f"\nbaseline startup failed: {baseline['init_error']}"
    assert patched["init_error"] is None, context + f"\npatched startup failed: {patched['init_error']}"
    assert baseline["wrapped"] == "function", context
    assert patched["wrapped"] != "function", context + "\n_run_prefill was not wrapped by the overlay"

    spec = PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype))
    for run in (baseline, patched):
        for name, raw in run["snapshots"][-1].items():
            assert not poison_problems(raw, spec), context + f"\n{name}: {poison_problems(raw, spec)}"
    problems = released_ab.compare_runs(baseline, patched)
    assert not problems, context + "\n" + "\n".join(problems)

    calls = len(BATCHES) * LAYERS
    seen = released_ab.counters(patched, "kimi_prefill")
    assert seen.get("calls_seen") == seen.get("calls_routed") == calls, context + f"\nledger: {seen}"
    assert not seen.get("calls_bypassed"), context + f"\nledger: {seen}"
    facts = patched["ledger"].get("facts", {}).get("kimi_prefill", {})
    kinds = {name: facts.get(name, {}).get("plan_kind") for name in patched["snapshots"][-1]}
    assert all(kinds.values()), context + f"\nno plan published by the overlay's startup hook: {facts}"


@pytest.mark.parametrize("release", FORK_RELEASES)
def test_released_fork_plan_release_is_left_to_the_fork(release: str) -> None:
    """0.30 ships its own plan: the overlay leaves ``_run_prefill`` alone and only watches the fork's startup.

    On the CPU the fork's own ``initialize_kda_state_copy`` refuses the caches (its plans require
    ``state.device.type == "npu"``), so no prefill can run here with either side; both sides must fail
    identically, in the fork's code, and the overlay must not have wrapped the seam or published a plan.
    """
    seed = released_ab.fresh_seed()
    baseline, patched = released_ab.run_pair("ascend_kimi_child.py", [release, str(seed), "float32"])
    context = released_ab.note_run(f"vllm-ascend {release} kda_state_copy_plan.initialize_kda_state_copy "
                                   "(the fork's own plan; refuses CPU caches)", baseline) + f"\nseed {seed}"
    assert baseline["init_error"] == patched["init_error"], context
    assert "requires nonempty NPU" in str(baseline["init_error"]), context + f"\n{baseline['init_error']}"
    assert baseline["wrapped"] == patched["wrapped"] == "function", context + "\nthe fork's _run_prefill was wrapped"
    assert baseline["fork_initialize"] == "function", context
    assert patched["fork_initialize"] != "function", context + "\nthe fork's initialize_kda_state_copy is not watched"
    assert not released_ab.counters(patched, "kimi_prefill").get("calls_seen"), context
