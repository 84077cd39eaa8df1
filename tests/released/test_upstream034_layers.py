"""vLLM 0.34.0's Qwen, Kimi Linear, Kimi K3 and Olmo seams on the CPU, overlay off vs on in both GDN-ops choices.

:mod:`upstream034_child` four times, all cases in each process (:func:`released_ab.run_batch`; the 0.34 coverage costs
four fresh processes, not a pair per case: issue 28; the baseline process also runs tests/indexed_chunk's no-copy
cases, :func:`released_batches.upstream034`), each case with its own fresh seed, the same on every side:

- ``baseline``: ``KDA_PATCHES=0`` (STRICT): upstream's own ``gather_initial_states`` / ``scatter_states`` copy the
  states of Qwen and Kimi Linear, ``gather_initial_states`` and an index assignment those of Kimi K3, indexing
  those of Olmo;
- ``measured``: ``KDA_PATCHES=1`` STRICT, ``KDA_PATCHES_GDN_OPS`` at its default: the H200 measurement of 0.34's
  own layers decides each seam: Qwen routed, the overlay stands aside on Kimi Linear (its seam unwrapped,
  ``not-applicable`` with the reason in ``kda-patches status``, upstream's ops launched as in the baseline);
- ``upstream``: ``KDA_PATCHES_GDN_OPS=upstream``: the overlay stands aside on Qwen and Kimi Linear and routes
  Kimi K3 and Olmo;
- ``overlay``: ``KDA_PATCHES_GDN_OPS=overlay``: all four routed (routed == seen), upstream's two kernels never
  launched.

Every case (layer x FP32/BF16 cache x SD/DS conv layout): the patched side's outputs and every byte of every page
equal the baseline's (NaN-poisoned gaps, offset and untouched conv state checked), through the shared batch plan
(prefill, mixed decode + prefill, decode-only, continued; INT32 and INT64 indices).

0.34's own ``breakable_cudagraph.py`` is executed (its ``eager_break_during_capture`` on the Kimi seams, as on
CUDA); the ``:breakable`` cases run each layer call under its ``BreakableCUDAGraphCapture`` (CUDA-graph calls stood
in) and replay the capture: where the seam is routed, every replay is a routed, counted call and the capture-time
run is routed and counted apart (``<section>:capture``) -- what a replay of the unwrapped function would miss.
The ``:flashinfer`` cases put Qwen on 0.34's FlashInfer prefill backend (its released ``_forward_flashinfer_prefill``
and ``fi_chunk_gated_delta_rule`` run; only FlashInfer's kernel is stood in): the gather is inside that branch, so
the seam stands aside on it -- no plan, calls counted ``calls_upstream``, never half-routed, STRICT quiet. The
``:flashkda`` cases put Kimi K3 on FlashKDA (its released FlashKDA branch and ``_flashkda_prefill`` run; only
``torch.ops._flashkda_C.fwd`` is stood in): its gather and scatter stand outside the branch and are routed.
"""

from __future__ import annotations

import pytest
import released_ab
import released_batches
import torch
from batch_plan import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, PREFILL_CALLS
from runner_standin import PageSpec, poison_problems
from upstream034_standins import BREAK_REPLAYS, GATHER_MODULE, LAYERS, SCATTER_MODULE, SECTION

from kda_patches.routing.seams import capture_section

RELEASE = "0.34.0"
CASES = released_batches.UPSTREAM034_CASES
GATHER, SCATTER = "_gather_initial_states_kernel", "_scatter_states_kernel"
# which layers each side routes through the overlay's plans
ROUTED = {"baseline": (), "measured": ("qwen", "k3", "olmo"), "upstream": ("k3", "olmo"),
          "overlay": ("qwen", "linear", "k3", "olmo")}
# upstream's kernels a layer launches per run of the batch plan when its seam is not routed (Olmo indexes)
UPSTREAM_LAUNCHES = {"qwen": {GATHER: PREFILL_CALLS, SCATTER: PREFILL_CALLS},
                     "linear": {GATHER: PREFILL_CALLS, SCATTER: PREFILL_CALLS},
                     "k3": {GATHER: PREFILL_CALLS, SCATTER: 0}, "olmo": {GATHER: 0, SCATTER: 0}}
# seams whose scatter takes the FP32 final state and writes the cache dtype (folded into the plan's scatter)
CASTING = ("qwen", "linear", "olmo")
_GDN = "vllm.model_executor.layers.mamba.gdn"
CHOSEN_SEAMS = {"qwen": f"{_GDN}.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention._forward_core",
                "linear": f"{_GDN}.kimi_gdn_linear_attn:KimiGatedDeltaNetAttention._forward"}
ROUTED_SEAMS = {"olmo": f"{_GDN}.olmo_gdn_linear_attn:OlmoHybridGatedDeltaNetAttention._forward_core",
                "k3": "vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention._forward"}
STANDS_ASIDE = "so the overlay stands aside"
PATCHED_SIDES = ("measured", "upstream", "overlay")
EAGER_BREAKS = ("k3", "linear")  # 0.34 decorates these seams with eager_break_during_capture


def runs_per_call(case: str) -> int:
    """How often each layer call of the batch plan runs: once, or captured once and replayed."""
    return 1 + BREAK_REPLAYS if case.endswith(":breakable") else 1


def served_per_call(case: str) -> int:
    """How many of those runs are served calls (a capture's own run is a dummy's, counted apart)."""
    return BREAK_REPLAYS if case.endswith(":breakable") else 1


SIDES = released_batches.UPSTREAM034_SIDES


@pytest.fixture(scope="module")
def runs() -> tuple[str, released_ab.BatchRun]:
    """The four sides over every case: ``(release root, the batch's run)``; the batch also serves
    tests/indexed_chunk's no-copy cases (one baseline process: :func:`released_batches.upstream034`)."""
    from kda_patches.releases.fetch import release_dir

    root = str(release_dir("vllm", RELEASE))
    return root, released_ab.run_batch(released_batches.upstream034(root))


def context_of(runs: tuple, case: str, side: str) -> str:
    """Record the layer as executed (with its stand-ins) and return the failure-message context."""
    _, batch = runs
    kind, run = case.split(":")[0], batch.case(case, "baseline")
    title = f"vLLM {RELEASE} {run['class']}.{LAYERS[kind][2]} ({run['layer_file']})"
    executed = {"standins": run["standins"][kind], "bound": run["bound"]}
    return released_ab.note_run(title, executed) + f"\n{batch.context(case)}, side {side}"


@pytest.mark.parametrize("case", CASES)
def test_baseline_runs_the_releases_own_code(runs: tuple, case: str) -> None:
    root, batch = runs
    run, kind = batch.case(case, "baseline"), case.split(":")[0]
    context = context_of(runs, case, "baseline")
    assert run["layer_file"].startswith(root), context  # the release's file ran, not the installed 0.32's
    assert run["wrapped"] == "function" and run["conv"] == "causal_conv1d_fn_cpu", context
    launches = {name: count * runs_per_call(case) for name, count in UPSTREAM_LAUNCHES[kind].items()}
    assert run["launches"] == launches, context + f"\nlaunches {run['launches']}"
    assert not run["counters"].get(SECTION[kind]), context + f"\n{run['counters']}"
    assert run["eager_break"] == (kind in EAGER_BREAKS), context  # the release's decorator, executed
    bound = run["bound"]
    for module, op in ((GATHER_MODULE, "gather_initial_states"), (SCATTER_MODULE, "scatter_states")):
        assert bound[module][op] == "release", context + f"\n{module}: {bound[module]}"  # upstream's op, executed
    helper = bound["vllm.model_executor.warmup.jit_warmup_triton_helper"]
    assert helper["triton_kernel_dispatcher_with_warmup"] == "release", context + f"\n{helper}"


@pytest.mark.parametrize("side", PATCHED_SIDES)
@pytest.mark.parametrize("case", CASES)
def test_patched_equals_baseline(runs: tuple, case: str, side: str) -> None:
    _, batch = runs
    kind, cache_dtype, conv_layout = case.split(":")[:3]
    baseline, patched = batch.case(case, "baseline"), batch.case(case, side)
    context = context_of(runs, case, side)

    problems = released_ab.compare_runs(baseline, patched)
    assert not problems, context + "\n" + "\n".join(problems)
    spec = PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH, conv_layout=conv_layout)
    for run in (baseline, patched):  # the layers' own convolutions write conv state: compared above
        for name, raw in run["snapshots"][-1].items():
            problems = poison_problems(raw, spec, conv_rows=range(BLOCKS))
            assert not problems, context + f"\n{name}: {problems}"

    seen = patched["counters"].get(SECTION[kind], {})
    captured = patched["counters"].get(capture_section(SECTION[kind]), {})
    plans = patched["facts"][SECTION[kind]]
    assert patched["eager_break"] == (kind in EAGER_BREAKS), context  # the overlay keeps the release's decorator
    served = PREFILL_CALLS * served_per_call(case)
    if kind in ROUTED[side] and case.endswith(":flashinfer"):  # wrapped, but no plan on this backend: upstream's
        assert patched["wrapped"] != "function", context + "\nthe seam is not wrapped"
        assert seen == {"calls_upstream": PREFILL_CALLS} and not captured, context + f"\nledger: {seen} {captured}"
        assert all(fact["decision"] == "stands-aside" and "gdn_prefill_backend='flashinfer'" in fact["reason"]
                   for fact in plans.values()), context + f"\n{plans}"
        assert patched["launches"] == UPSTREAM_LAUNCHES[kind], context + f"\nlaunches {patched['launches']}"
    elif kind in ROUTED[side]:
        assert patched["wrapped"] != "function", context + "\nthe seam is not wrapped"
        assert seen.get("calls_seen") == seen.get("calls_routed") == served, context + f"\nledger: {seen}"
        assert not seen.get("calls_bypassed"), context + f"\nledger: {seen}"
        at_capture = PREFILL_CALLS if case.endswith(":breakable") else 0
        assert captured.get("calls_seen", 0) == captured.get("calls_routed", 0) == at_capture, (
            context + f"\ncapture-time: {captured}")
        folds = served + at_capture if cache_dtype == "bfloat16" and kind in CASTING else 0
        assert seen.get("casts_folded", 0) + captured.get("casts_folded", 0) == folds, context + f"\n{seen}"
        assert not seen.get("casts_materialized"), context + f"\n{seen}"
        assert all(fact and fact.get("plan_kind") for fact in plans.values()), context + f"\n{plans}"
        assert patched["launches"] == {GATHER: 0, SCATTER: 0}, context + f"\nupstream's ops ran: {patched['launches']}"
    else:  # stands aside: upstream's ops copy the states, the overlay neither wraps nor prepares anything here
        assert patched["wrapped"] == "function", context + "\nthe seam was wrapped though the overlay stands aside"
        assert not seen and not captured, context + f"\nledger: {seen} {captured}"
        assert not any(plans.values()), context + f"\n{plans}"
        launches = {name: count * runs_per_call(case) for name, count in UPSTREAM_LAUNCHES[kind].items()}
        assert patched["launches"] == launches, context + f"\nlaunches {patched['launches']}"


def test_the_choice_is_in_the_ledger_and_status(runs: tuple) -> None:
    _, batch = runs
    sides = {side: batch.process(side) for side, _ in SIDES}
    context = f"{batch.batch.title}, seeds {batch.seeds}"
    assert all(patch["state"] == "disabled" for patch in sides["baseline"]["ledger"]["patches"].values()), context

    targets = {side: {**sides[side]["ledger"]["patches"]["gdn_state_copy"]["targets"],
                      **{f"kimi_prefill {key}": value for key, value in
                         sides[side]["ledger"]["patches"]["kimi_prefill"]["targets"].items()}}
               for side in PATCHED_SIDES}
    for kind, key in CHOSEN_SEAMS.items():  # each side's choice, visibly: applied, or standing aside with the reason
        for side in PATCHED_SIDES:
            target = targets[side][key]
            line = next((line for line in sides[side]["status"].splitlines() if key in line), "")
            if kind in ROUTED[side]:
                assert target["state"] == "applied", context + f"\n{side} {key}: {target}"
                routing = sides[side]["ledger"]["facts"]["gdn_state_copy"][f"routing {key}"]
                assert routing["mechanism"] == "rewrite", context + f"\n{routing}"
                replaced = " ".join(routing["replaced"])
                assert "gather_initial_states call" in replaced and "scatter_states call" in replaced, (
                    context + f"\n{routing}")
            else:
                assert target["state"] == "not-applicable" and STANDS_ASIDE in target["reason"], (
                    context + f"\n{side} {key}: {target}")
                assert line.split()[:1] == ["not-applicable"] and "stands aside" in line, (
                    context + f"\n{side} {kind}: {line!r}")
    for kind, key in ROUTED_SEAMS.items():  # routed in every choice
        key = key if kind == "olmo" else f"kimi_prefill {key}"
        for side in PATCHED_SIDES:
            assert targets[side][key]["state"] == "applied", context + f"\n{side} {key}: {targets[side][key]}"
