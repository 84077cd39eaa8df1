"""The final-state cast folded into the scatter: bit-exact to torch's ``.to()``, prepared final dtypes only."""

from __future__ import annotations

import pytest
import torch
from state_copy_helpers import BITS, bits, build_cache

from kda_patches.ledger import get_ledger
from kda_patches.state_copy import casts, kernels, naive
from kda_patches.state_copy.errors import LayoutError, StateCopyRefused
from kda_patches.state_copy.plan import PLAN_CLASSES, initialize

NAN_RULE_AT = kernels.copy_rows_kernel.arg_names.index("NAN_RULE") - kernels.ROWS_INDEX - 1  # among the constexprs

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (plan, cache dtype, final dtype): every cast each plan kind can be asked for
CASTS = [("fused", F32, BF16), ("fused", F32, F16), ("fused", BF16, F32), ("fused", BF16, F16),
         ("fallback", F16, F32), ("fallback", F16, BF16), ("fallback", F32, BF16), ("fallback", BF16, F32),
         ("fallback", F32, F16)]
ROW = (1, 64, 1024)  # 65536 items: every 16-bit pattern fits in one row


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """Return 65536 final states of ``dtype``: every bit pattern (16-bit), or FP32 edges plus random bits."""
    if dtype != F32:
        return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    edges = []
    for base in (0x00000001, 0x00800000, 0x32FFFFFF, 0x33000000, 0x33000001, 0x387FEFFF, 0x387FF000, 0x387FFFFF,
                 0x38800000, 0x3F808000, 0x3F818000, 0x3F817FFF, 0x3F818001, 0x477FEFFF, 0x477FF000, 0x477FFFFF,
                 0x47800000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF):
        for delta in range(-2, 3):
            for sign in (0, 1 << 31):
                value = ((base + delta) & 0x7FFFFFFF) | sign
                edges.append(value - (1 << 32) if value >= 1 << 31 else value)
    for exponent in range(100, 114):  # FP16 subnormal ties and near-ties
        edges.extend((exponent << 23) | mantissa for mantissa in (0x1000, 0x3000, 0xFFF, 0x1001, 0x6000, 0x400000))
    generator = torch.Generator().manual_seed(1234)
    noise = torch.randint(-2**31, 2**31 - 1, (65536 - len(edges),), generator=generator, dtype=torch.int64)
    return torch.cat([torch.tensor(edges, dtype=torch.int32), noise.to(torch.int32)]).view(F32)


def torch_disagrees_with_itself(final: torch.dtype, cache: torch.dtype, device: torch.device) -> bool:
    """Return whether torch casts one NaN differently by where it sits in a tensor (vector vs scalar path)."""
    results = set()
    for length in (1, 3, 17, 64, 65):
        for position in (0, length - 1):
            source = torch.zeros(length, dtype=BITS[final])
            source[position] = {F32: 0x7FC00123, BF16: 0x7FC1, F16: 0x7E01}[final]
            cast = source.view(final).to(device).to(cache).view(BITS[cache])[position]
            results.add(int(cast.item()))
    return len(results) > 1


@pytest.mark.parametrize(("kind", "cache_dtype", "final"), CASTS)
def test_folded_cast_is_torch_to_bit_for_bit(device, kind, cache_dtype, final):
    cache = build_cache(device, dtype=cache_dtype, num_rows=3, inner=ROW, gap=9, offset=3)
    try:
        plan = PLAN_CLASSES[kind].prepare(cache.state, 2, final_dtypes=(final,)).seal()
    except LayoutError as exc:
        # refused only where torch's own cast of a NaN depends on its position (no kernel can match that)
        assert exc.reason == "nan_policy" and str(final) in str(exc)
        assert torch_disagrees_with_itself(final, cache_dtype, device)
        return
    patterns = every_pattern(final).view(ROW)
    packed = torch.stack([patterns, patterns.flip(-1)]).to(device)
    indices = torch.tensor([2, 0], dtype=torch.int32, device=device)
    reference = cache.clone()
    plan.scatter(cache.state, packed, indices)
    naive.scatter_states(reference.state, packed, indices)
    assert torch.equal(bits(cache.state[2]), bits(packed[0].to(cache_dtype)))  # torch's .to(), NaN/Inf included
    assert torch.equal(bits(cache.backing), bits(reference.backing))
    assert cache.gaps_untouched()


@pytest.mark.parametrize("kind", ["fused", "fallback"])
def test_unprepared_final_dtype_refused_before_launch(make_cache, device, kind, monkeypatch):
    cache = make_cache(dtype=torch.bfloat16)
    name = "model.layers.7.linear_attn"
    binding = initialize({name: cache.state}, 4, final_dtypes=(F32,))[name]
    plan = binding.plan if kind == binding.kind else PLAN_CLASSES[kind].prepare(cache.state, 4,
                                                                                final_dtypes=(F32,)).seal()
    before = cache.backing.clone()
    variant_type = type(next(iter(plan._variants.values())))
    monkeypatch.setattr(variant_type, "launch", _no_launch)
    indices = torch.tensor([1, 2], device=device)
    with pytest.raises(StateCopyRefused, match=r"torch\.bfloat16.*decided at startup") as info:
        plan.scatter(cache.state, torch.zeros((2, 2, 3, 8), dtype=BF16, device=device), indices,
                     "model.layers.7.linear_attn")
    assert info.value.reason == "final_dtype" and "model.layers.7.linear_attn" in str(info.value)
    with pytest.raises(StateCopyRefused, match=r"torch\.float64"):
        plan.scatter(cache.state, torch.zeros((2, 2, 3, 8), dtype=torch.float64, device=device), indices)
    with pytest.raises(StateCopyRefused, match="decided at startup"):  # an empty selection is no exception
        plan.scatter(cache.state, torch.zeros((0, 2, 3, 8), dtype=F16, device=device), indices[:0])
    assert torch.equal(bits(cache.backing), bits(before))
    assert get_ledger().snapshot()["facts"]["state_copy"]["last_refusal"]["reason"] == "final_dtype"


def _no_launch(*args, **kwargs):
    raise AssertionError("a refused scatter must launch nothing")


def test_initialize_final_dtypes_share_by_layout_and_set(make_cache, device):
    first, second, third, fourth = (make_cache(dtype=BF16, seed=seed) for seed in range(4))
    full = make_cache(dtype=F32)
    bindings = initialize({"a": first.state, "b": second.state, "c": third.state, "d": fourth.state,
                           "f": full.state}, 4,
                          final_dtypes={"a": (F32, BF16), "b": (BF16, F32, BF16), "c": (BF16,), "f": (BF16,)})
    assert bindings["a"].plan is bindings["b"].plan  # same layout, same set (order and repeats do not count)
    assert bindings["c"].plan is not bindings["a"].plan
    assert bindings["d"].plan is bindings["a"].plan  # left out of the mapping: the default (bfloat16, float32)
    assert bindings["a"].plan.final_dtypes == (F32, BF16) and bindings["c"].plan.final_dtypes == (BF16,)
    assert len(bindings["a"].plan.variant_names()) == 6 and len(bindings["c"].plan.variant_names()) == 4
    assert bindings["f"].plan.final_dtypes == (BF16,)  # a BF16 final into an FP32 cache only
    facts = get_ledger().snapshot()["facts"]["state_copy"]
    assert facts["a"]["final_dtypes"] == ["float32", "bfloat16"] and facts["c"]["final_dtypes"] == ["bfloat16"]
    assert facts["d"]["final_dtypes"] == ["bfloat16", "float32"] and facts["a"]["variants"] == 6
    assert [(cast["final"], cast["cache"]) for cast in facts["f"]["casts"]] == [("bfloat16", "float32")]
    assert facts["initialization"] == {"ok": True, "layers": 5, "tables": 3}
    shared = initialize({"x": first.state, "y": second.state}, 4, final_dtypes=(BF16,))
    assert shared["x"].plan is shared["y"].plan and shared["x"].plan.final_dtypes == (BF16,)
    indices = torch.tensor([3, -1, 0], device=device)
    final = torch.randn((3, 2, 3, 8), device=device)
    reference = fourth.clone()
    bindings["d"].scatter(fourth.state, final, indices)
    naive.scatter_states(reference.state, final, indices)
    assert torch.equal(bits(fourth.backing), bits(reference.backing))


def test_initialize_refuses_bad_final_dtypes_naming_the_layer(make_cache):
    cache = make_cache(dtype=BF16)
    with pytest.raises(RuntimeError, match=r"layer 'nope'.*no state") as info:
        initialize({"layer": cache.state}, 4, final_dtypes={"nope": (F32,)})
    assert "no plan was published" in str(info.value)
    with pytest.raises(RuntimeError, match=r"layer 'layer'.*float64.*no folded cast"):
        initialize({"layer": cache.state}, 4, final_dtypes=(torch.float64,))
    with pytest.raises(RuntimeError, match=r"layer 'layer'.*non-empty tuple"):
        initialize({"layer": cache.state}, 4, final_dtypes=F32)
    with pytest.raises(RuntimeError, match=r"layer 'layer'.*non-empty tuple"):
        initialize({"layer": cache.state}, 4, final_dtypes=())


def test_fake_scatter_accepts_every_final_dtype(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        state = torch.empty(4 * 60, device=device).as_strided((4, 2, 3, 8), (60, 24, 8, 1))
        indices = torch.empty(3, dtype=torch.int64, device=device)
        for final in casts.FINAL_DTYPES:
            torch.ops.kda_patches.state_scatter(state, torch.empty((3, 2, 3, 8), dtype=final, device=device),
                                                indices, "no.such.layer")
        with pytest.raises(LayoutError, match="float64") as info:
            torch.ops.kda_patches.state_scatter(state, torch.empty((3, 2, 3, 8), dtype=torch.float64,
                                                                   device=device), indices, "x")
        assert info.value.reason == "final_dtype"


def random_nans(dtype: torch.dtype, count: int, generator: torch.Generator) -> list[int]:
    """Return ``count`` random NaN bit patterns of ``dtype`` (random sign and non-zero payload)."""
    width, mantissa = {F32: (32, 23), BF16: (16, 7), F16: (16, 10)}[dtype]
    exponent = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    payloads = torch.randint(1, 1 << mantissa, (count,), generator=generator).tolist()
    signs = torch.randint(0, 2, (count,), generator=generator).tolist()
    return [(sign << (width - 1)) | exponent | payload for sign, payload in zip(signs, payloads, strict=True)]


def test_nan_rule_generalises_beyond_the_probed_patterns(device):
    # the rule is fitted at prepare on a few patterns; here it must predict torch on random other NaNs
    generator = torch.Generator().manual_seed(99)
    for final in casts.FINAL_DTYPES:
        for cache in casts.FINAL_DTYPES:
            if final == cache:
                continue
            try:
                policy = casts.probe_nan_policy(final, cache, device)
            except LayoutError:
                assert torch_disagrees_with_itself(final, cache, device)
                continue
            width = 32 if final == F32 else 16
            patterns = random_nans(final, 200, generator)
            source = torch.tensor([p - (1 << width) if p >= 1 << (width - 1) else p for p in patterns],
                                  dtype=BITS[final]).view(final).to(device)
            mask = (1 << (32 if cache == F32 else 16)) - 1
            observed = [value & mask for value in source.to(cache).view(BITS[cache]).cpu().tolist()]
            assert observed == [casts.expected_nan(p, final, cache, policy.nan_rule, policy.nan_bits)
                                for p in patterns], (final, cache)


def hardware_target(device: torch.device, pair: str):
    """Return the cache device's own target with the compiler's conversion of ``pair`` declared exact."""
    import dataclasses

    from kda_patches.state_copy.device import target_facts

    return dataclasses.replace(target_facts(device), hardware_casts=(pair,))


def test_a_declared_hardware_cast_that_differs_from_torch_keeps_the_bit_pattern_cast(device):
    # the interpreter widens some BF16 subnormals wrongly: only the proof's random patterns meet one (the scratch
    # row's fractions convert right), so the proof alone decides that the bit-pattern cast stays
    cache = build_cache(device, dtype=F32, num_rows=3, inner=ROW, gap=9, offset=3)
    plan = PLAN_CLASSES["fused"].prepare(cache.state, 2, final_dtypes=(BF16,),
                                         target=hardware_target(device, "bfloat16->float32")).seal()
    (policy,) = plan.describe()["casts"]
    if device.type == "cuda":  # a compiler whose widening is exact keeps it
        assert policy["nan"] == "hardware" and "hardware_refused" not in policy
    else:
        assert policy["nan"] == "preserve"
        assert "bfloat16 -> float32 conversion gives" in policy["hardware_refused"]
        assert "the bit-pattern cast is kept" in policy["hardware_refused"]
    patterns = every_pattern(BF16).view(ROW)
    packed = torch.stack([patterns, patterns.flip(-1)]).to(device)
    plan.scatter(cache.state, packed, torch.tensor([2, 0], dtype=torch.int64, device=device))
    assert torch.equal(bits(cache.state[2]), bits(packed[0].to(F32)))
    assert torch.equal(bits(cache.state[0]), bits(packed[1].to(F32)))
    assert cache.gaps_untouched()


def test_a_hardware_cast_that_fails_the_scratch_row_keeps_the_bit_pattern_cast_in_every_variant(device):
    if device.type == "cuda":
        pytest.skip("the compiled FP32 -> BF16 conversion is exact (test_the_sm90_hardware_cast_...)")
    cache = build_cache(device, dtype=BF16, num_rows=3, inner=ROW, gap=9, offset=3)
    plan = PLAN_CLASSES["fused"].prepare(cache.state, 2, final_dtypes=(F32,),
                                         target=hardware_target(device, "float32->bfloat16")).seal()
    (policy,) = plan.describe()["casts"]
    assert policy["nan"] == "canonical" and "failed its scratch check" in policy["hardware_refused"]
    rules = {name: values[NAN_RULE_AT] for name, values in plan.describe()["constexprs"].items() if "/scatter/" in name}
    assert len(rules) == 2 and set(rules.values()) == {str(casts.NAN_CANONICAL)}  # int32 and int64 alike
    patterns = every_pattern(F32).view(ROW)
    packed = torch.stack([patterns, patterns.flip(-1)]).to(device)
    for index_dtype in (torch.int32, torch.int64):
        plan.scatter(cache.state, packed, torch.tensor([2, 0], dtype=index_dtype, device=device))
        assert torch.equal(bits(cache.state[2]), bits(packed[0].to(BF16)))
    assert cache.gaps_untouched()


def test_an_undeclared_pair_never_takes_the_hardware_cast(device):
    cache = build_cache(device, dtype=BF16, num_rows=3, inner=(1, 4, 16), gap=9, offset=3)
    plan = PLAN_CLASSES["fused"].prepare(cache.state, 2, final_dtypes=(F32, F16),
                                         target=hardware_target(device, "float16->bfloat16")).seal()
    described = {policy["final"]: policy for policy in plan.describe()["casts"]}
    assert described["float32"]["nan"] in casts.NAN_RULES.values()
    assert "hardware_refused" not in described["float32"]
    assert described["float16"]["nan"] == "hardware" or "hardware_refused" in described["float16"]


def test_hardware_probe_bits_hold_every_nan_and_edge_then_seeded_noise():
    fp32 = casts.hardware_probe_bits(F32, 100, seed=5)
    fixed = len(casts.PROBE_NANS[F32]) + len(casts.FP32_EDGE_BITS)
    assert fp32.dtype == torch.int32 and fp32.shape == (fixed + 100,)
    unsigned = {value & 0xFFFFFFFF for value in fp32.tolist()}
    assert set(casts.PROBE_NANS[F32]) | set(casts.FP32_EDGE_BITS) <= unsigned
    assert torch.equal(fp32, casts.hardware_probe_bits(F32, 100, seed=5))
    assert not torch.equal(fp32[fixed:], casts.hardware_probe_bits(F32, 100, seed=6)[fixed:])
    bf16 = casts.hardware_probe_bits(BF16, 10)
    assert bf16.dtype == torch.int16 and bf16.shape == (len(casts.PROBE_NANS[BF16]) + 10,)


@pytest.mark.gpu
def test_the_sm90_hardware_cast_is_exact_on_every_fp32_pattern(device):
    from kda_patches.state_copy.device import PDL_MIN_CAPABILITY

    if torch.cuda.get_device_capability() < PDL_MIN_CAPABILITY:
        pytest.skip("the hardware cast is declared for SM90+ only (CUDA_PDL_TARGET)")
    rows, inner = 256, (1, 1024, 1024)  # 2**28 patterns a launch, 16 launches: every FP32 bit pattern
    cache = build_cache(device, dtype=BF16, num_rows=rows, inner=inner, gap=9, offset=3)
    # the default target of an SM90 cache: the declaration itself, with the plan's widened-scatter warps
    plan = PLAN_CLASSES["fused"].prepare(cache.state, rows, final_dtypes=(F32,), pdl=True).seal()
    (policy,) = plan.describe()["casts"]
    assert policy["nan"] == "hardware", policy
    assert {values[NAN_RULE_AT] for name, values in plan.describe()["constexprs"].items() if "/scatter/" in name} == \
        {str(casts.CAST_HARDWARE)}
    indices = torch.randperm(rows, device=device).to(torch.int32)
    span = rows * 2**20
    for start in range(-2**31, 2**31, span):
        packed = torch.arange(start, start + span, dtype=torch.int64, device=device).to(torch.int32).view(F32)
        plan.scatter(cache.state, packed.view(rows, *inner), indices)
        assert torch.equal(bits(cache.state[indices.long()]), bits(packed.view(rows, *inner).to(BF16))), start
    assert cache.gaps_untouched()
