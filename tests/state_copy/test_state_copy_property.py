"""Property test: random layouts, gaps, offsets, dtypes and index sets, both plans vs the naive twins."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from state_copy_helpers import bits, build_cache

from kda_patches.state_copy import naive
from kda_patches.state_copy.plan import PLAN_CLASSES

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def draw_index_tensor(data, values, device, index_dtype):
    """Return ``values`` as an index vector: contiguous, strided (stride 2) or unaligned (offset 1)."""
    layout = data.draw(st.sampled_from(["contiguous", "strided", "unaligned"]), label="index layout")
    if layout == "contiguous" or not values:
        return torch.tensor(values, dtype=index_dtype, device=device)
    if layout == "strided":
        spread = [item for value in values for item in (value, 12345)]
        return torch.tensor(spread, dtype=index_dtype, device=device)[::2]
    return torch.tensor([7, *values], dtype=index_dtype, device=device)[1:]


def check_one_example(data, device):
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    kinds = ["fused", "fallback"] if dtype != torch.float16 else ["fallback"]
    kind = data.draw(st.sampled_from(kinds), label="kind")
    num_rows = data.draw(st.integers(1, 6), label="N")
    inner = data.draw(st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 9)), label="HVK")
    gap = data.draw(st.integers(0, 7), label="gap")
    offset = data.draw(st.integers(0, 5), label="offset")
    max_selected = data.draw(st.integers(0, 6), label="max_selected")
    index_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="index dtype")
    cache = build_cache(device, dtype=dtype, num_rows=num_rows, inner=inner, gap=gap, offset=offset,
                        seed=data.draw(st.integers(0, 2**16), label="seed"))
    plan = PLAN_CLASSES[kind].prepare(cache.state, max_selected).seal()

    values = data.draw(st.lists(st.integers(-3, num_rows + 2), max_size=max_selected), label="gather indices")
    indices = draw_index_tensor(data, values, device, index_dtype)
    flags = None
    if data.draw(st.booleans(), label="with flags"):
        flags = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(values), max_size=len(values))),
                             dtype=torch.bool, device=device)
    out = plan.gather(cache.state, indices, flags)
    assert torch.equal(bits(out), bits(naive.gather_states(cache.state, indices, flags)))
    assert cache.gaps_untouched()

    valid = data.draw(st.lists(st.integers(0, num_rows - 1), unique=True, max_size=max_selected), label="rows")
    invalid = data.draw(st.lists(st.sampled_from([-2, -1, num_rows, num_rows + 3]),
                                 max_size=max_selected - len(valid)), label="invalid rows")
    targets = data.draw(st.permutations(valid + invalid), label="scatter order")
    packed_dtype = data.draw(st.sampled_from([dtype, torch.float32]), label="packed dtype")
    packed = (torch.randn((len(targets), *inner)) * 5).to(packed_dtype).to(device)
    reference = cache.clone()
    plan.scatter(cache.state, packed, draw_index_tensor(data, targets, device, index_dtype))
    naive.scatter_states(reference.state, packed, torch.tensor(targets, dtype=torch.long, device=device))
    assert torch.equal(bits(cache.backing), bits(reference.backing))
    assert cache.gaps_untouched()


def test_plans_match_naive_twins_on_random_layouts(device):
    # Each example compiles four variants on a GPU; the interpreter is cheaper per example.
    examples = 12 if device.type == "cuda" else 60

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def run(data):
        check_one_example(data, device)

    run()
