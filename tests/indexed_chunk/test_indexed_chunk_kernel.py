"""The indexed twin of vLLM's chunk-state kernel, derived from the released source, against its naive twin.

Released code executed (interpreter): vLLM 0.33.0's and 0.34.0's vendored FLA ``chunk_delta_h.py`` (masked
pointers; 0.26-0.31's block-pointer form is derived here but runs only where Triton still has block pointers) -- the
derived twin and the release's own ``chunk_gated_delta_rule_fwd_h`` between a naive gather and scatter.
Every cache byte is compared bit for bit (NaN-poisoned rows, row padding included).
"""

from __future__ import annotations

import fla_interpreter
import fla_release
import pytest
import torch

from kda_patches.indexed_chunk.derive import KernelDeclaration, derive_indexed_kernel
from kda_patches.indexed_chunk.launch import (
    DEFAULT_CONFIG,
    IndexedCallRefused,
    indexed_fwd_h,
    naive_indexed_fwd_h,
)
from kda_patches.state_copy.casts import bit_view

KERNEL = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
RELEASES = ("0.33.0", "0.34.0")
BLOCK_POINTER_RELEASES = ("0.26.0", "0.30.0")
_derived: dict[str, object] = {}


def derived_for(version: str):
    if version not in _derived:
        module = fla_release.load_fla_module(version, "chunk_delta_h")
        fla_interpreter.fix_for_interpreter(module, DEFAULT_CONFIG)
        _derived[version] = derive_indexed_kernel(module, KernelDeclaration(
            module=module.__name__, kernel=KERNEL, host="chunk_gated_delta_rule_fwd_h"))
    return _derived[version]


def make_inputs(generator: torch.Generator, lengths: list[int], heads: int = 4, key_heads: int = 2,
                key_dim: int = 64, value_dim: int = 64, gated_keys: bool = False) -> dict:
    tokens = sum(lengths)
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)

    def draw(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    inputs = {"k": draw(1, tokens, key_heads, key_dim, scale=0.1), "w": draw(1, tokens, heads, key_dim, scale=0.1),
              "u": draw(1, tokens, heads, value_dim), "cu_seqlens": torch.tensor(starts, dtype=torch.int32)}
    if gated_keys:
        inputs["gk"] = -torch.rand(1, tokens, heads, key_dim, generator=generator).cumsum(1) * 0.01
    else:
        inputs["g"] = -torch.rand(1, tokens, heads, generator=generator).cumsum(1) * 0.01
    return inputs


def make_cache(generator: torch.Generator, rows: int, dtype: torch.dtype, heads: int = 4, value_dim: int = 64,
               key_dim: int = 64, padding: int = 0) -> torch.Tensor:
    """A ``[rows, H, V, K]`` cache whose rows are ``padding`` items apart beyond the payload; every row random,
    the padding NaN-poisoned."""
    payload = heads * value_dim * key_dim
    storage = torch.full((rows, payload + padding), float("nan"), dtype=dtype)
    storage[:, :payload] = torch.randn(rows, payload, generator=generator).to(dtype)
    return storage[:, :payload].view(rows, heads, value_dim, key_dim), storage


def run_both(version: str, cache_storage, cache, rows, flags, inputs, **extra):
    derived = derived_for(version)
    naive_storage = cache_storage.clone()
    naive_cache = naive_storage.as_strided(cache.shape, cache.stride())
    twin = indexed_fwd_h(derived, cache, rows, flags, **inputs, **extra)
    reference = naive_indexed_fwd_h(derived, naive_cache, rows, flags, **inputs, **extra)
    return twin, reference, naive_storage


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_twin_equals_gather_release_scatter(version: str, dtype: torch.dtype) -> None:
    """1-token, chunk-boundary (64) and multi-chunk prefills; a flag-false row, rows -1 and N (read zeros, store
    nothing), padded rows: h, v_new and every cache byte equal the naive twin's."""
    generator = torch.Generator().manual_seed(hash((version, str(dtype))) % 2**31)
    lengths = [1, 64, 70, 5, 3]
    inputs = make_inputs(generator, lengths)
    cache, storage = make_cache(generator, 9, dtype, padding=24)
    rows = torch.tensor([3, 7, -1, 0, 9], dtype=torch.int64)
    flags = torch.tensor([True, False, True, True, True])
    before = storage.clone()
    twin, reference, naive_storage = run_both(version, storage, cache, rows, flags, inputs)
    assert torch.equal(twin[0], reference[0]) and torch.equal(twin[1], reference[1])
    assert twin[2] is None
    assert torch.equal(bit_view(storage), bit_view(naive_storage))
    written = {3, 7, 0}
    untouched = [row for row in range(9) if row not in written]
    assert torch.equal(bit_view(storage[untouched]), bit_view(before[untouched]))
    assert torch.equal(bit_view(storage[:, -24:]), bit_view(before[:, -24:]))  # padding: never touched
    assert not torch.equal(storage[3], before[3]) and not torch.equal(storage[7], before[7])


@pytest.mark.parametrize("version", RELEASES)
def test_gated_keys_and_int32_rows(version: str) -> None:
    """The KDA form (per-key gates ``gk``, Kimi's prefill) and int32 rows without flags (every row read)."""
    generator = torch.Generator().manual_seed(11)
    inputs = make_inputs(generator, [33, 2], gated_keys=True)
    cache, storage = make_cache(generator, 4, torch.float32)
    rows = torch.tensor([2, 1], dtype=torch.int32)
    twin, reference, naive_storage = run_both(version, storage, cache, rows, None, inputs)
    assert torch.equal(twin[0], reference[0]) and torch.equal(storage, naive_storage)


def test_flag_decides_the_read() -> None:
    """A flag alone decides whether the cached state is read: the same call with the flag flipped gives other
    final states, and a flag-false row's final state does not depend on what the cache held."""
    generator = torch.Generator().manual_seed(5)
    inputs = make_inputs(generator, [6])
    rows = torch.tensor([1])
    results = []
    for flag, fill in ((True, 1.0), (False, 1.0), (False, -3.0)):
        cache, _ = make_cache(generator, 2, torch.float32)
        cache.fill_(fill)
        indexed_fwd_h(derived_for("0.34.0"), cache, rows, torch.tensor([flag]), **inputs)
        results.append(cache[1].clone())
    assert not torch.equal(results[0], results[1])
    assert torch.equal(results[1], results[2])


def test_refusals_name_the_argument() -> None:
    """An initial_state of the call's own, a cache of other heads, a cache whose rows are not contiguous inside,
    rows of the wrong length and non-bool flags are each refused before anything is launched."""
    generator = torch.Generator().manual_seed(3)
    inputs = make_inputs(generator, [4, 4])
    derived = derived_for("0.34.0")
    cache, _ = make_cache(generator, 3, torch.float32)
    rows = torch.tensor([0, 1])
    cases = {
        "initial_state": dict(args=(cache, rows, None), extra={"initial_state": torch.zeros(2, 4, 64, 64)}),
        "cache: shape": dict(args=(cache[:, :2], rows, None), extra={}),
        "cache: strides": dict(args=(cache.transpose(2, 3), rows, None), extra={}),
        "rows:": dict(args=(cache, torch.tensor([0]), None), extra={}),
        "flags:": dict(args=(cache, rows, torch.tensor([1, 0])), extra={}),
    }
    for expected, case in cases.items():
        snapshot = cache.clone()
        with pytest.raises(IndexedCallRefused, match=expected):
            indexed_fwd_h(derived, *case["args"], **inputs, **case["extra"])
        assert torch.equal(cache, snapshot)
