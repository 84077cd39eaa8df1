"""Plan lifecycle: prepare -> seal -> serve, and every fail-closed refusal before launch."""

from __future__ import annotations

import pytest
import torch
from state_copy_helpers import bits

from kda_patches.ledger import get_ledger
from kda_patches.state_copy import kernels, naive, variants
from kda_patches.state_copy import plan as plan_module
from kda_patches.state_copy.errors import LayoutError, StateCopyRefused
from kda_patches.state_copy.plan import FallbackStatePlan, FusedStatePlan

KINDS = [FusedStatePlan, FallbackStatePlan]


def refused_count(reason):
    return get_ledger().counters("state_copy").get(f"refused:{reason}", 0)


@pytest.fixture(params=KINDS, ids=lambda cls: cls.kind)
def plan_class(request):
    return request.param


@pytest.fixture
def cache(make_cache):
    return make_cache(dtype=torch.float32, num_rows=6)


def test_unsealed_plan_refuses_and_records(cache, device, plan_class):
    plan = plan_class.prepare(cache.state, 4)
    before = refused_count("unsealed")
    with pytest.raises(StateCopyRefused, match="seal") as info:
        plan.gather(cache.state, torch.tensor([0], device=device))
    assert info.value.reason == "unsealed" and isinstance(info.value, RuntimeError)
    with pytest.raises(StateCopyRefused, match="seal"):
        plan.scatter(cache.state, torch.zeros((1, 2, 3, 8), device=device), torch.tensor([0], device=device))
    assert refused_count("unsealed") == before + 2
    assert get_ledger().snapshot()["facts"]["state_copy"]["last_refusal"]["reason"] == "unsealed"


def test_signature_change_refused(cache, make_cache, device, plan_class):
    plan = plan_class.prepare(cache.state, 4).seal()
    indices = torch.tensor([0], device=device)
    # [6, 1, 6, 8] over the same pages with the same strides (a size-1 dimension's stride is free): only the
    # inner shape differs
    other_inner = cache.backing.as_strided((6, 1, 6, 8), cache.state.stride(), cache.state.storage_offset())
    other_gap = make_cache(gap=13).state  # other row stride, same 16-byte alignment class: only the stride differs
    assert other_gap.data_ptr() % 16 == cache.state.data_ptr() % 16 and other_gap.stride() != cache.state.stride()
    other_dtype = make_cache(dtype=torch.bfloat16).state
    misaligned = cache.backing.as_strided(cache.state.shape, cache.state.stride(), cache.state.storage_offset() + 1)
    for state, changed in ((other_inner, "inner shape"), (other_gap, "strides"), (other_dtype, "dtype"),
                           (misaligned, "data_ptr % 16")):
        with pytest.raises(StateCopyRefused, match="signature changed") as info:
            plan.gather(state, indices)
        assert info.value.reason == "signature" and f"({changed} " in str(info.value)
        with pytest.raises(StateCopyRefused, match=r"only the row count may change") as info:
            plan.check_cache(state, "model.layers.3.attn")
        assert info.value.reason == "signature" and "model.layers.3.attn" in str(info.value)
        assert f"({changed} " in str(info.value) and "restart the worker" in str(info.value)
    same_layout = make_cache(seed=3)  # same shape, strides, offset -> same alignment class: accepted
    out = plan.gather(same_layout.state, indices)
    assert torch.equal(out, naive.gather_states(same_layout.state, indices))


def test_other_row_count_is_accepted_and_bounds_the_indices(cache, device, plan_class):
    plan = plan_class.prepare(cache.state, 4).seal()
    fewer = cache.state[:4]  # the same pages, strides and pointer; rows 4 and 5 are beyond its shape[0]
    plan.check_cache(fewer)  # re-validated without compiling: only the row count differs
    indices = torch.tensor([4, 3, 5, 0], device=device)
    flags = torch.ones(4, dtype=torch.bool, device=device)
    out = plan.gather(fewer, indices, flags)
    assert torch.equal(bits(out), bits(naive.gather_states(fewer, indices, flags)))
    assert not bits(out[0]).any() and not bits(out[2]).any()  # rows 4 and 5 exist in the pages, not in the view
    before = cache.backing.clone()
    finals = torch.randn((4, *cache.state.shape[1:]), device=device)
    plan.scatter(fewer, finals, indices)
    expected = before.clone()
    naive.scatter_states(expected.as_strided(fewer.shape, fewer.stride(), fewer.storage_offset()), finals, indices)
    assert torch.equal(bits(cache.backing), bits(expected))  # rows 4 and 5 of the pages, gaps and tail untouched
    assert not torch.equal(bits(cache.backing), bits(before))  # rows 3 and 0 were written


def test_selected_count_limit(cache, device, plan_class):
    plan = plan_class.prepare(cache.state, 3).seal()
    plan.gather(cache.state, torch.arange(3, device=device))
    with pytest.raises(StateCopyRefused, match="max_selected=3") as info:
        plan.gather(cache.state, torch.arange(4, device=device))
    assert info.value.reason == "too_many_rows"
    with pytest.raises(StateCopyRefused, match="max_selected"):
        plan.scatter(cache.state, torch.zeros((4, 2, 3, 8), device=device), torch.arange(4, device=device))


def test_bad_index_flag_and_packed_metadata(cache, device, plan_class):
    plan = plan_class.prepare(cache.state, 4).seal()
    state = cache.state
    bad_indices = [torch.tensor([0.0], device=device), torch.zeros((1, 1), dtype=torch.int32, device=device),
                   torch.tensor([0], dtype=torch.int16, device=device), [0],
                   torch.tensor([0], device="meta")]
    for indices in bad_indices:
        with pytest.raises(LayoutError) as info:
            plan.gather(state, indices)
        assert info.value.reason == "indices"
    indices = torch.tensor([0, 1], device=device)
    for flags in (torch.tensor([True], device=device), torch.tensor([1, 0], device=device),
                  torch.tensor([True, False], device="meta")):
        with pytest.raises(LayoutError) as info:
            plan.gather(state, indices, flags)
        assert info.value.reason == "flags"
    for packed in (torch.zeros((3, 2, 3, 8), device=device), torch.zeros((2, 2, 3, 7), device=device),
                   torch.zeros((2, 2, 3, 8), device="meta"), torch.zeros((2, 2, 3, 8), dtype=torch.int32,
                                                                           device=device)):
        with pytest.raises(LayoutError) as info:
            plan.scatter(state, packed, indices)
        assert info.value.reason == "packed"


def test_pre_run_hook_refused_at_seal_and_at_launch(cache, device, plan_class, monkeypatch):
    kernel = plan_class.kernel
    monkeypatch.setattr(kernel, "pre_run_hooks", [])
    plan = plan_class.prepare(cache.state, 4)
    kernel.pre_run_hooks.append(lambda *args, **kwargs: None)
    with pytest.raises(StateCopyRefused, match="pre-run hook") as info:
        plan.seal()
    assert info.value.reason == "jit_hook"
    kernel.pre_run_hooks.clear()
    plan.seal()
    indices = torch.tensor([1], device=device)
    plan.gather(cache.state, indices)
    kernel.pre_run_hooks.append(lambda *args, **kwargs: None)
    with pytest.raises(StateCopyRefused, match="pre-run hook"):
        plan.gather(cache.state, indices)
    with pytest.raises(StateCopyRefused, match="pre-run hook"):
        plan_class.prepare(cache.state, 4)


def test_configuration_drift_between_prepare_and_seal(cache, device, plan_class, monkeypatch):
    plan = plan_class.prepare(cache.state, 4)
    monkeypatch.setenv("TRITON_KDA_TEST_DRIFT", "1")
    with pytest.raises(StateCopyRefused, match="TRITON_KDA_TEST_DRIFT") as info:
        plan.seal()
    assert info.value.reason == "config_drift"
    monkeypatch.delenv("TRITON_KDA_TEST_DRIFT")
    plan.seal()
    # After seal the configuration is never read again: serving must not scan the environment.

    def no_scan(*args, **kwargs):
        raise AssertionError("configuration scanned per call")

    monkeypatch.setattr(variants, "snapshot_configuration", no_scan)
    monkeypatch.setattr(plan_module, "snapshot_configuration", no_scan)
    monkeypatch.setenv("TRITON_KDA_TEST_DRIFT", "2")
    indices = torch.tensor([2, 0], dtype=torch.int32, device=device)
    out = plan.gather(cache.state, indices)
    plan.scatter(cache.state, out, indices)


def test_four_variants_reused_for_every_count(cache, make_cache, device, plan_class, no_compiler):
    plan = plan_class.prepare(cache.state, 5).seal()
    half = make_cache(dtype=torch.bfloat16, num_rows=6)
    two_finals = plan_class.prepare(half.state, 5).seal()  # default finals: (bfloat16, float32)
    no_compiler.arm()  # sees the compiled JIT and the interpreter's entry alike
    assert len(plan.variant_names()) == 4 and len(two_finals.variant_names()) == 2 + 2 * 2
    tables = [(plan, cache, dict(plan._variants)), (two_finals, half, dict(two_finals._variants))]
    for count in range(0, 6):
        for index_dtype in (torch.int32, torch.int64):
            indices = torch.arange(count, dtype=index_dtype, device=device)
            out = plan.gather(cache.state, indices)
            plan.scatter(cache.state, out, indices)
            initial = two_finals.gather(half.state, indices)
            two_finals.scatter(half.state, initial, indices)
            two_finals.scatter(half.state, initial.float() / 3, indices)
    for current, _, table in tables:
        assert current._variants == table and all(current._variants[key] is table[key] for key in table)
    assert no_compiler.entries == []  # zero compiler entries after seal


def test_aligned_int32_indices_are_not_converted(cache, device, plan_class, monkeypatch):
    plan = plan_class.prepare(cache.state, 8).seal()
    seen = []
    variant_type = type(next(iter(plan._variants.values())))
    original = variant_type.launch

    def spy(self, grid, state, packed, indices, flags, rows):
        seen.append(indices)
        return original(self, grid, state, packed, indices, flags, rows)

    monkeypatch.setattr(variant_type, "launch", spy)
    indices = torch.tensor([3, 1, 4], dtype=torch.int32, device=device)
    assert indices.data_ptr() % 16 == 0
    out = plan.gather(cache.state, indices)
    plan.scatter(cache.state, out, indices)
    assert seen[0] is indices and seen[1] is indices
    strided = torch.tensor([3, 0, 1, 0], dtype=torch.int32, device=device)[::2]
    plan.gather(cache.state, strided)
    assert seen[2] is not strided and seen[2].dtype == torch.int32 and seen[2].is_contiguous()


def test_unbound_plan_refuses_tracing(cache, device):
    plan = FusedStatePlan.prepare(cache.state, 4).seal()

    def gather(state, indices):
        return plan.gather(state, indices)

    compiled = torch.compile(gather, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="unbound plan"):
        compiled(cache.state, torch.tensor([0], device=device))


def test_unbound_plan_refuses_tracing_at_a_graph_break_with_its_own_error(cache, device):
    plan = FusedStatePlan.prepare(cache.state, 4).seal()
    torch._dynamo.reset()

    def scatter(state, packed, indices):
        plan.scatter(state, packed, indices)

    compiled = torch.compile(scatter, backend="eager")  # no fullgraph: the refusal runs eagerly at the break
    before, refusals = cache.clone(), refused_count("compile")
    with pytest.raises(StateCopyRefused, match="unbound plan cannot be traced") as refused:
        compiled(cache.state, torch.randn((1, *cache.state.shape[1:]), device=device),
                 torch.tensor([0], device=device))
    assert refused.value.reason == "compile" and "state_scatter" in str(refused.value)
    assert refused_count("compile") == refusals + 1  # recorded like every refusal
    assert torch.equal(bits(cache.backing), bits(before.backing))  # nothing was copied


def test_scatter_packed_alignment_and_layout_normalised(cache, device, plan_class):
    plan = plan_class.prepare(cache.state, 4).seal()
    ref = cache.clone()
    source = torch.randn((3, 2, 8, 3), device=device).transpose(2, 3)  # non-contiguous packed
    indices = torch.tensor([0, 2, 4], device=device)
    plan.scatter(cache.state, source, indices)
    naive.scatter_states(ref.state, source, indices)
    assert torch.equal(bits(cache.backing), bits(ref.backing))
    flat = torch.randn(1 + 2 * 2 * 3 * 8, device=device)
    unaligned = flat[1:].view(2, 2, 3, 8)
    plan.scatter(cache.state, unaligned, indices[:2])
    naive.scatter_states(ref.state, unaligned, indices[:2])
    assert torch.equal(bits(cache.backing), bits(ref.backing))


@pytest.mark.parametrize("kind", ["fused", "fallback"])
def test_scatter_store_hint_is_decided_per_device_at_prepare(make_cache, device, kind):
    from kda_patches.state_copy.plan import PLAN_CLASSES

    cache = make_cache(dtype=torch.bfloat16, num_rows=6, inner=(2, 8, 32), gap=8, offset=2)
    described = PLAN_CLASSES[kind].prepare(cache.state, 4).seal().describe()
    # only the fused kernel has the option, and only CUDA gets it (other backends keep their store policy)
    assert described["scatter_evict_first"] is (kind == "fused" and device.type == "cuda")
    assert described["stream"] is False  # the gather's cache reads stay the default policy
    scatter_constexprs = [value for name, value in described["constexprs"].items() if "/scatter/" in name]
    gather_constexprs = [value for name, value in described["constexprs"].items() if "/gather/" in name]
    if kind == "fused":  # STREAM's place among copy_rows_kernel's constexprs (they follow the pointers and num_rows)
        stream = kernels.copy_rows_kernel.arg_names.index("STREAM") - kernels.ROWS_INDEX - 1
        assert {values[stream] for values in scatter_constexprs} == {str(device.type == "cuda")}
        assert {values[stream] for values in gather_constexprs} == {"False"}
