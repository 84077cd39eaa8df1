"""The twin's 16-bit store on triton-ascend: the exact cast in row slices (``casts.cast_bits_sliced``).

Ascend A2/A3's unified buffer does not hold the exact FP32 -> BF16/FP16 cast of a whole 128 x 64 state tile beside
the FLA kernel's other state half (``docs/results/ascend-compile``); :func:`~kda_patches.indexed_chunk.derive.
twin_cast` gives the twin the sliced cast wherever the installed Triton slices tensors in a kernel.

This environment's Triton (mainline, and its interpreter) has no ``tl.extract_slice`` / ``tl.insert_slice``;
triton-ascend has both. Here they are stood in by :func:`ascend_slicing`: numpy slices with the operations'
meaning (``offsets``, ``sizes`` and ``strides`` per dimension, as MLIR's ``tensor.extract_slice`` /
``tensor.insert_slice`` that triton-ascend lowers them to), counting their calls. The cast itself, and every
other operation of the kernels, is the interpreter's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from test_indexed_chunk_kernel import make_cache, make_inputs
from triton.runtime.interpreter import TensorHandle

from kda_patches.indexed_chunk import derive
from kda_patches.indexed_chunk.derive import KernelDeclaration, derive_indexed_kernel
from kda_patches.indexed_chunk.launch import indexed_fwd_h, naive_indexed_fwd_h
from kda_patches.state_copy import casts
from kda_patches.state_copy.casts import bit_view

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CANONICAL = {BF16: 0x7FC0, F16: 0x7E00}
RULES = (casts.NAN_CANONICAL, casts.NAN_QUIET, casts.NAN_PRESERVE)


def _value(item) -> int:
    return int(getattr(item, "value", item))


def _index(offsets, sizes, strides) -> tuple[slice, ...]:
    return tuple(slice(_value(o), _value(o) + _value(s) * _value(t), _value(t))
                 for o, s, t in zip(offsets, sizes, strides, strict=True))


@pytest.fixture
def ascend_slicing(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Give ``triton.language`` triton-ascend's two slicing operations (interpreter tensors); return their call
    counts."""
    calls = {"extract": 0, "insert": 0}

    def extract_slice(ful, offsets, sizes, strides):
        calls["extract"] += 1
        data = ful.handle.data[_index(offsets, sizes, strides)].copy()
        return tl.core.tensor(TensorHandle(data, ful.handle.dtype),
                              tl.core.block_type(ful.dtype, [_value(size) for size in sizes]))

    def insert_slice(ful, sub, offsets, sizes, strides):
        calls["insert"] += 1
        data = ful.handle.data.copy()
        data[_index(offsets, sizes, strides)] = sub.handle.data
        return tl.core.tensor(TensorHandle(data, ful.handle.dtype), ful.type)

    monkeypatch.setattr(tl, "extract_slice", extract_slice, raising=False)
    monkeypatch.setattr(tl, "insert_slice", insert_slice, raising=False)
    return calls


@triton.jit
def _cast_tiles(source, out, ROWS: tl.constexpr, COLS: tl.constexpr, SLICED: tl.constexpr, SRC: tl.constexpr,
                DST: tl.constexpr, NAN_RULE: tl.constexpr, NAN_BITS: tl.constexpr):
    at = tl.program_id(0) * ROWS * COLS + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(source + at)
    if SLICED:
        bits = casts.cast_bits_sliced(x, SRC, DST, NAN_RULE, NAN_BITS)
    else:
        bits = casts.cast_bits(x, SRC, DST, NAN_RULE, NAN_BITS)
    tl.store(out + at, bits)


@triton.jit
def _cast_vectors(source, out, ITEMS: tl.constexpr, DST: tl.constexpr, NAN_RULE: tl.constexpr,
                  NAN_BITS: tl.constexpr):
    at = tl.program_id(0) * ITEMS + tl.arange(0, ITEMS)
    tl.store(out + at, casts.cast_bits_sliced(tl.load(source + at), 0, DST, NAN_RULE, NAN_BITS))


def fp32_patterns() -> torch.Tensor:
    """65536 FP32 values: every NaN and edge the hardware cast is proven on, FP16 subnormal ties, seeded noise."""
    ties = [(exponent << 23) | mantissa for exponent in range(100, 114)
            for mantissa in (0x1000, 0x3000, 0xFFF, 0x1001, 0x6000, 0x400000)]
    probe = casts.hardware_probe_bits(F32, random_count=65536 - len(ties) - len(casts.PROBE_NANS[F32])
                                      - len(casts.FP32_EDGE_BITS), seed=7)
    return torch.cat([torch.tensor(ties, dtype=torch.int32), probe]).view(F32)


def cast_tiles(values: torch.Tensor, rows: int, cols: int, sliced: bool, target: torch.dtype, rule: int,
               source: torch.dtype = F32) -> torch.Tensor:
    out = torch.zeros(values.numel(), dtype=torch.int32 if target == F32 else torch.int16)
    policy = casts.CastPolicy(source, target, rule, CANONICAL.get(target, 0) if rule == casts.NAN_CANONICAL else 0)
    _cast_tiles[(values.numel() // (rows * cols),)](values, out, rows, cols, sliced, *policy.constexprs())
    return out


def expected_bits(values: torch.Tensor, target: torch.dtype, rule: int) -> torch.Tensor:
    """torch's ``.to(target)`` bits, NaNs by ``rule`` (:func:`casts.expected_nan`)."""
    expected = bit_view(values.to(target)).clone()
    patterns = bit_view(values)
    for position in torch.nonzero(values.isnan()).flatten().tolist():
        nan = casts.expected_nan(int(patterns[position]) & 0xFFFFFFFF, F32, target, rule, CANONICAL[target])
        expected[position] = nan - (1 << 16) if nan >= 1 << 15 else nan
    return expected


def test_the_installed_triton_alone_decides_slicing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slicing needs both operations; mainline Triton has neither (this environment)."""
    assert not casts.slices_tensors() and derive.twin_cast() is casts.cast_bits
    monkeypatch.setattr(tl, "extract_slice", lambda *args: None, raising=False)
    assert not casts.slices_tensors() and derive.twin_cast() is casts.cast_bits
    monkeypatch.setattr(tl, "insert_slice", lambda *args: None, raising=False)
    assert casts.slices_tensors() and derive.twin_cast() is casts.cast_bits_sliced
    monkeypatch.delattr(tl, "extract_slice")
    assert not casts.slices_tensors() and derive.twin_cast() is casts.cast_bits


@pytest.mark.parametrize("target", [BF16, F16])
@pytest.mark.parametrize("rule", RULES, ids=[casts.NAN_RULES[rule] for rule in RULES])
def test_the_sliced_cast_is_torch_to_and_the_whole_tile_cast_bit_for_bit(ascend_slicing, target, rule) -> None:
    """128 x 64 tiles (the FLA state half), 16 rows a time: every item equals the whole-tile cast's, torch's
    ``.to()`` on every non-NaN value and the rule on every NaN."""
    values = fp32_patterns()
    sliced = cast_tiles(values, 128, 64, True, target, rule)
    assert ascend_slicing == {"extract": 8 * 8, "insert": 8 * 8}  # 8 tiles, 8 slices each
    assert torch.equal(sliced, cast_tiles(values, 128, 64, False, target, rule))
    assert torch.equal(sliced, expected_bits(values, target, rule))


@pytest.mark.parametrize(("rows", "cols", "slices"), [(64, 64, 4), (4, 2048, 4), (16, 64, 0), (8, 32, 0)])
def test_a_slice_is_whole_rows_of_at_most_slice_items(ascend_slicing, rows, cols, slices) -> None:
    """``SLICE_ITEMS // cols`` rows a slice (one row when a row is longer); a tile of at most one slice is cast
    whole."""
    values = fp32_patterns()
    tiles = values.numel() // (rows * cols)
    sliced = cast_tiles(values, rows, cols, True, F16, casts.NAN_QUIET)
    assert ascend_slicing == {"extract": tiles * slices, "insert": tiles * slices}
    assert torch.equal(sliced, expected_bits(values, F16, casts.NAN_QUIET))


@pytest.mark.parametrize(("source", "target", "rule"), [(F32, F32, casts.NAN_QUIET), (F32, BF16, casts.CAST_HARDWARE),
                                                        (BF16, F16, casts.NAN_CANONICAL)])
def test_any_other_cast_is_the_whole_tile_cast(ascend_slicing, source, target, rule) -> None:
    """An FP32 destination, the compiler's conversion and a 16-bit source are never sliced."""
    values = fp32_patterns()[:128 * 64 * 2].to(source)
    sliced = cast_tiles(values, 128, 64, True, target, rule, source)
    assert ascend_slicing == {"extract": 0, "insert": 0}
    assert torch.equal(sliced, cast_tiles(values, 128, 64, False, target, rule, source))


def test_a_tile_that_is_not_2d_is_cast_whole(ascend_slicing) -> None:
    values = fp32_patterns()
    out = torch.zeros(values.numel(), dtype=torch.int16)
    _cast_vectors[(values.numel() // 8192,)](values, out, 8192, *casts.CastPolicy(F32, F16, casts.NAN_PRESERVE)
                                             .constexprs()[1:])
    assert ascend_slicing == {"extract": 0, "insert": 0}
    assert torch.equal(out, expected_bits(values, F16, casts.NAN_PRESERVE))


@pytest.mark.parametrize(("items", "slices"), [(32 * 64, 4), (3 * 64, 0)])
def test_rows_that_do_not_split_into_whole_slices_are_cast_whole(ascend_slicing, monkeypatch, items, slices) -> None:
    """128 rows split into slices of 32 rows, not of 3 (Triton's power-of-two shapes and the power-of-two
    ``SLICE_ITEMS`` never meet this guard in a kernel; a slice size of the test's own reaches it)."""
    monkeypatch.setattr(casts, "SLICE_ITEMS", tl.constexpr(items))
    values = fp32_patterns()[:128 * 64 * 2]
    sliced = cast_tiles(values, 128, 64, True, BF16, casts.NAN_PRESERVE)
    assert ascend_slicing == {"extract": 2 * slices, "insert": 2 * slices}
    assert torch.equal(sliced, expected_bits(values, BF16, casts.NAN_PRESERVE))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_a_twin_derived_where_triton_slices_stores_as_the_naive_twin(ascend_slicing, dtype) -> None:
    """vLLM 0.34.0's chunk-state kernel (masked pointers: runs in the interpreter) derived with slicing available:
    its final store casts in slices and every cache byte equals gather -> release host -> scatter."""
    import fla_interpreter
    import fla_release

    from kda_patches.indexed_chunk.launch import DEFAULT_CONFIG

    module = fla_release.load_fla_module("0.34.0", "chunk_delta_h")
    fla_interpreter.fix_for_interpreter(module, DEFAULT_CONFIG)
    derived = derive_indexed_kernel(module, KernelDeclaration(
        module=module.__name__, kernel="chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
        host="chunk_gated_delta_rule_fwd_h"))
    generator = torch.Generator().manual_seed(17)
    inputs = make_inputs(generator, [1, 64, 70])
    cache, storage = make_cache(generator, 5, dtype, padding=8)
    cache[2].view(-1)[::97] = float("nan")  # a NaN initial state: NaN finals take the probed rule's bits
    rows = torch.tensor([2, 4, 0], dtype=torch.int64)
    flags = torch.tensor([True, True, False])
    naive_storage = storage.clone()
    naive_cache = naive_storage.as_strided(cache.shape, cache.stride())
    twin = indexed_fwd_h(derived, cache, rows, flags, **inputs)
    assert ascend_slicing["extract"] > 0 and ascend_slicing["extract"] == ascend_slicing["insert"]
    reference = naive_indexed_fwd_h(derived, naive_cache, rows, flags, **inputs)
    assert torch.equal(bit_view(twin[0]), bit_view(reference[0]))  # h (NaN-carrying where the state was)
    assert bool(np.isnan(cache[2].float().numpy()).any())
    assert torch.equal(bit_view(storage), bit_view(naive_storage))
