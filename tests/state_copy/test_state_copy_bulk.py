"""Bulk scatters (``TargetFacts.bulk_scatter``): a same-dtype scatter of many rows launches its own compiled shape.

Each rule is decided by a synthetic target: the row threshold, the same-dtype and cache-dtype conditions, the
caller's warps and ``max_selected`` below the threshold turning it off, and the bulk shape's warps and hint. Last,
the other SM90 scatter fact, pinned loads (``TargetFacts.pinned_scatter_load``): described and exact (where the
assembler puts the load is ``test_state_copy_sass.py``'s).
"""

from __future__ import annotations

import pytest
import torch
from state_copy_helpers import bits, build_cache

from kda_patches.state_copy import casts, naive
from kda_patches.state_copy.device import CUDA_PDL_TARGET, CUDA_TARGET, EVICT_FIRST, BulkScatter, TargetFacts
from kda_patches.state_copy.plan import FusedStatePlan

F32, BF16 = torch.float32, torch.bfloat16
INNER = (2, 16, 48)
BULK_TARGET = TargetFacts("bulky", honoured_hints=(EVICT_FIRST,), bulk_scatter=BulkScatter(
    min_rows=3, num_warps=2, evict_first=False, cache_dtypes=("float32",)))


class LaunchSpy:
    """Stands in a plan's variant table: records the variant's name, then launches it."""

    def __init__(self, variant, names: list[str]) -> None:
        self.variant, self.names, self.name = variant, names, variant.name

    def launch(self, *args):
        self.names.append(self.name)
        return self.variant.launch(*args)


def launched_names(plan: FusedStatePlan, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the name of every scatter variant the plan launches from now on."""
    names: list[str] = []
    for table in [plan._bulk_scatters, *plan._scatters.values()]:
        for index_dtype, variant in list(table.items()):
            monkeypatch.setitem(table, index_dtype, LaunchSpy(variant, names))
    return names


def scatter_and_check(plan: FusedStatePlan, cache, indices: list[int], final_dtype: torch.dtype, seed: int) -> None:
    device = cache.state.device
    index = torch.tensor(indices, dtype=torch.int32, device=device)
    final = torch.randn((len(indices), *INNER), generator=torch.Generator().manual_seed(seed)).to(device, final_dtype)
    expected = cache.clone()
    naive.scatter_states(expected.state, final, index)
    plan.scatter(cache.state, final, index)
    assert torch.equal(bits(cache.backing), bits(expected.backing)) and cache.gaps_untouched()


def test_a_scatter_of_at_least_min_rows_launches_the_bulk_variant_and_copies_exactly(device, monkeypatch):
    cache = build_cache(device, dtype=F32, num_rows=7, inner=INNER, seed=21)
    plan = FusedStatePlan.prepare(cache.state, 4, final_dtypes=(F32, BF16), target=BULK_TARGET).seal()
    names = launched_names(plan, monkeypatch)
    scatter_and_check(plan, cache, [5, 1], F32, seed=1)  # 2 rows: below the threshold
    scatter_and_check(plan, cache, [6, -1, 2], F32, seed=2)  # 3 rows (one invalid): at the threshold
    scatter_and_check(plan, cache, [0, 3, 7, 4], F32, seed=3)  # 7 == N: invalid
    assert names == ["fused/scatter/int32/float32", "fused/scatter/int32/float32/bulk",
                     "fused/scatter/int32/float32/bulk"]


def test_finals_of_another_dtype_never_take_the_bulk_variant(device, monkeypatch):
    cache = build_cache(device, dtype=F32, num_rows=7, inner=INNER, seed=22)
    plan = FusedStatePlan.prepare(cache.state, 4, final_dtypes=(F32, BF16), target=BULK_TARGET).seal()
    names = launched_names(plan, monkeypatch)
    scatter_and_check(plan, cache, [6, 0, 2, 5], BF16, seed=4)
    assert names == ["fused/scatter/int32/bfloat16"]


def test_only_the_declared_cache_dtypes_get_bulk_variants():
    def names(dtype: torch.dtype, max_selected: int = 8, num_warps: int | None = None) -> set[str]:
        state = torch.empty((16, *INNER), dtype=dtype, device="meta")
        policies = {final: casts.CastPolicy(final, dtype, casts.NAN_QUIET) for final in (F32, BF16)}
        return {spec["name"] for spec in FusedStatePlan.variant_specs(state, max_selected, BULK_TARGET, policies,
                                                                       num_warps=num_warps)}

    assert {name for name in names(F32) if name.endswith("/bulk")} == {"fused/scatter/int32/float32/bulk",
                                                                       "fused/scatter/int64/float32/bulk"}
    assert not any(name.endswith("/bulk") for name in names(BF16))  # BF16 is not declared
    assert not any(name.endswith("/bulk") for name in names(F32, num_warps=4))  # the caller chose the warps
    assert not any(name.endswith("/bulk") for name in names(F32, max_selected=2))  # never that many rows
    assert any(name.endswith("/bulk") for name in names(F32, max_selected=3))


def test_the_bulk_variant_takes_its_own_warps_and_store_hint():
    state = torch.empty((64, 12, 128, 128), dtype=F32, device="meta")
    policies = {F32: casts.CastPolicy(F32, F32, casts.NAN_QUIET)}
    specs = {spec["name"]: spec for spec in FusedStatePlan.variant_specs(state, 256, CUDA_PDL_TARGET, policies,
                                                                           pdl=True)}
    bulk, plain = specs["fused/scatter/int32/float32/bulk"], specs["fused/scatter/int32/float32"]
    assert (bulk["num_warps"], bulk["constexprs"]["STREAM"]) == (8, False)
    assert (plain["num_warps"], plain["constexprs"]["STREAM"]) == (4, True)
    assert {key: value for key, value in bulk["constexprs"].items() if key != "STREAM"} == \
        {key: value for key, value in plain["constexprs"].items() if key != "STREAM"}  # same tile, same code else
    assert CUDA_TARGET.bulk_scatter is None  # measured on SM90 only


def test_a_plan_with_bulk_scatters_says_so(device):
    cache = build_cache(device, dtype=F32, num_rows=7, inner=INNER, seed=23)
    described = FusedStatePlan.prepare(cache.state, 4, target=BULK_TARGET).seal().describe()
    assert described["block"]["bulk_scatter"] == {"min_rows": 3, "num_warps": 2, "evict_first": False}
    assert "fused/scatter/int64/float32/bulk" in described["variants"]
    plain = FusedStatePlan.prepare(cache.state, 2, target=BULK_TARGET).seal().describe()
    assert "bulk_scatter" not in plain["block"] and not any(name.endswith("/bulk") for name in plain["variants"])


def test_a_plan_with_pinned_scatter_loads_says_so_and_copies_exactly(device):
    cache = build_cache(device, dtype=F32, num_rows=7, inner=INNER, seed=24)
    pinned = FusedStatePlan.prepare(cache.state, 4, final_dtypes=(F32, BF16),
                                    target=TargetFacts("pinned", pinned_scatter_load=True)).seal()
    assert pinned.describe()["block"]["scatter_load"] == "pinned"
    scatter_and_check(pinned, cache, [6, -1, 2, 4], F32, seed=5)
    scatter_and_check(pinned, cache, [1, 3, 7, 0], BF16, seed=6)
    plain = FusedStatePlan.prepare(cache.state, 4, target=TargetFacts("plain")).seal()
    assert "scatter_load" not in plain.describe()["block"]
