"""GPU-only checks (``--run-gpu``): pages more than 4 GiB apart, CUDA graph replay, no JIT after seal."""

from __future__ import annotations

import pytest
import torch
from state_copy_helpers import bits

from kda_patches.state_copy import naive
from kda_patches.state_copy.plan import PLAN_CLASSES, initialize

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["fused", "fallback"])
def test_pages_more_than_4_gib_apart(device, kind, no_compiler):
    inner = (2, 4, 64)
    payload = 2 * 4 * 64
    stride0 = 2**31 + 128  # bf16 items: row 1 starts 4 GiB + 256 B after row 0
    offset = 8
    backing = torch.empty(offset + stride0 + payload + 64, dtype=torch.bfloat16, device=device)
    state = backing.as_strided((2, *inner), (stride0, 4 * 64, 64, 1), offset)
    assert state.stride(0) * state.element_size() > 2**32
    backing.view(torch.int16)[:offset + payload + 64].fill_(-7)
    backing.view(torch.int16)[offset + stride0 - 64:].fill_(-7)
    state.copy_(torch.randn((2, *inner), device=device).to(torch.bfloat16))
    near_gaps = [slice(0, offset), slice(offset + payload, offset + payload + 64),
                 slice(offset + stride0 - 64, offset + stride0), slice(offset + stride0 + payload, None)]
    before = [bits(backing[window]).clone() for window in near_gaps]
    plan = PLAN_CLASSES[kind].prepare(state, 4).seal()
    no_compiler.arm()
    for index_dtype in (torch.int32, torch.int64):
        indices = torch.tensor([1, 0, -1, 2], dtype=index_dtype, device=device)
        out = plan.gather(state, indices)
        assert torch.equal(bits(out), bits(naive.gather_states(state, indices)))
        assert torch.equal(bits(out[0]), bits(state[1]))
        final = torch.randn((4, *inner), device=device)
        plan.scatter(state, final, torch.tensor([-5, 1, 7, 0], dtype=index_dtype, device=device))
        assert torch.equal(bits(state[0]), bits(final[3].to(torch.bfloat16)))
        assert torch.equal(bits(state[1]), bits(final[1].to(torch.bfloat16)))
    assert all(torch.equal(bits(backing[window]), saved) for window, saved in zip(near_gaps, before, strict=True))
    assert no_compiler.entries == []


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_graph_replay_with_new_indices_and_flags(make_cache, device, dtype, index_dtype, no_compiler):
    cache = make_cache(dtype=dtype, num_rows=12, inner=(3, 8, 32), gap=40, offset=5)
    reference = cache.clone()
    binding = initialize({"layer": cache.state}, 6)["layer"]
    count = 5
    static_indices = torch.zeros(count, dtype=index_dtype, device=device)
    static_flags = torch.ones(count, dtype=torch.bool, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture, as CUDA graphs require
        binding.scatter(cache.state, binding.gather(cache.state, static_indices, static_flags), static_indices)
    torch.cuda.current_stream().wait_stream(stream)
    naive.scatter_states(reference.state, naive.gather_states(reference.state, static_indices, static_flags),
                         static_indices)
    graph = torch.cuda.CUDAGraph()
    no_compiler.arm()
    with torch.cuda.graph(graph):
        packed = binding.gather(cache.state, static_indices, static_flags)
        final = packed.float() * 0.5 - 1
        binding.scatter(cache.state, final, static_indices)
    generator = torch.Generator().manual_seed(5)
    for _ in range(4):
        rows = torch.randperm(12, generator=generator)[:count]
        rows[torch.randint(0, count, (1,), generator=generator)] = -1
        static_indices.copy_(rows.to(index_dtype))
        static_flags.copy_(torch.rand(count, generator=generator) > 0.3)
        graph.replay()
        torch.cuda.synchronize()
        expected = naive.gather_states(reference.state, static_indices, static_flags)
        naive.scatter_states(reference.state, expected.float() * 0.5 - 1, static_indices)
        assert torch.equal(bits(packed), bits(expected))
        assert torch.equal(bits(cache.backing), bits(reference.backing))
    assert cache.gaps_untouched()
    assert no_compiler.entries == []
