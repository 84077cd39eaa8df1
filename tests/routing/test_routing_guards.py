"""Two guards of the routed alias, each decided by a case where only that guard matters (issue 19: written
against the alias as it is, to stay green through any rework of the routing core).

- Only ``packed[~flags, ...] = 0`` is elided as the folded clear: the same statement with any other value
  must run as written (and the call then does not count as routed).
- A cast is folded into the scatter only when its target is the cache's dtype: ``last.to(other)`` stored
  into the cache would round twice, so it stays torch's own cast, exactly as the fork wrote it.
"""

from __future__ import annotations

import pytest
import torch

from kda_patches.patches import gdn_state_copy
from kda_patches.routing.alias import CallRoute, PendingCast, make_alias, make_flags_alias, tag_final


class RecordingPlan:
    """A plan stand-in: gathers with the flags folded (zero rows), records scatter sources."""

    def __init__(self, final_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)) -> None:
        self.final_dtypes = final_dtypes
        self.sources: list[torch.Tensor] = []

    def gather(self, state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
        packed = torch.Tensor.__getitem__(state, indices).clone()
        if flags is not None:
            packed[~flags] = 0
        return packed

    def scatter(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
        self.sources.append(packed)
        torch.Tensor.__setitem__(state, indices, packed.to(state.dtype))


def routed_call(cache_dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(11)
    cache = torch.randn(6, 2, 4, 4, generator=generator).to(cache_dtype)
    indices = torch.tensor([4, 1, 3])
    flags = torch.tensor([True, False, True])
    route = CallRoute(gdn_state_copy.QWEN_SEAM, "model.layers.0.attn", RecordingPlan(), cache, indices, flags)
    return route, make_alias(route), make_flags_alias(route), indices, cache


@pytest.mark.parametrize("value", [1, 0.5, -0.0 + 2])
def test_a_clear_with_another_value_runs_as_written_and_is_not_elided(value):
    route, alias, flags, indices, _ = routed_call()
    packed = alias[indices]
    packed[~flags, ...] = value
    assert route.folded == 1 and route.elided == 0
    assert torch.equal(packed[1], torch.full_like(packed[1], value))  # the fork's own statement ran
    alias[indices] = packed
    assert "clear(s) of the form" in route.problem()  # not routed: the fork does not clear the folded way


def test_the_zero_clear_is_elided_and_the_call_is_routed():
    route, alias, flags, indices, _ = routed_call()
    packed = alias[indices]
    packed[~flags, ...] = 0
    alias[indices] = packed
    assert route.elided == 1 and route.problem() is None


def test_a_cast_to_another_dtype_than_the_cache_is_torch_own_cast():
    route, alias, _, _, _ = routed_call(torch.bfloat16)
    final = tag_final((None, torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(5))), 1, route)[1]
    other = final.to(torch.float16)  # not the cache's dtype, though the plan prepared FP16 finals
    assert type(other) is not PendingCast
    assert torch.equal(other.view(torch.int16), torch.Tensor.to(final, torch.float16).view(torch.int16))
    same = final.to(alias.dtype)
    assert type(same) is PendingCast  # the cache's dtype: the plan may cast in its copy
