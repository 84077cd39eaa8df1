"""The final-state cast folded into the routed scatter (``Seam.final``), on dummy seams with real plans.

``ssm_state[idx] = last.to(ssm_state.dtype)`` with ``last`` straight from the declared chunk callable must
become one plan scatter that reads the FP32 final state and writes the cache dtype (``casts_folded``), with
the bits torch's ``.to()`` gives -- NaN payloads, infinities, -0.0, subnormals and rounding ties included
(:func:`routing_dummies.special_finals`). Baseline = the dummies with no record; patched = the same module
imported afresh under a record that uses the real ``gdn_state_copy`` seam declarations (Qwen: the layer
attribute ``chunk_gated_delta_rule``; Olmo: the module-level name, wrapped by ``wrap_final``).
"""

from __future__ import annotations

import pytest
import torch
from test_routing_core import call, counters

from kda_patches.patches import gdn_state_copy
from kda_patches.registry import Patch, Target
from kda_patches.routing.alias import CallRoute, FinalStates, PendingCast, make_alias, tag_final
from kda_patches.routing.wrappers import SeamWrapper, wrap_final

GDN = gdn_state_copy.LEDGER_PATH
SEAMS = {"AttributeChunkLayer": gdn_state_copy.QWEN_SEAM, "FunctionChunkLayer": gdn_state_copy.OLMO_SEAM,
         "CastReuseLayer": gdn_state_copy.QWEN_SEAM, "ModuleChunkLayer": gdn_state_copy.QWEN_SEAM}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def record(name: str, cls: str) -> Patch:
    """The dummy class's seam under its real declaration, the module-level chunk name, the runner's startup."""
    return Patch(name, "folded-cast test record", (
        Target("routing_dummies", f"{cls}._forward_core", SeamWrapper(SEAMS[cls])),
        Target("routing_dummies", "chunk_gated_delta_rule", wrap_final),
        Target("routing_dummies", "Runner.initialize_kv_cache", gdn_state_copy.wrap_initialize_kv_cache)))


def run_world(module, cls: str, dtype: torch.dtype, index_dtype: torch.dtype, calls: int = 3):
    """One layer of ``cls`` with a ``dtype`` cache: (output bits per call, raw cache bits, layer)."""
    from test_routing_core import batch

    layer = getattr(module, cls)("model.layers.0.attn")
    runner = module.Runner({layer.prefix: layer}, max_num_seqs=8, dtype=dtype)
    runner.initialize_kv_cache(None)
    outputs = [call(module, layer, *batch(24, 5, index_dtype, seed)).view(torch.int32).clone() for seed in range(calls)]
    return outputs, runner.raw[layer.prefix].view(BITS[dtype]).clone(), layer


def run_ab(load_dummies, cls: str, dtype: torch.dtype, index_dtype: torch.dtype):
    """Baseline world, then the patched one: (baseline, patched, the ``gdn_state_copy`` counter deltas)."""
    baseline = run_world(load_dummies(), cls, dtype, index_dtype)
    module = load_dummies(record(f"fold_{cls}", cls))
    before = counters(GDN)
    patched = run_world(module, cls, dtype, index_dtype)
    after = counters(GDN)
    return baseline, patched, {key: after.get(key, 0) - before.get(key, 0) for key in after}


@pytest.mark.parametrize("cls", ["AttributeChunkLayer", "FunctionChunkLayer", "ModuleChunkLayer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_the_cast_is_folded_and_bit_exact(load_dummies, strict, cls, dtype, index_dtype):
    baseline, patched, delta = run_ab(load_dummies, cls, dtype, index_dtype)
    assert all(torch.equal(a, b) for a, b in zip(baseline[0], patched[0], strict=True))
    assert torch.equal(baseline[1], patched[1])  # every cache byte, gaps and edge-value rows included
    assert delta.get("calls_routed") == delta.get("casts_folded") == 3, delta
    assert not delta.get("casts_materialized") and not delta.get("calls_bypassed"), delta


def test_an_fp32_cache_has_nothing_to_fold(load_dummies, strict):
    baseline, patched, delta = run_ab(load_dummies, "AttributeChunkLayer", torch.float32, torch.int32)
    assert torch.equal(baseline[1], patched[1])
    assert delta.get("calls_routed") == 3 and not delta.get("casts_folded"), delta


@pytest.mark.alias_mechanism
def test_a_cast_used_before_the_scatter_is_computed_by_torch(load_dummies, strict):
    baseline, patched, delta = run_ab(load_dummies, "CastReuseLayer", torch.bfloat16, torch.int64)
    assert torch.equal(baseline[1], patched[1])
    assert len(patched[2].cast_copies) == 3 and all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(baseline[2].cast_copies, patched[2].cast_copies, strict=True))
    assert delta.get("casts_materialized") == 3 and delta.get("calls_routed") == 3, delta
    assert not delta.get("casts_folded"), delta


def test_the_layer_attribute_is_shadowed_only_during_the_call(load_dummies, strict):
    module = load_dummies(record("fold_shadow", "AttributeChunkLayer"))
    _, _, layer = run_world(module, "AttributeChunkLayer", torch.bfloat16, torch.int32, calls=1)
    assert layer.__dict__["chunk_gated_delta_rule"] is module.special_finals
    del layer.__dict__["chunk_gated_delta_rule"]  # the class-level lookup path: nothing may be left behind
    type(layer).chunk_gated_delta_rule = staticmethod(module.special_finals)
    try:
        call(module, layer, torch.tensor([3, 7]), torch.tensor([True, False]))
        assert "chunk_gated_delta_rule" not in layer.__dict__
    finally:
        del type(layer).chunk_gated_delta_rule


def test_an_nn_module_layer_keeps_its_submodule_and_cache_attribute(load_dummies, strict):
    module = load_dummies(record("fold_module", "ModuleChunkLayer"))
    _, _, layer = run_world(module, "ModuleChunkLayer", torch.bfloat16, torch.int64, calls=2)
    assert "chunk_gated_delta_rule" not in layer.__dict__  # the shadow is gone ...
    assert isinstance(layer._modules["chunk_gated_delta_rule"], module.ChunkModule)  # ... the submodule is not
    assert type(layer.kv_cache) is tuple and type(layer.kv_cache[1]) is torch.Tensor  # the plain cache is back
    assert "kv_cache" in layer.__dict__ and "kv_cache" not in layer._buffers


def test_the_module_level_chunk_is_plain_outside_a_routed_call(load_dummies, strict):
    module = load_dummies(record("fold_plain", "FunctionChunkLayer"))
    _, final = module.chunk_gated_delta_rule(torch.randn(2, 2, 4, 4))
    assert type(final) is torch.Tensor


class Plan:
    """A plan stand-in that records scatter sources (the routed scatter hands it the uncast final)."""

    def __init__(self, final_dtypes: tuple[torch.dtype, ...]) -> None:
        self.final_dtypes = final_dtypes
        self.sources: list[torch.Tensor] = []

    def scatter(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
        self.sources.append(packed)
        torch.Tensor.__setitem__(state, indices, packed.to(state.dtype))


def routed_final(final_dtypes: tuple[torch.dtype, ...], final: torch.Tensor, cache_dtype: torch.dtype = torch.bfloat16):
    cache = torch.randn(6, 2, 4, 4).to(cache_dtype)
    route = CallRoute(gdn_state_copy.QWEN_SEAM, "model.layers.0.attn", Plan(final_dtypes), cache)
    alias = make_alias(route)
    return alias, route, tag_final((None, final), 1, route)[1]


def test_a_final_dtype_the_plan_did_not_prepare_is_cast_by_torch():
    alias, route, final = routed_final((torch.bfloat16,), torch.randn(2, 2, 4, 4))
    cast = final.to(alias.dtype)
    assert type(cast) is not PendingCast and cast.dtype is torch.bfloat16
    alias[torch.tensor([0, 5])] = cast
    assert route.casts_folded == 0 and route.scatters == 1


def test_metadata_reads_leave_a_pending_cast_uncomputed():
    source = torch.randn(2, 2, 4, 4)
    alias, route, final = routed_final((torch.bfloat16, torch.float32), source)
    assert type(final) is FinalStates
    pending = final.to(alias.dtype)
    assert type(pending) is PendingCast
    assert (pending.dtype, tuple(pending.shape), pending.device, pending.dim()) == (
        torch.bfloat16, (2, 2, 4, 4), source.device, 4)
    assert "_kda_source" in pending.__dict__
    alias[torch.tensor([0, 5], dtype=torch.int32)] = pending
    assert route.casts_folded == 1 and route.plan.sources[0] is final
    written = alias.as_subclass(torch.Tensor)[5].view(torch.int16)
    assert torch.equal(written, source[1].to(torch.bfloat16).view(torch.int16))


def test_a_pending_cast_after_the_call_is_computed_on_use():
    source = torch.randn(2, 2, 4, 4)
    alias, route, final = routed_final((torch.float32,), source)
    pending = final.to(alias.dtype)
    route.close()
    assert torch.equal((pending * 1).view(torch.int16), source.to(torch.bfloat16).view(torch.int16))
    assert type(final.to(torch.bfloat16)) is torch.Tensor  # closed route: a plain cast
