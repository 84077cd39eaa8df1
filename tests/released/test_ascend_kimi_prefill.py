"""vllm-ascend's released Kimi ``_run_prefill`` (0.26.0rc1-0.29.0rc1) executed on the CPU, overlay off vs on.

:mod:`ascend_child` in fresh processes (``KDA_PATCHES=0`` / ``1``, both STRICT), one per side for all the cases of
one release (:func:`released_batches.ascend` / :func:`released_batches.ascend030`, shared with that release's GDN
cases), each case with its own fresh seed: the release's own ``kimi_kda.py`` and ``clear_ssm_states`` (its
Triton kernel under the interpreter), imported under their real names so the overlay's registry wraps them;
plans prepared by the overlay's startup hook on the stand-in runner. Five batches per layer: fresh prefills,
chunked continuations of cached rows, ``keep_meta`` compaction, INT32 and INT64 indices; idle rows, page gaps,
the storage offset and the conv state (NaN patterns) must keep their bits.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import released_ab
import released_batches
import torch
from ascend_kimi_layers import BATCHES, BLOCKS, HEAD_DIM, HEADS, LAYERS
from released_batches import ASCEND_KIMI_CASES as RELEASES
from released_batches import KIMI_FORK_RELEASES as FORK_RELEASES
from runner_standin import PageSpec, poison_problems


@pytest.fixture(scope="module")
def ascend() -> Callable[[str], released_ab.BatchRun]:
    """``release -> the run of the batch its Kimi case is in``: each batch runs once, when a case first asks."""
    def run(release: str) -> released_ab.BatchRun:
        if release in FORK_RELEASES:
            return released_ab.run_batch(released_batches.ascend030(release))
        return released_ab.run_batch(released_batches.ascend(release, released_batches.KIMI_VARIANT[release]))

    return run


@pytest.mark.parametrize(("release", "cache_dtype"), RELEASES)
def test_released_run_prefill_patched_equals_baseline(ascend: Callable, release: str, cache_dtype: str) -> None:
    run, case = ascend(release), f"kimi:{cache_dtype}"
    baseline, patched = run.pair(case)
    context = released_ab.note_run(f"vllm-ascend {release} {baseline['class']}._run_prefill", baseline)
    context += f"\n{run.context(case)}: {cache_dtype} cache"
    assert baseline["init_error"] is None, context + f"\nbaseline startup failed: {baseline['init_error']}"
    assert patched["init_error"] is None, context + f"\npatched startup failed: {patched['init_error']}"
    assert baseline["wrapped"] == "function", context
    assert patched["wrapped"] != "function", context + "\n_run_prefill was not wrapped by the overlay"

    spec = PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype))
    for side in (baseline, patched):
        for name, raw in side["snapshots"][-1].items():
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
def test_released_fork_plan_release_is_left_to_the_fork(ascend: Callable, release: str) -> None:
    """0.30 ships its own plan: the overlay leaves ``_run_prefill`` alone and only watches the fork's startup.

    On the CPU the fork's own ``initialize_kda_state_copy`` refuses the caches (its plans require
    ``state.device.type == "npu"``), so no prefill can run here with either side; both sides must fail
    identically, in the fork's code, and the overlay must not have wrapped the seam or published a plan.
    The patched side is the batch's ``fork`` side: ``KDA_PATCHES=1`` with every switch at its default.
    """
    run, case = ascend(release), "kimi:float32"
    baseline, patched = run.case(case, "baseline"), run.case(case, "fork")
    context = released_ab.note_run(f"vllm-ascend {release} kda_state_copy_plan.initialize_kda_state_copy "
                                   "(the fork's own plan; refuses CPU caches)", baseline) + f"\n{run.context(case)}"
    assert baseline["init_error"] == patched["init_error"], context
    assert "requires nonempty NPU" in str(baseline["init_error"]), context + f"\n{baseline['init_error']}"
    assert baseline["wrapped"] == patched["wrapped"] == "function", context + "\nthe fork's _run_prefill was wrapped"
    assert baseline["fork_initialize"] == "function", context
    assert patched["fork_initialize"] != "function", context + "\nthe fork's initialize_kda_state_copy is not watched"
    assert not released_ab.counters(patched, "kimi_prefill").get("calls_seen"), context
