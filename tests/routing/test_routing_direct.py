"""The direct route's own per-call decisions (issue 19): the remembered foldable pair and where a cast scatter
goes -- each decided by one route call against a plan that records what it was handed.
"""

from __future__ import annotations

import pytest
import torch

from kda_patches.routing import direct
from kda_patches.routing.direct import DirectRoute
from kda_patches.state_copy.errors import StateCopyError
from kda_patches.state_copy.worker import initialize

pytestmark = pytest.mark.rewrite_mechanism


class RecordingPlan:
    """Records the flags every gather and the source every scatter was handed; gathers CPU rows of zeros."""

    final_dtypes = (torch.float32,)

    def __init__(self) -> None:
        self.gather_flags: list[object] = []
        self.scatter_sources: list[torch.Tensor] = []

    def gather(self, state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
        self.gather_flags.append(flags)
        return torch.ones(indices.shape[0], *state.shape[1:])

    def scatter(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
        self.scatter_sources.append(packed)


def cache(device: str = "cpu") -> torch.Tensor:
    return torch.randn(6, 2, 4, 4, device=device)


def vector(count: int = 3) -> torch.Tensor:
    return torch.randperm(6)[:count]


def mask(count: int = 3) -> torch.Tensor:
    flags = torch.rand(count) > 0.5
    flags[0], flags[-1] = True, False  # both kinds of row in every draw
    return flags


@pytest.fixture(autouse=True)
def forget_the_remembered_pair():
    direct._checked_pair = (None, None, None)
    yield
    direct._checked_pair = (None, None, None)


def gather(state: torch.Tensor, indices, flags) -> tuple[object, torch.Tensor]:
    """One route's gather from ``state``: ``(flags the plan was handed, packed rows)``."""
    plan = RecordingPlan()
    packed = DirectRoute(plan, state).gather(state, indices, flags)
    return plan.gather_flags[0], packed


SECOND_CALLS = {
    # same indices, other flags: one flag per index, but not bool -- the clear must run as the fork wrote it
    "the same indices with other flags": lambda indices, flags: (cache(), indices, flags.long()),
    # same flags, other indices: one more index than flags -- the plan must not take the flags
    "the same flags with other indices": lambda indices, flags: (cache(), torch.cat([indices, indices[:1]]), flags),
    # same pair, a cache on another device (meta): the flags are not on the cache's device
    "the same pair into a cache on another device": lambda indices, flags: (cache("meta"), indices, flags),
}


def as_the_fork_wrote(count: int, state: torch.Tensor, flags) -> object:
    """The recording plan's rows with the fork's clear line run on them, or the exception type it raises."""
    rows = torch.ones(count, *state.shape[1:])
    try:
        rows[~flags, ...] = 0
    except Exception as error:  # the exception type is the outcome compared
        return type(error)
    return rows


@pytest.mark.parametrize("second", SECOND_CALLS)
def test_a_remembered_foldable_pair_is_folded_again_only_for_the_same_indices_flags_and_device(second):
    indices, flags = vector(), mask()
    handed, _ = gather(cache(), indices, flags)
    assert handed is flags  # foldable: the plan's gather took the clear's flags
    handed, _ = gather(cache(), indices, flags)
    assert handed is flags  # the remembered pair, another layer's cache
    state, second_indices, second_flags = SECOND_CALLS[second](indices, flags)
    plan = RecordingPlan()
    expected = as_the_fork_wrote(second_indices.shape[0], state, second_flags)
    try:
        packed = DirectRoute(plan, state).gather(state, second_indices, second_flags)
    except Exception as error:  # the exception type is the outcome compared
        packed = type(error)
    assert plan.gather_flags == [None]  # the plan gathered without flags; the fork's clear ran as written
    if state.device.type != "meta":
        assert packed is expected if isinstance(expected, type) else torch.equal(packed, expected)


def test_a_pair_the_plan_cannot_take_is_never_remembered():
    indices, flags = vector(), mask()
    gather(cache(), indices, flags.long())
    assert direct._checked_pair == (None, None, None)


def test_a_cast_scatter_of_a_source_on_another_device_is_handed_to_the_plan():
    state, plan = cache().to(torch.bfloat16), RecordingPlan()
    route = DirectRoute(plan, state)
    indices = vector()
    route.gather(state, indices, None)
    final = torch.randn(3, 2, 4, 4, device="meta")
    route.scatter_cast(state, indices, final)
    assert plan.scatter_sources[0] is final and route.casts_folded == 1 and route.scatters == 1


def test_the_real_plan_refuses_a_source_on_another_device_before_writing():
    state = torch.randn(6, 2, 4, 4).to(torch.bfloat16)
    plan = initialize({"layer": state}, 4, final_dtypes=(torch.float32,))["layer"]
    before = state.clone()
    route = DirectRoute(plan, state)
    indices = torch.tensor([4, 1, 3])
    route.gather(state, indices, None)
    with pytest.raises(StateCopyError, match="cache is on cpu") as refused:
        route.scatter_cast(state, indices, torch.randn(3, 2, 4, 4, device="meta"))
    assert isinstance(refused.value, RuntimeError)
    assert torch.equal(state.view(torch.int16), before.view(torch.int16))
