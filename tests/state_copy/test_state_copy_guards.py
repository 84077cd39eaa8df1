"""Guards that make the "no JIT after seal" and "invalid index" claims able to fail, on the CPU too."""

from __future__ import annotations

import pytest
import torch
from state_copy_helpers import BITS, bits

from kda_patches.bench.entries import CompilerEntryCounter
from kda_patches.state_copy import naive
from kda_patches.state_copy.plan import PLAN_CLASSES, FusedStatePlan


class ReenteringPlan(FusedStatePlan):
    """A deliberately broken plan: its gather launches through Triton's ``kernel[grid](...)`` entry."""

    def gather(self, state, indices, flags=None, layer=None):
        indices = self._check_call(state, indices, layer)
        packed = torch.empty((indices.shape[0], *self._inner), dtype=self._dtype, device=self._device)
        flags = self._true_flags[:indices.shape[0]] if flags is None else flags
        self.kernel[self._grid(indices.shape[0])](state, packed, indices, flags, state.shape[0],
                                                   *self._variant_constexprs(("gather", indices.dtype)))
        return packed


def test_guard_fails_a_plan_that_reenters_triton(make_cache, device, no_compiler):
    cache = make_cache()
    broken = ReenteringPlan.prepare(cache.state, 4).seal()
    sound = FusedStatePlan.prepare(cache.state, 4).seal()
    indices = torch.tensor([3, 0, -1], dtype=torch.int32, device=device)
    expected = naive.gather_states(cache.state, indices)
    assert torch.equal(broken.gather(cache.state, indices), expected)  # a working plan, only launched wrongly
    with CompilerEntryCounter() as counter:  # the benchmark's counter sees it too
        broken.gather(cache.state, indices)
        sound.gather(cache.state, indices)
    assert sum(counter.counts.values()) >= 1
    no_compiler.arm()
    with pytest.raises(RuntimeError, match="compiler entry after seal"):
        broken.gather(cache.state, indices)
    assert no_compiler.entries and set(no_compiler.entries) <= {"JITFunction.__getitem__", "JITFunction.run",
                                                                "InterpretedFunction.__getitem__",
                                                                "InterpretedFunction.run"}
    seen = list(no_compiler.entries)
    assert torch.equal(sound.gather(cache.state, indices), expected)
    assert no_compiler.entries == seen  # the sealed plan's direct launch added nothing


def test_entry_counter_counts_nothing_for_sealed_plans(make_cache, device):
    cache = make_cache(dtype=torch.bfloat16)
    plan = FusedStatePlan.prepare(cache.state, 4).seal()
    indices = torch.tensor([1, 4], device=device)
    with CompilerEntryCounter() as counter:
        out = plan.gather(cache.state, indices)
        plan.scatter(cache.state, out.float(), indices)
    assert counter.counts == {"JITFunction.run": 0, "InterpretedFunction.run": 0, "triton.compile": 0}


def cache_with_poisoned_tail(device, dtype, num_rows=4, inner=(2, 3, 8), gap=5):
    """A cache whose backing goes on for one more row of poison after row N-1 (in bounds, non-zero)."""
    stride0 = inner[0] * inner[1] * inner[2] + gap
    backing = torch.full(((num_rows + 1) * stride0,), -7, dtype=BITS[dtype]).view(dtype).to(device)
    state = backing.as_strided((num_rows, *inner), (stride0, inner[1] * inner[2], inner[2], 1), 0)
    state.copy_(torch.randn((num_rows, *inner)).to(dtype).to(device))
    return state, backing


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("kind", "dtype"), [("fused", torch.float32), ("fused", torch.bfloat16),
                                             ("fallback", torch.float32)])
def test_flagged_index_equal_to_n_gathers_zeros_and_scatters_nothing(device, kind, dtype, index_dtype):
    # row N would be the poisoned tail: a plan that takes index == N as valid reads or writes it
    state, backing = cache_with_poisoned_tail(device, dtype)
    num_rows = state.shape[0]
    tail_before = bits(backing[num_rows * state.stride(0):]).clone()
    plan = PLAN_CLASSES[kind].prepare(state, 4).seal()
    indices = torch.tensor([num_rows, 1, num_rows, 0], dtype=index_dtype, device=device)
    flags = torch.ones(4, dtype=torch.bool, device=device)
    out = plan.gather(state, indices, flags)
    assert not bits(out[0]).any() and not bits(out[2]).any()
    assert torch.equal(bits(out), bits(naive.gather_states(state, indices, flags)))
    before = bits(backing).clone()
    plan.scatter(state, torch.randn((2, *state.shape[1:]), device=device), indices[:3:2])
    assert torch.equal(bits(backing), before)
    assert torch.equal(bits(backing[num_rows * state.stride(0):]), tail_before)
