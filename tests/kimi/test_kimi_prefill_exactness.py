"""A/B exactness of the kimi_prefill patch on the reference layers (issue 5, deliverable 5).

Baseline = the reference modules unpatched; patched = the same modules freshly imported with the patch
registered through the registry's post-import hooks, plans published by the runner's startup hook. Every
output and every byte of every cache buffer (page gaps and storage offset included) must be equal.
"""

from __future__ import annotations

import os

import kimi_kda_ops
import kimi_workload
import pytest
import torch
import vllm_stack

HERE = os.path.dirname(os.path.abspath(__file__))


def run_side(load_reference, patched: bool, cache_dtype: torch.dtype, index_dtype: torch.dtype,
             upstream: bool = False, shapes: tuple[tuple[int, int, int], ...] = kimi_workload.CPU_BATCHES
             ) -> tuple[list[str], dict[str, torch.Tensor], int]:
    """Run the deterministic batches once; return (output digests, raw cache bits, original clears run)."""
    modules = load_reference(patched=patched)
    world = kimi_workload.build_world(modules, upstream=upstream, cache_dtype=cache_dtype)
    kimi_workload.start_world(world)
    clears = kimi_kda_ops.CLEAR_CALLS["count"]
    outputs = kimi_workload.run_world(world, index_dtype=index_dtype, shapes=shapes)
    caches = {name: kimi_workload.raw_bits(raw).clone() for name, raw in world.runner.raw_caches.items()}
    return [kimi_workload.digest(out) for out in outputs], caches, kimi_kda_ops.CLEAR_CALLS["count"] - clears


def assert_same_caches(baseline: dict[str, torch.Tensor], patched: dict[str, torch.Tensor]) -> None:
    assert baseline.keys() == patched.keys()
    for name in baseline:
        differing = (baseline[name] != patched[name]).nonzero().flatten()[:8].tolist()
        assert not differing, f"cache of {name} differs at raw elements {differing}"


@pytest.mark.parametrize(("cache_dtype", "index_dtype", "shapes"), [
    (torch.float32, torch.int32, kimi_workload.CPU_BATCHES),  # the full set: 1..64 sequences, lengths 1..1024
    (torch.float32, torch.int64, kimi_workload.SMALL_BATCHES),
    (torch.bfloat16, torch.int32, kimi_workload.SMALL_BATCHES),
    (torch.bfloat16, torch.int64, kimi_workload.CPU_BATCHES),
], ids=["fp32-int32-full", "fp32-int64", "bf16-int32", "bf16-int64-full"])
def test_patched_prefill_equals_baseline_bit_for_bit(load_reference, strict, cache_dtype, index_dtype, shapes):
    """Outputs and whole caches equal the baseline's; every call routed; the fork's clear elided (folded)."""
    batches = len(shapes)
    base_outputs, base_caches, base_clears = run_side(load_reference, False, cache_dtype, index_dtype, shapes=shapes)
    before = kimi_workload.prefill_counters()
    outputs, caches, clears = run_side(load_reference, True, cache_dtype, index_dtype, shapes=shapes)
    after = kimi_workload.prefill_counters()

    assert outputs == base_outputs
    assert_same_caches(base_caches, caches)
    grew = {key: after.get(key, 0) - before.get(key, 0) for key in ("calls_seen", "calls_routed", "calls_bypassed")}
    assert grew == {"calls_seen": batches, "calls_routed": batches, "calls_bypassed": 0}
    assert base_clears == batches and clears == 0  # the plan's flagged gather replaced every clear


def test_upstream_seam_equals_baseline_and_skips_decode(load_reference, strict):
    """Upstream-shaped ``_forward``: prefill routed and exact; a decode-only call is left alone."""
    vllm_stack.import_vllm("vllm.forward_context")
    shapes = kimi_workload.SMALL_BATCHES
    base_outputs, base_caches, _ = run_side(load_reference, False, torch.float32, torch.int64, True, shapes)
    before = kimi_workload.prefill_counters()
    outputs, caches, _ = run_side(load_reference, True, torch.float32, torch.int64, True, shapes)
    after = kimi_workload.prefill_counters()
    assert outputs == base_outputs
    assert_same_caches(base_caches, caches)
    batches = len(shapes)
    assert after.get("calls_routed", 0) - before.get("calls_routed", 0) == batches
    assert after.get("calls_bypassed", 0) == before.get("calls_bypassed", 0)

    from vllm.forward_context import ForwardContext, override_forward_context

    modules = load_reference(patched=True)
    world = kimi_workload.build_world(modules, upstream=True)
    kimi_workload.start_world(world)
    layer = next(iter(world.layers.values()))
    cache = layer.kv_cache
    decode = modules["kimi_upstream_layer"].KDAMetadata(0, 1, torch.ones(1, dtype=torch.bool),
                                                        torch.zeros(1, dtype=torch.int32),
                                                        torch.tensor([0, 1], dtype=torch.int32), (0, 1))
    seen = kimi_workload.prefill_counters().get("calls_seen", 0)
    context = ForwardContext(no_compile_layers=world.layers, attn_metadata={layer.prefix: decode}, slot_mapping={})
    with override_forward_context(context):
        layer._forward(torch.zeros(1, 48), torch.zeros(1, 1, 2, 8), None, torch.zeros(1, 1, 2),
                       torch.zeros(1, 1, 2, 8))
    assert kimi_workload.prefill_counters().get("calls_seen", 0) == seen
    assert layer.kv_cache is cache


def test_compacted_indices_keep_exactness_and_run_the_forks_clear(routing, load_reference, strict):
    """With ``keep_meta`` the gather key is a compacted copy. The alias then does not fold the clear (its fold is
    keyed on the call's own index object) and the fork's runs; the rewrite folds it (the clear follows the
    gather in the source, whatever the index). Exact either way."""
    def run(patched: bool) -> tuple[str, torch.Tensor, int]:
        modules = load_reference(patched=patched)
        world = kimi_workload.build_world(modules)
        kimi_workload.start_world(world)
        layer = next(iter(world.layers.values()))
        state = layer.kv_cache[1]
        batch = kimi_workload.make_batches(3, state.shape[0], 2, 8, torch.int32, torch.bfloat16, state.device,
                                           ((4, 10, 70),))[0]
        keep = torch.tensor([True, False, True, True])
        live = [0, 2, 3]
        lengths = [batch.cu_seqlens[i + 1] - batch.cu_seqlens[i] for i in live]
        tokens = torch.cat([torch.arange(batch.cu_seqlens[i], batch.cu_seqlens[i + 1]) for i in live])
        cu = tuple(int(x) for x in torch.tensor([0, *lengths]).cumsum(0))
        metadata = modules["kimi_ascend_layer"].PrefillChunkMetadata(cu, None, keep)
        clears = kimi_kda_ops.CLEAR_CALLS["count"]
        out = layer._run_prefill(*(t[:, tokens] for t in (batch.q, batch.k, batch.v, batch.raw_gate, batch.beta)),
                                 state, batch.state_indices, batch.has_initial_state, metadata)
        raw = world.runner.raw_caches[layer.prefix]
        cleared = kimi_kda_ops.CLEAR_CALLS["count"] - clears
        return kimi_workload.digest(out), kimi_workload.raw_bits(raw).clone(), cleared

    base_out, base_cache, _ = run(False)
    out, cache, clears = run(True)
    assert out == base_out
    assert torch.equal(cache, base_cache)
    assert clears == (1 if routing == "alias" else 0)


def run_pad_batch(load_reference, patched: bool, rows: list[int], flags: list[bool]
                  ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Run one 3-sequence batch on given rows/flags; return (per-sequence outputs, cache before, cache after)."""
    modules = load_reference(patched=patched)
    world = kimi_workload.build_world(modules)
    kimi_workload.start_world(world)
    layer = next(iter(world.layers.values()))
    state = layer.kv_cache[1]
    before = state.clone()
    batch = kimi_workload.make_batches(5, state.shape[0], 2, 8, torch.int64, torch.bfloat16, state.device,
                                       ((3, 40, 90),))[0]
    batch.state_indices = torch.tensor(rows)
    batch.has_initial_state = torch.tensor(flags)
    out = kimi_workload.run_batch(world, layer, batch)
    pieces = [out[:, batch.cu_seqlens[i]:batch.cu_seqlens[i + 1]] for i in range(3)]
    return pieces, before, state.clone()


def test_pad_slot_index_reads_zeros_and_skips_the_write(load_reference):
    """The documented difference: a pad slot id (-1) wraps to the last row under torch indexing; the plan does not.

    Baseline: ``cache[-1]`` gathers row N-1 as the padded sequence's initial state and the scatter overwrites
    row N-1 with its final state (corrupting whatever request owns that row). Patched: the padded sequence
    starts from zeros and its final state is dropped; row N-1 keeps its bytes. Valid rows are unaffected.
    """
    last = 79
    base_out, base_before, base_after = run_pad_batch(load_reference, False, [5, -1, 9], [True, True, False])
    out, before, after = run_pad_batch(load_reference, True, [5, -1, 9], [True, True, False])
    assert torch.equal(base_before, before)
    assert not torch.equal(base_after[last], base_before[last])  # baseline: row N-1 overwritten
    assert torch.equal(after[last], before[last])  # patched: row N-1 untouched
    unaffected = [row for row in range(last) if row not in (5, 9)]
    assert torch.equal(after[unaffected], before[unaffected])
    assert torch.equal(after[[5, 9]], base_after[[5, 9]])
    assert torch.equal(out[0], base_out[0]) and torch.equal(out[2], base_out[2])
    assert not torch.equal(out[1], base_out[1])  # baseline started the pad sequence from row N-1's state
    # Patched, the pad sequence started from zeros: like a baseline run where it has no initial state.
    zero_start, _, _ = run_pad_batch(load_reference, False, [5, 60, 9], [True, False, False])
    assert torch.equal(zero_start[1], out[1])


def test_fresh_process_ab_of_the_reference_workload(tmp_path):
    """``KDA_PATCHES=0`` vs ``=1`` (+STRICT) in fresh interpreters: equal outputs and caches; routed == seen."""
    from kda_patches.regress.ledgers import total_counters
    from kda_patches.regress.runner import run_ab
    from kda_patches.regress.workloads import Workload

    workload = Workload(name="kimi-reference", target="kimi_workload:run_reference_workload",
                        expect=("kimi_prefill:calls_routed",), timeout_s=600)
    params = {"cache_dtype": "bfloat16", "index_dtype": "int64", "shapes": "small"}
    report = run_ab(workload, params, pythonpath=(HERE,), work_dir=str(tmp_path))
    assert not report.errors, (report.errors, report.patched.log_tail or report.baseline.log_tail)
    assert report.comparison is not None and report.comparison.equal
    assert all(met for met, _ in report.expectations), report.expectations
    totals = total_counters(report.patched.ledgers).get("kimi_prefill", {})
    assert totals.get("calls_seen", 0) == totals.get("calls_routed", -1) > 0
    assert totals.get("calls_bypassed", 0) == 0
    assert "kimi_prefill" not in total_counters(report.baseline.ledgers)
