"""A routed scatter must behave like torch's own index assignment, including when torch refuses it.

Kimi Linear's ``KimiGatedDeltaNetAttention._forward`` scatters its final state without casting it
(``recurrent_state[idx] = last``): with a BF16 cache and FP32 finals vLLM's own code raises. The plan could cast
and succeed, which would make the patched process behave differently from the baseline; the alias hands such an
assignment back to torch instead.
"""

from __future__ import annotations

import pytest
import torch

from kda_patches.routing.alias import CallRoute, make_alias


class RecordingPlan:
    """Counts scatters; a scatter through it writes like the real plan (cast to the cache dtype)."""

    def __init__(self) -> None:
        self.scatters = 0

    def scatter(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
        self.scatters += 1
        state[indices.long()] = packed.to(state.dtype)


def routed_alias(cache: torch.Tensor) -> tuple[torch.Tensor, CallRoute, RecordingPlan]:
    plan = RecordingPlan()
    route = CallRoute(None, "model.layers.0.attn", plan, cache)
    return make_alias(route), route, plan


def test_a_source_of_the_cache_dtype_is_routed():
    cache = torch.randn(6, 2, 4, 4).to(torch.bfloat16)
    alias, route, plan = routed_alias(cache)
    final = torch.randn(2, 2, 4, 4).to(torch.bfloat16)
    alias[torch.tensor([1, 4], dtype=torch.int32)] = final
    assert plan.scatters == 1 and route.scatters == 1
    assert torch.equal(cache[1], final[0]) and torch.equal(cache[4], final[1])


def test_a_source_of_another_dtype_fails_exactly_as_torch_does():
    cache = torch.randn(6, 2, 4, 4).to(torch.bfloat16)
    before = cache.clone()
    indices = torch.tensor([1, 4], dtype=torch.int64)
    final = torch.randn(2, 2, 4, 4)  # FP32, uncast
    with pytest.raises(RuntimeError) as native:
        before.clone()[indices] = final
    alias, route, plan = routed_alias(cache)
    with pytest.raises(RuntimeError) as routed:
        alias[indices] = final
    assert str(routed.value) == str(native.value)
    assert plan.scatters == 0 and route.scatters == 0
    assert torch.equal(cache.view(torch.int16), before.view(torch.int16))
