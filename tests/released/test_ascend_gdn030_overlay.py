"""``KDA_PATCHES_GDN_PLAN`` on vllm-ascend 0.30's released ``AscendGatedDeltaNetAttention._forward_core``, A/B.

:mod:`ascend_child` (the release's ``gdn.py``, FLA prefill branch, the fork's Triton ``gather_ssm_states`` /
``scatter_ssm_states_`` under the interpreter), one fresh process per side for all the cases of one release
(:func:`released_batches.ascend030`, shared with :mod:`test_ascend_gdn030_fla_baseline` and the release's Kimi
case), each case with its own fresh seed; the sides:

- ``baseline``: ``KDA_PATCHES=0``;
- ``fork``: ``KDA_PATCHES=1``, STRICT, the switch at its default (``fork``): the overlay stands aside -- the seam
  and both runners' startup hooks unwrapped, ``not-applicable`` with the stand-aside reason, nothing prepared;
- ``overlay``: ``KDA_PATCHES_GDN_PLAN=overlay``, STRICT: the seam runs its rewritten twin, the two kernel calls
  go to the overlay's plan (prepared by the wrapped runner's startup), the fork's kernels never launch.

Every side's outputs and every byte of every page must equal the baseline's, and the page poison outside the
rows a batch selects must be intact.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import released_ab
import released_batches
import torch
from batch_plan import BATCHES, BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, PREFILL_CALLS
from released_batches import GDN030_CASES as CASES
from runner_standin import PageSpec, poison_problems

SEAM_KEY = "vllm_ascend.ops.gdn:AscendGatedDeltaNetAttention._forward_core"
RUNNER_KEY = "vllm_ascend.worker.model_runner_v1:NPUModelRunner.initialize_kv_cache"
FORK_LAUNCHES = {"_gather_ssm_states_kernel": PREFILL_CALLS, "_scatter_ssm_states_kernel": PREFILL_CALLS}
WRITTEN_ROWS = {row for batch in BATCHES for row in batch[0]}


@pytest.fixture(scope="module")
def ascend030() -> Callable[[str], released_ab.BatchRun]:
    """``release -> its batch's run``: each release's processes run once, when a case first asks for them."""
    return lambda release: released_ab.run_batch(released_batches.ascend030(release))


@pytest.mark.parametrize(("release", "cache_dtype"), CASES, ids=[f"{r}-{d}" for r, d in CASES])
def test_gdn_plan_overlay_equals_the_forks_kernels_and_fork_stands_aside(ascend030: Callable, release: str,
                                                                         cache_dtype: str) -> None:
    batch, case = ascend030(release), f"gdn:{cache_dtype}"
    runs = {side: batch.case(case, side) for side in ("baseline", "fork", "overlay")}
    baseline, fork, overlay = runs["baseline"], runs["fork"], runs["overlay"]
    context = released_ab.note_run(f"vllm-ascend {release} {baseline['class']}._forward_core (fla)", baseline)
    context += f"\n{batch.context(case)}: {cache_dtype} cache"
    for run in runs.values():
        assert run["branch"] == {"fla": PREFILL_CALLS, "triton": 0}, context + f"\nbranch {run['branch']}"

    # default: the fork copies with its own kernels; the overlay wraps nothing of it and says why
    assert fork["wrapped"] == "function" and fork["kernel_launches"] == FORK_LAUNCHES, context
    targets = fork["ledger"]["patches"]["gdn_state_copy"]["targets"]
    for key in (SEAM_KEY, RUNNER_KEY):
        assert targets[key]["state"] == "not-applicable", context + f"\n{key}: {targets[key]}"
        assert "KDA_PATCHES_GDN_PLAN=overlay routes" in targets[key]["reason"], context + f"\n{targets[key]}"
    assert not released_ab.counters(fork, "gdn_state_copy"), context + f"\n{fork['ledger']['counters']}"

    # overlay: every prefill call routed through the overlay's plan, the fork's kernels never launched
    assert overlay["wrapped"] != "function", context + "\nthe seam is not wrapped under KDA_PATCHES_GDN_PLAN=overlay"
    seen = released_ab.counters(overlay, "gdn_state_copy")
    assert seen.get("calls_seen") == seen.get("calls_routed") == PREFILL_CALLS, context + f"\nledger: {seen}"
    assert not seen.get("calls_bypassed"), context + f"\nledger: {seen}"
    assert overlay["kernel_launches"] == dict.fromkeys(FORK_LAUNCHES, 0), context + f"\n{overlay['kernel_launches']}"
    facts = overlay["ledger"]["facts"]["gdn_state_copy"]
    routing = facts[f"routing {SEAM_KEY}"]
    assert routing["mechanism"] == "rewrite", context + f"\n{routing}"
    assert sum("call" in line for line in routing["replaced"]) == 4, context + f"\n{routing}"  # both NPU branches
    assert all(facts.get(name, {}).get("plan_kind") for name in overlay["snapshots"][-1]), context + f"\n{facts}"

    spec = PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH, conv_layout="SD")
    for side in ("fork", "overlay"):
        problems = released_ab.compare_runs(baseline, runs[side])
        assert not problems, context + f"\n{side} differs from the baseline:\n" + "\n".join(problems)
        for name, raw in runs[side]["snapshots"][-1].items():
            problems = poison_problems(raw, spec, conv_rows=WRITTEN_ROWS)
            assert not problems, context + f"\n{side} {name}: {problems}"
