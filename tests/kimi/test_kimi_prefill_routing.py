"""Per-call routing of the kimi_prefill patch: applied through hooks, routed / bypassed / refused, ledger."""

from __future__ import annotations

import importlib
import inspect

import kimi_workload
import pytest
import torch
import vllm_stack

from kda_patches.ledger import get_ledger
from kda_patches.patches import kimi_prefill
from kda_patches.registry import Patch, find_version, is_applied, register_patch, revert_patch, version_in_range
from kda_patches.routing.proof import PlanNotPublished, StateCopyBypassed


def grew(before: dict[str, int], key: str) -> int:
    return kimi_workload.prefill_counters().get(key, 0) - before.get(key, 0)


def started_world(modules, **options) -> tuple[kimi_workload.World, object]:
    world = kimi_workload.build_world(modules, **options)
    kimi_workload.start_world(world)
    return world, next(iter(world.layers.values()))


def one_batch(layer, shapes=((3, 20, 70),), index_dtype=torch.int32, seed=11) -> kimi_workload.Batch:
    state = layer.kv_cache[1]
    return kimi_workload.make_batches(seed, state.shape[0], layer.num_heads, layer.head_dim, index_dtype,
                                      torch.bfloat16, state.device, shapes)[0]


def test_every_target_is_applied_by_the_post_import_hooks(load_reference):
    """Registering before import: each seam, copy function and runner hook is wrapped when its module loads."""
    modules = load_reference(patched=True)
    patch = kimi_workload.reference_patch("kimi_prefill_reference")
    states = get_ledger().snapshot()["patches"]["kimi_prefill_reference"]["targets"]
    assert {key: entry["state"] for key, entry in states.items()} == {t.key: "applied" for t in patch.targets}
    ascend = modules["kimi_ascend_layer"]
    assert vars(ascend.AscendKimiK3DeltaAttention)["_run_prefill"]._self_wrapper is kimi_prefill.wrap_run_prefill
    assert ascend.clear_ssm_states._self_wrapper is kimi_prefill.wrap_clear_ssm_states
    assert modules["kimi_upstream_layer"].gather_initial_states._self_wrapper is kimi_prefill.wrap_gather_initial_states


def test_real_vllm_targets_match_the_installed_signatures():
    """The upstream targets of the real record apply to the installed vLLM 0.32 (fingerprints, versions)."""
    vllm_stack.import_vllm("vllm")
    check = Patch("kimi_prefill_vllm_check", "fingerprint check",
                  tuple(target for target in kimi_prefill.PATCH.targets if target.stack == "vllm"))
    assert {target.module for target in check.targets} == {
        "vllm.models.kimi_k3.nvidia.kda", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
        "vllm.v1.worker.extensible_kv_cache",  # ships from vLLM 0.34 (its era only)
        "vllm.third_party.flash_linear_attention.ops.chunk_delta_h"}  # the no-copy host (0.32+, KDA_PATCHES_STATE_IO)
    register_patch(check, strict=True)  # a drifted signature or version would raise PatchSkipped here
    try:
        for module in {target.module for target in check.targets if version_in_range(target, find_version(target))}:
            importlib.import_module(module)
        in_range = [target for target in check.targets if version_in_range(target, find_version(target))]
        chosen = [target for target in in_range if target.chosen_by is not None]
        assert len(in_range) == 5 and [target.qualname for target in chosen] == ["chunk_gated_delta_rule_fwd_h"]
        assert all(is_applied(check, target) for target in in_range if target not in chosen)
        assert not any(is_applied(check, target) for target in chosen)  # KDA_PATCHES_STATE_IO=copy: left unwrapped
    finally:
        revert_patch(check)
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

    assert tuple(inspect.signature(KimiK3DeltaAttention._forward).parameters) == kimi_prefill.FORWARD_PARAMETERS


def test_a_layer_without_a_published_plan_refuses_prefill(load_reference):
    """Unpublished plan: prefill is refused with the layer's name, nothing is copied, the refusal is counted."""
    modules = load_reference(patched=True)
    runner_module = modules["kimi_runner"]
    layer = modules["kimi_ascend_layer"].AscendKimiK3DeltaAttention("model.layers.7.self_attn", 2, 8)
    raw, state = runner_module.allocate_state_cache(runner_module.StateCacheSpec(16), 2, 8, torch.device("cpu"))
    layer.bind_kv_cache((torch.zeros(1), state))  # bound by hand: no runner, so no plan
    before, snapshot = kimi_workload.prefill_counters(), raw.clone()
    with pytest.raises(PlanNotPublished, match=r"model\.layers\.7\.self_attn"):
        kimi_workload.run_ascend_batch(layer, one_batch(layer, ((2, 5, 9),)), state,
                                       modules["kimi_ascend_layer"].PrefillChunkMetadata)
    assert grew(before, "calls_refused") == 1 and grew(before, "calls_routed") == 0
    assert torch.equal(raw, snapshot)


def test_a_fork_gathering_with_index_select_is_reported_bypassed(load_reference, lenient):
    """The changed fork still runs (its own copy), but the call is counted bypassed with the reason, not routed."""
    base_modules = load_reference(patched=False, variant=True)
    base_world, base_layer = started_world(base_modules, variant=True)
    batch = one_batch(base_layer)
    expected = kimi_workload.run_batch(base_world, base_layer, batch)

    modules = load_reference(patched=True, variant=True)
    world, layer = started_world(modules, variant=True)
    before = kimi_workload.prefill_counters()
    out = kimi_workload.run_batch(world, layer, batch)
    assert torch.equal(out, expected)
    assert torch.equal(layer.kv_cache[1], base_layer.kv_cache[1])
    assert grew(before, "calls_seen") == 1 and grew(before, "calls_bypassed") == 1
    assert grew(before, "calls_routed") == 0
    bypass = get_ledger().snapshot()["facts"]["kimi_prefill"]["last_bypass"]
    assert bypass["layer"] == layer.prefix and "0 gather(s) and 1 scatter(s)" in bypass["reason"]


def test_a_bypassed_call_raises_under_strict(load_reference, strict):
    modules = load_reference(patched=True, variant=True)
    world, layer = started_world(modules, variant=True)
    with pytest.raises(StateCopyBypassed, match="KDA_PATCHES_STRICT=1"):
        kimi_workload.run_batch(world, layer, one_batch(layer))


def test_a_plan_refusal_fails_the_call_before_any_copy(load_reference, strict):
    """More sequences than ``max_num_seqs``: the plan refuses before launching; the cache keeps every byte."""
    modules = load_reference(patched=True)
    world, layer = started_world(modules, max_num_seqs=4)
    raw = world.runner.raw_caches[layer.prefix]
    snapshot, before = raw.clone(), kimi_workload.prefill_counters()
    with pytest.raises(RuntimeError, match=r"max_selected|max_num_seqs"):
        kimi_workload.run_batch(world, layer, one_batch(layer, ((6, 3, 9),)))
    assert torch.equal(raw, snapshot)
    assert grew(before, "calls_failed") == 1 and grew(before, "calls_routed") == 0


def state_seen_by_the_body(modules, world, layer) -> object:
    """Run one batch; return the object the fork's body held as ``recurrent_state`` when it called the chunk."""
    seen: dict[str, object] = {}
    ascend_module = modules["kimi_ascend_layer"]
    original = ascend_module.chunk_kda_prefill

    def spy(*args, **kwargs):
        seen["state"] = inspect.currentframe().f_back.f_locals["recurrent_state"]
        return original(*args, **kwargs)

    ascend_module.chunk_kda_prefill = spy
    try:
        kimi_workload.run_batch(world, layer, one_batch(layer))
    finally:
        ascend_module.chunk_kda_prefill = original
    return seen["state"]


@pytest.mark.rewrite_mechanism
def test_the_rewritten_body_sees_the_plain_cache(routing, load_reference, strict):
    """Under the rewrite no alias exists: the fork's body indexes the layer's own cache object."""
    modules = load_reference(patched=True)
    world, layer = started_world(modules)
    before = kimi_workload.prefill_counters()
    assert state_seen_by_the_body(modules, world, layer) is layer.kv_cache[1]
    assert grew(before, "calls_routed") == 1


@pytest.mark.alias_mechanism
def test_the_routed_alias_is_scoped_to_one_call(routing, load_reference, strict):
    """Outside the call the cache object is the plain tensor again; a leaked alias indexes like a plain tensor."""
    modules = load_reference(patched=True)
    world, layer = started_world(modules)
    alias, state = state_seen_by_the_body(modules, world, layer), layer.kv_cache[1]
    assert type(alias).__name__ == "RoutedCache" and type(state) is torch.Tensor
    assert alias.data_ptr() == state.data_ptr()
    before = kimi_workload.prefill_counters()
    rows = torch.tensor([1, 2], dtype=torch.int32)
    assert torch.equal(alias[rows], state[rows])  # a closed route: plain indexing, nothing counted
    assert kimi_workload.prefill_counters() == before
    assert type(alias + 1) is torch.Tensor  # no __torch_function__ on other ops


def test_status_line_shows_counters_and_plan_kinds(load_reference, strict):
    modules = load_reference(patched=True)
    world, layer = started_world(modules, num_layers=2)
    kimi_workload.run_batch(world, layer, one_batch(layer))
    line = kimi_prefill.format_status_line(get_ledger().snapshot())
    counters = kimi_workload.prefill_counters()
    assert line.startswith(f"kimi_prefill: prefill calls seen {counters['calls_seen']}, routed "
                           f"{counters['calls_routed']}, bypassed {counters.get('calls_bypassed', 0)}")
    assert "fused=" in line or "fallback=" in line
    facts = get_ledger().snapshot()["facts"]["kimi_prefill"]
    assert {facts[name]["plan_kind"] for name in world.layers} <= {"fused", "fallback"}
