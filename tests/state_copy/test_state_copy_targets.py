"""Compiler targets: unified-buffer block limits cap the plan's block, hints only where the compiler keeps them.

The Ascend limits themselves are checked against bishengir by ``tests/ascend_check``; here each rule of the
plans' use of :class:`~kda_patches.state_copy.device.TargetFacts` is decided by a synthetic target.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from state_copy_helpers import bits, build_cache

from kda_patches.ledger import get_ledger
from kda_patches.state_copy import casts, device, naive
from kda_patches.state_copy.device import (
    ASCEND_A2A3_TARGET,
    ASCEND_A5_TARGET,
    CUDA_PDL_TARGET,
    CUDA_TARGET,
    PDL,
    TargetFacts,
)
from kda_patches.state_copy.errors import StateCopyError, StateCopyRefused
from kda_patches.state_copy.plan import FallbackStatePlan, FusedStatePlan, initialize

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def meta(dtype: torch.dtype, inner: tuple[int, int, int] = (12, 128, 128)) -> torch.Tensor:
    payload = inner[0] * inner[1] * inner[2]
    return torch.empty_strided((64, *inner), (payload + 256, inner[1] * inner[2], inner[2], 1), dtype=dtype,
                               device="meta")


def policies(cache: torch.dtype, finals: tuple[torch.dtype, ...]) -> dict[torch.dtype, casts.CastPolicy]:
    return {final: casts.CastPolicy(final, cache, casts.NAN_QUIET) for final in finals}


def blocks(specs: list[dict]) -> dict[str, int]:
    return {spec["name"]: spec["constexprs"]["BLOCK"] for spec in specs}


def test_fallback_block_is_capped_by_the_cast_family_it_compiles():
    unlimited = FallbackStatePlan.variant_specs(meta(BF16), 8, TargetFacts("none"), policies(BF16, (BF16, F32)))
    assert set(blocks(unlimited).values()) == {16384, 8192}  # 16 KiB of bytes, 8192 BF16 items for the cast
    limited = TargetFacts("small", block_limits={"cast_items/float32->bfloat16": 1024})
    specs = FallbackStatePlan.variant_specs(meta(BF16), 8, limited, policies(BF16, (BF16, F32)))
    by_name = blocks(specs)
    assert by_name["fallback/scatter/int32/float32"] == 1024  # the cast kernel: items
    assert by_name["fallback/gather/int32"] == 2048  # the shared grid: the same bytes per program
    assert {spec["family"] for spec in specs} == {"bytes", "cast_items/float32->bfloat16"}


def test_a_limit_on_a_family_the_plan_does_not_compile_changes_nothing():
    other = TargetFacts("other", block_limits={"cast_items/float16->bfloat16": 1024})
    specs = FallbackStatePlan.variant_specs(meta(BF16), 8, other, policies(BF16, (BF16, F32)))
    assert blocks(specs)["fallback/gather/int32"] == 16384


def test_fused_block_is_capped_in_items():
    target = TargetFacts("small", block_limits={"fused/bfloat16->float32": 256})
    specs = FusedStatePlan.variant_specs(meta(F32), 8, target, policies(F32, (F32, BF16)))
    assert set(blocks(specs).values()) == {256}
    assert set(blocks(FusedStatePlan.variant_specs(meta(F32), 8, TargetFacts("none"),
                                                   policies(F32, (F32, BF16)))).values()) == {1024}


def test_a_target_tiling_by_the_widest_item_gives_wider_finals_a_smaller_block():
    wide = TargetFacts("wide", tile_by_widest_item=True)
    by_name = blocks(FusedStatePlan.variant_specs(meta(BF16), 8, wide, policies(BF16, (BF16, F32))))
    assert by_name["fused/scatter/int32/float32"] == by_name["fused/scatter/int64/float32"] == 1024  # 4 KiB of FP32
    assert by_name["fused/gather/int32"] == by_name["fused/scatter/int32/bfloat16"] == 2048  # 4 KiB of BF16
    # narrower finals never grow the block: an FP32 cache keeps 1024 items for its BF16 scatters
    assert set(blocks(FusedStatePlan.variant_specs(meta(F32), 8, wide, policies(F32, (F32, BF16)))).values()) == {1024}
    # a target without the rule (Ascend, the interpreter, pre-SM90 CUDA) shares the cache dtype's block
    assert set(blocks(FusedStatePlan.variant_specs(meta(BF16), 8, TargetFacts("none"),
                                                   policies(BF16, (BF16, F32)))).values()) == {2048}
    assert [facts.name for facts in (CUDA_TARGET, CUDA_PDL_TARGET, ASCEND_A2A3_TARGET, ASCEND_A5_TARGET)
            if facts.tile_by_widest_item] == ["cuda"] and CUDA_PDL_TARGET.tile_by_widest_item


def warps(specs: list[dict]) -> dict[str, int]:
    return {spec["name"]: spec["num_warps"] for spec in specs}


def test_only_a_scatter_whose_tile_was_narrowed_takes_the_widened_scatter_warps():
    wide = TargetFacts("wide", tile_by_widest_item=True, widened_scatter_warps=8)
    by_name = warps(FusedStatePlan.variant_specs(meta(BF16), 8, wide, policies(BF16, (BF16, F32))))
    assert by_name["fused/scatter/int32/float32"] == by_name["fused/scatter/int64/float32"] == 8
    assert {by_name[name] for name in by_name if not name.endswith("/float32")} == {4}  # gathers, BF16 scatters
    # no narrowed tile, no widened warps: an FP32 cache's BF16 scatters and a target without the tile rule
    assert set(warps(FusedStatePlan.variant_specs(meta(F32), 8, wide, policies(F32, (F32, BF16)))).values()) == {4}
    unnarrowed = TargetFacts("flat", widened_scatter_warps=8)
    assert set(warps(FusedStatePlan.variant_specs(meta(BF16), 8, unnarrowed,
                                                  policies(BF16, (BF16, F32)))).values()) == {4}
    # warps the caller chose apply to every variant
    assert set(warps(FusedStatePlan.variant_specs(meta(BF16), 8, wide, policies(BF16, (BF16, F32)),
                                                  num_warps=2)).values()) == {2}
    assert CUDA_PDL_TARGET.widened_scatter_warps == 8 and CUDA_TARGET.widened_scatter_warps is None


def test_only_the_gathers_of_a_listed_cache_dtype_take_the_targets_gather_warps():
    target = TargetFacts("gathers", gather_warps={"float32": 8})
    fp32 = warps(FusedStatePlan.variant_specs(meta(F32), 8, target, policies(F32, (F32, BF16))))
    assert {fp32[name] for name in fp32 if "/gather/" in name} == {8}
    assert {fp32[name] for name in fp32 if "/scatter/" in name} == {4}
    # a cache dtype the target does not list keeps the plan's warps, and warps the caller chose apply everywhere
    assert set(warps(FusedStatePlan.variant_specs(meta(BF16), 8, target, policies(BF16, (BF16, F32)))).values()) \
        == {4}
    assert set(warps(FusedStatePlan.variant_specs(meta(F32), 8, target, policies(F32, (F32,)),
                                                  num_warps=2)).values()) == {2}
    assert CUDA_PDL_TARGET.gather_warps == {"float32": 8} and CUDA_TARGET.gather_warps == {}


def test_a_pdl_target_gives_the_gather_warps_only_to_plans_launched_with_pdl():
    # measured with programmatic dependent launch, like the widened scatter warps
    by_pdl = {pdl: warps(FusedStatePlan.variant_specs(meta(F32), 8, CUDA_PDL_TARGET, policies(F32, (F32,)),
                                                      pdl=pdl))
              for pdl in (True, False)}
    assert by_pdl[True]["fused/gather/int32"] == by_pdl[True]["fused/gather/int64"] == 8
    assert set(by_pdl[False].values()) == {4}


def test_a_plan_with_gather_warps_says_so_and_gathers_exactly(device):
    cache = build_cache(device, dtype=F32, num_rows=7, inner=(2, 16, 48), seed=17)
    plan = FusedStatePlan.prepare(cache.state, 5, target=TargetFacts("gathers", gather_warps={"float32": 8})).seal()
    assert plan.describe()["block"]["gather_warps"] == 8 and plan.describe()["num_warps"] == 4
    indices = torch.tensor([6, -2, 1, 7, 3], dtype=torch.int64, device=device)
    flags = torch.tensor([True, True, False, True, True], device=device)
    before = cache.clone()
    assert torch.equal(bits(plan.gather(cache.state, indices, flags)),
                       bits(naive.gather_states(cache.state, indices, flags)))
    assert torch.equal(bits(cache.backing), bits(before.backing)) and cache.gaps_untouched()


def test_a_plan_with_widened_scatter_warps_says_so_and_copies_exactly(device):
    cache = build_cache(device, dtype=BF16, num_rows=6, inner=(2, 16, 48), seed=13)
    target = TargetFacts("wide", tile_by_widest_item=True, widened_scatter_warps=8)
    plan = FusedStatePlan.prepare(cache.state, 4, final_dtypes=(BF16, F32), target=target).seal()
    assert plan.describe()["block"]["scatter_warps"] == {"float32": 8} and plan.describe()["num_warps"] == 4
    indices = torch.tensor([5, -1, 1, 3], dtype=torch.int32, device=device)
    final = torch.randn((4, 2, 16, 48), generator=torch.Generator().manual_seed(9)).to(device, F32)
    expected = cache.clone()
    naive.scatter_states(expected.state, final, indices)
    plan.scatter(cache.state, final, indices)
    assert torch.equal(bits(cache.backing), bits(expected.backing)) and cache.gaps_untouched()


def test_a_plan_with_per_final_blocks_copies_exactly(device):
    cache = build_cache(device, dtype=BF16, num_rows=6, inner=(2, 16, 48), seed=11)  # 1536 items: no even tile
    plan = FusedStatePlan.prepare(cache.state, 4, block_bytes=1024, final_dtypes=(BF16, F32),
                                  target=TargetFacts("wide", tile_by_widest_item=True)).seal()
    assert plan.describe()["block"] == {"items": 512, "bytes": 1024, "scatter_items": {"float32": 256}}
    indices = torch.tensor([4, 0, 9, 2], dtype=torch.int64, device=device)
    for final_dtype in (F32, BF16):
        final = torch.randn((4, 2, 16, 48), generator=torch.Generator().manual_seed(5)).to(device, final_dtype)
        expected = cache.clone()
        naive.scatter_states(expected.state, final, indices)
        plan.scatter(cache.state, final, indices)
        assert torch.equal(bits(cache.backing), bits(expected.backing)) and cache.gaps_untouched()
    flags = torch.tensor([True, False, True, True], device=device)
    assert torch.equal(bits(plan.gather(cache.state, indices, flags)),
                       bits(naive.gather_states(cache.state, indices, flags)))


def test_the_a2a3_table_caps_fp16_caches_with_fp32_finals():
    specs = FallbackStatePlan.variant_specs(meta(F16), 8, ASCEND_A2A3_TARGET, policies(F16, (F16, F32)))
    assert blocks(specs)["fallback/scatter/int64/float32"] == ASCEND_A2A3_TARGET.block_limit(
        "cast_items/float32->float16") == 4096
    assert blocks(specs)["fallback/gather/int64"] == 8192  # bytes: 4096 FP16 items
    a5 = FallbackStatePlan.variant_specs(meta(F16), 8, ASCEND_A5_TARGET, policies(F16, (F16, F32)))
    assert blocks(a5)["fallback/gather/int64"] == 16384  # the A5 buffer fits the default


def test_an_explicit_block_over_a_limit_is_refused(device):
    cache = build_cache(device, dtype=BF16, num_rows=4, inner=(2, 16, 64))
    target = TargetFacts("small", block_limits={"cast_items/float32->bfloat16": 256})
    with pytest.raises(StateCopyError, match="unified buffer"):
        FallbackStatePlan.prepare(cache.state, 4, block_bytes=4096, target=target)


def test_a_capped_plan_copies_exactly(device):
    cache = build_cache(device, dtype=BF16, num_rows=6, inner=(2, 16, 64), seed=7)
    target = TargetFacts("small", block_limits={"cast_items/float32->bfloat16": 256})
    plan = FallbackStatePlan.prepare(cache.state, 4, target=target).seal()
    assert plan.describe()["block"] == {"bytes": 512, "cast_items": 256}
    assert plan.describe()["block_limited_by"] == "cast_items/float32->bfloat16"
    indices = torch.tensor([4, 0, 9, 2], dtype=torch.int32, device=device)
    flags = torch.tensor([True, False, True, True], device=device)
    assert torch.equal(bits(plan.gather(cache.state, indices, flags)), bits(naive.gather_states(cache.state, indices,
                                                                                                  flags)))
    final = torch.randn((4, 2, 16, 64), generator=torch.Generator().manual_seed(3)).to(device)
    expected = cache.clone()
    naive.scatter_states(expected.state, final, indices)
    plan.scatter(cache.state, final, indices)
    assert torch.equal(bits(cache.backing), bits(expected.backing)) and cache.gaps_untouched()


def test_hints_are_set_only_where_the_target_keeps_them():
    cuda = FusedStatePlan.variant_specs(meta(BF16), 8, CUDA_TARGET, policies(BF16, (BF16,)), stream=True)
    ascend = FusedStatePlan.variant_specs(meta(BF16), 8, ASCEND_A5_TARGET, policies(BF16, (BF16,)), stream=True)
    assert {spec["constexprs"]["STREAM"] for spec in cuda} == {True}
    assert {spec["constexprs"]["STREAM"] for spec in ascend} == {False}


def test_a_dropped_hint_is_said_in_the_plan_facts(device):
    cache = build_cache(device, dtype=F32, num_rows=4, inner=(2, 16, 64))
    hints = FusedStatePlan.prepare(cache.state, 2, stream=True, target=ASCEND_A5_TARGET).describe()["memory_hints"]
    assert hints["gather_evict_first"] is False and hints["scatter_evict_first"] is False
    assert hints["target_honours"] == [] and "ascend-a5" in hints["dropped"][0]
    kept = FusedStatePlan.prepare(cache.state, 2, target=TargetFacts("kept", honoured_hints=("evict_first",)))
    assert kept.describe()["memory_hints"] == {"target_honours": ["evict_first"], "gather_evict_first": False,
                                               "scatter_evict_first": True, "dropped": []}


def test_routes_carry_the_target_of_their_device():
    npu = SimpleNamespace(type="npu")
    assert device.route_plan(npu, BF16, soc=260).target is ASCEND_A5_TARGET
    assert device.route_plan(npu, BF16, soc="Ascend910B3").target is ASCEND_A2A3_TARGET
    assert device.route_plan(npu, F16, soc=260).target is ASCEND_A5_TARGET  # fallback plan, A5 buffer
    assert device.route_plan(SimpleNamespace(type="cuda", index=0), F32).target.name == "cuda"
    assert device.route_plan(npu, F32, soc=253).as_dict()["target"] == "ascend-a2a3"


def test_the_ledger_fact_names_block_target_and_hints(device):
    cache = build_cache(device, dtype=BF16, num_rows=4, inner=(2, 16, 64))
    initialize({"layers.0.attn": cache.state}, 4)
    fact = get_ledger().snapshot()["facts"]["state_copy"]["layers.0.attn"]
    assert fact["target"] == ("cpu-interpreter" if device.type == "cpu" else "cuda")
    assert fact["block"]["items"] == 2048 and fact["block_limited_by"] is None
    assert fact["memory_hints"]["scatter_evict_first"] is (device.type == "cuda")


def test_a_canonical_fp32_nan_with_the_sign_bit_is_written_exactly(device, monkeypatch):
    # the kernels compute in int32: the plan hands them 0xFFC00000 as a negative constant
    policy = casts.CastPolicy(BF16, F32, casts.NAN_CANONICAL, 0xFFC00000)
    assert policy.constexprs()[3] == 0xFFC00000 - (1 << 32)
    monkeypatch.setattr(casts, "probe_nan_policy", lambda source, target, *rest: casts.CastPolicy(
        source, target, casts.NAN_CANONICAL, 0xFFC00000) if source != target else casts.CastPolicy(source, target))
    cache = build_cache(device, dtype=F32, num_rows=3, inner=(1, 4, 16))
    plan = FusedStatePlan.prepare(cache.state, 2, final_dtypes=(BF16,)).seal()
    final = torch.full((1, 1, 4, 16), 0x7FC1, dtype=torch.int16, device=device).view(BF16)
    final.view(torch.int16).view(-1)[5] = 0x3F80  # one finite value among the NaNs: 1.0
    plan.scatter(cache.state, final, torch.tensor([1], device=device))
    written = bits(cache.state[1]).reshape(-1)
    assert int(written[5]) == 0x3F800000
    assert set(written[torch.arange(64, device=device) != 5].tolist()) == {0xFFC00000 - (1 << 32)}


@pytest.mark.parametrize("capability, expected", [((8, 0), CUDA_TARGET), ((8, 9), CUDA_TARGET),
                                                  ((9, 0), CUDA_PDL_TARGET), ((10, 0), CUDA_PDL_TARGET)])
def test_programmatic_dependent_launch_is_honoured_from_sm90(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    target = device.target_facts(SimpleNamespace(type="cuda", index=0))
    assert target is expected and target.honours(PDL) is (capability >= (9, 0))
    assert target.honours("evict_first")


def test_pdl_is_compiled_only_into_the_fused_kernel_where_the_target_honours_it():
    pdl = FusedStatePlan.variant_specs(meta(BF16), 8, CUDA_PDL_TARGET, policies(BF16, (BF16,)), pdl=True)
    assert {spec["constexprs"]["PDL"] for spec in pdl} == {True} and {spec["launch_pdl"] for spec in pdl} == {True}
    for target, asked in ((CUDA_PDL_TARGET, False), (CUDA_TARGET, True), (ASCEND_A5_TARGET, True)):
        specs = FusedStatePlan.variant_specs(meta(BF16), 8, target, policies(BF16, (BF16,)), pdl=asked)
        assert {spec["constexprs"]["PDL"] for spec in specs} == {False} and not any(s["launch_pdl"] for s in specs)
    fallback = FallbackStatePlan.variant_specs(meta(F16), 8, CUDA_PDL_TARGET, policies(F16, (F16,)), pdl=True)
    assert not any(spec["launch_pdl"] or "PDL" in spec["constexprs"] for spec in fallback)


def test_a_dropped_pdl_request_is_said_in_the_plan_facts(device):
    cache = build_cache(device, dtype=F32, num_rows=4, inner=(2, 16, 64))
    facts = FusedStatePlan.prepare(cache.state, 2, pdl=True, target=ASCEND_A5_TARGET).describe()
    assert facts["pdl"] is False and "pdl: ascend-a5 has no programmatic dependent launch" in \
        facts["memory_hints"]["dropped"]
    assert FusedStatePlan.prepare(cache.state, 2, target=ASCEND_A5_TARGET).describe()["memory_hints"]["dropped"] == []


def test_auto_pdl_compiles_it_where_the_target_has_it_and_records_no_drop_elsewhere():
    auto = FusedStatePlan.variant_specs(meta(BF16), 8, CUDA_PDL_TARGET, policies(BF16, (BF16,)), pdl="auto")
    assert {spec["launch_pdl"] for spec in auto} == {True} and {spec["constexprs"]["PDL"] for spec in auto} == {True}
    for target in (CUDA_TARGET, ASCEND_A5_TARGET):
        specs = FusedStatePlan.variant_specs(meta(BF16), 8, target, policies(BF16, (BF16,)), pdl="auto")
        assert not any(spec["launch_pdl"] for spec in specs)
    fallback = FallbackStatePlan.variant_specs(meta(F16), 8, CUDA_PDL_TARGET, policies(F16, (F16,)), pdl="auto")
    assert not any(spec["launch_pdl"] for spec in fallback)


@pytest.mark.parametrize("asked", [True, "auto"])
def test_only_an_explicit_pdl_request_is_recorded_as_dropped(device, asked):
    cache = build_cache(device, dtype=F32, num_rows=4, inner=(2, 16, 64))
    facts = FusedStatePlan.prepare(cache.state, 2, pdl=asked, target=ASCEND_A5_TARGET).describe()
    dropped = [hint for hint in facts["memory_hints"]["dropped"] if hint.startswith("pdl")]
    assert facts["pdl"] is False and bool(dropped) is (asked is True)


@pytest.mark.parametrize("asked", ["on", 1, None])
def test_a_pdl_argument_other_than_true_false_or_auto_is_refused(asked):
    with pytest.raises(StateCopyRefused, match="pdl must be True, False or 'auto'"):
        FusedStatePlan.variant_specs(meta(BF16), 8, CUDA_PDL_TARGET, policies(BF16, (BF16,)), pdl=asked)


@pytest.mark.parametrize("asked", ["pdl", "plain"])
def test_the_fused_variants_compile_for_sm90_with_grid_dependency_control_only_when_asked(asked):
    # compiled for real by Triton's NVIDIA backend on this machine (no GPU needed), in a process without the
    # interpreter; the PTX is what the H200 would load
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("pdl_compile_child.py")), asked],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == 6  # gather and two scatters, int32 and int64 indices
    expected = asked == "pdl"
    assert all(entry == {"wait": expected, "launch_dependents": expected, "launch_pdl": expected}
               for entry in found.values()), found


@pytest.mark.parametrize("dtype, final", [(BF16, F32), (F32, F32)])
def test_a_pdl_plan_copies_exactly_where_it_is_compiled(device, dtype, final):
    # on an SM90+ GPU (--run-gpu) the plan launches with programmatic dependent launch, back to back on one stream
    # after other kernels; elsewhere the request is dropped and the same plan runs without it
    cache = build_cache(device, dtype=dtype, num_rows=7, inner=(2, 16, 64), seed=11)
    plan = FusedStatePlan.prepare(cache.state, 4, pdl=True, final_dtypes=(final,)).seal()
    assert plan.describe()["pdl"] is (device.type == "cuda" and device_target_has_pdl(device))
    indices = torch.tensor([5, -1, 2, 7], dtype=torch.int64, device=device)  # -1 and 7 (== N) are invalid
    flags = torch.tensor([True, True, False, True], device=device)
    for _ in range(3):  # consecutive launches: each waits for the one before it
        expected = naive.gather_states(cache.state, indices, flags)
        assert torch.equal(bits(plan.gather(cache.state, indices, flags)), bits(expected))
        last = torch.randn((4, 2, 16, 64), generator=torch.Generator().manual_seed(5)).to(device=device, dtype=final)
        reference = cache.clone()
        naive.scatter_states(reference.state, last, indices)
        plan.scatter(cache.state, last, indices)
        assert torch.equal(bits(cache.backing), bits(reference.backing)) and cache.gaps_untouched()


def device_target_has_pdl(where: torch.device) -> bool:
    return device.target_facts(where).honours(PDL)


def test_a_pdl_target_widens_the_scatter_warps_only_of_plans_launched_with_pdl():
    # the warps were measured with programmatic dependent launch; a plain launch on the same target keeps 4
    by_pdl = {pdl: warps(FusedStatePlan.variant_specs(meta(BF16), 8, CUDA_PDL_TARGET, policies(BF16, (BF16, F32)),
                                                      pdl=pdl))
              for pdl in (True, False)}
    assert by_pdl[True]["fused/scatter/int32/float32"] == 8
    assert set(by_pdl[False].values()) == {4}
