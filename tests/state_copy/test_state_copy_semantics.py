"""Seed 000's numeric contract, for both plans, bit-exact against the naive twins."""

from __future__ import annotations

import pytest
import torch
from state_copy_helpers import bits

from kda_patches.state_copy import naive
from kda_patches.state_copy.errors import LayoutError, StateCopyError
from kda_patches.state_copy.plan import PLAN_CLASSES, initialize

PLAN_DTYPES = [("fused", torch.float32), ("fused", torch.bfloat16), ("fallback", torch.float32),
               ("fallback", torch.bfloat16), ("fallback", torch.float16)]
INDEX_DTYPES = [torch.int32, torch.int64]


def sealed_plan(kind, cache, max_selected=8):
    return PLAN_CLASSES[kind].prepare(cache.state, max_selected).seal()


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize(("kind", "dtype"), PLAN_DTYPES)
def test_gather_gaps_offsets_invalid_flags_duplicates(make_cache, device, kind, dtype, index_dtype):
    cache = make_cache(dtype=dtype, num_rows=6, gap=5, offset=3)
    plan = sealed_plan(kind, cache)
    indices = torch.tensor([4, -1, 6, 0, 4, 99, 2], dtype=index_dtype, device=device)
    flags = torch.tensor([True, True, True, False, True, True, True], device=device)
    out = plan.gather(cache.state, indices, flags)
    ref = naive.gather_states(cache.state, indices, flags)
    assert out.dtype == dtype and out.shape == (7, 2, 3, 8) and out.is_contiguous()
    assert torch.equal(bits(out), bits(ref))
    assert torch.equal(out[0], out[4]) and not out[1].any() and not out[3].any() and not out[5].any()
    assert cache.gaps_untouched()
    no_flags = plan.gather(cache.state, indices)
    assert torch.equal(bits(no_flags), bits(naive.gather_states(cache.state, indices)))


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize(("kind", "dtype"), PLAN_DTYPES)
def test_scatter_skips_invalid_casts_and_keeps_gaps(make_cache, device, kind, dtype, index_dtype):
    cache = make_cache(dtype=dtype, num_rows=6, gap=5, offset=3)
    ref = cache.clone()
    plan = sealed_plan(kind, cache)
    indices = torch.tensor([5, -2, 1, 6, 3], dtype=index_dtype, device=device)
    packed = torch.randn((5, 2, 3, 8), device=device)  # float32 final states: cast to the cache dtype
    plan.scatter(cache.state, packed, indices)
    naive.scatter_states(ref.state, packed, indices)
    assert torch.equal(bits(cache.backing), bits(ref.backing))
    assert cache.gaps_untouched()
    assert torch.equal(cache.state[5], packed[0].to(dtype))


@pytest.mark.parametrize(("kind", "dtype"), PLAN_DTYPES)
def test_empty_selection_launches_nothing(make_cache, device, kind, dtype, monkeypatch):
    cache = make_cache(dtype=dtype)
    before = cache.backing.clone()
    plan = sealed_plan(kind, cache)
    monkeypatch.setattr(type(next(iter(plan._variants.values()))), "launch", _no_launch)
    empty = torch.empty(0, dtype=torch.int32, device=device)
    out = plan.gather(cache.state, empty, torch.empty(0, dtype=torch.bool, device=device))
    assert out.shape == (0, 2, 3, 8) and out.dtype == dtype
    plan.scatter(cache.state, torch.empty((0, 2, 3, 8), device=device), empty.long())
    assert torch.equal(bits(cache.backing), bits(before))
    with pytest.raises(LayoutError):  # metadata is still validated
        plan.gather(cache.state, torch.empty(0, dtype=torch.float32, device=device))


def _no_launch(*args, **kwargs):
    raise AssertionError("a zero-row call must launch nothing")


@pytest.mark.parametrize(("kind", "dtype"), [("fused", torch.float32), ("fallback", torch.bfloat16)])
def test_strided_and_unaligned_index_vectors(make_cache, device, kind, dtype):
    cache = make_cache(dtype=dtype)
    plan = sealed_plan(kind, cache)
    base = torch.tensor([3, 9, 0, 9, 5, 9, -1, 9, 2], dtype=torch.int32, device=device)
    strided = base[::2]  # stride 2
    unaligned = base[1:]  # data_ptr % 16 == 4
    for indices in (strided, unaligned, strided.long()):
        out = plan.gather(cache.state, indices)
        assert torch.equal(bits(out), bits(naive.gather_states(cache.state, indices)))
    ref = cache.clone()
    packed = torch.randn((5, 2, 3, 8), device=device).to(dtype)
    plan.scatter(cache.state, packed, strided)
    naive.scatter_states(ref.state, packed, strided)
    assert torch.equal(bits(cache.backing), bits(ref.backing))


@pytest.mark.parametrize(("kind", "dtype"), PLAN_DTYPES)
def test_nan_inf_negative_zero_bit_exact(make_cache, device, kind, dtype):
    cache = make_cache(dtype=dtype, num_rows=4)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    payload_nan = torch.tensor([0x7FC00123 if dtype == torch.float32 else 0x7FC3], dtype=bits(specials).dtype)
    row = torch.zeros(2 * 3 * 8, dtype=dtype)
    row[:4] = specials
    row.view(bits(row).dtype)[4] = payload_nan  # a NaN with a payload survives unchanged
    row = row.view(2, 3, 8).to(device)
    cache.state[1].copy_(row)
    plan = sealed_plan(kind, cache)
    indices = torch.tensor([1, 1], dtype=torch.int32, device=device)
    out = plan.gather(cache.state, indices)
    assert torch.equal(bits(out[0]), bits(row)) and torch.equal(bits(out[1]), bits(row))
    plan.scatter(cache.state, out[:1].clone(), torch.tensor([3], device=device))
    assert torch.equal(bits(cache.state[3]), bits(row))
    assert cache.gaps_untouched()


@pytest.mark.parametrize("kind", ["fused", "fallback"])
def test_inner_stride_and_overlap_rejected(device, kind):
    transposed = torch.zeros((4, 2, 8, 3), device=device).transpose(2, 3)  # [4, 2, 3, 8], inner not dense
    with pytest.raises(LayoutError, match="dense"):
        PLAN_CLASSES[kind].prepare(transposed, 4)
    overlapping = torch.zeros(100, device=device).as_strided((4, 2, 3, 8), (10, 24, 8, 1))
    with pytest.raises(LayoutError, match="overlap"):
        PLAN_CLASSES[kind].prepare(overlapping, 4)
    with pytest.raises(RuntimeError, match=r"layer 'x\.kda'.*inner_stride"):
        initialize({"x.kda": transposed}, 4)


def test_initialize_routes_fp16_to_fallback_and_matches_naive(make_cache, device):
    cache = make_cache(dtype=torch.float16)
    bindings = initialize({"layer": cache.state}, 8)
    assert bindings["layer"].kind == "fallback"
    indices = torch.tensor([2, 7, 0], device=device)
    flags = torch.tensor([True, True, False], device=device)
    out = bindings["layer"].gather(cache.state, indices, flags)
    assert torch.equal(bits(out), bits(naive.gather_states(cache.state, indices, flags)))


def test_size_one_dimensions_and_single_row_cache(device):
    state = torch.randn((1, 1, 4, 1), device=device)
    plan = PLAN_CLASSES["fused"].prepare(state, 2).seal()
    out = plan.gather(state, torch.tensor([0, 1], device=device))
    assert torch.equal(out, naive.gather_states(state, torch.tensor([0, 1], device=device)))
    with pytest.raises(StateCopyError):
        PLAN_CLASSES["fused"].prepare(torch.zeros((0, 2, 2, 2), device=device), 2)
