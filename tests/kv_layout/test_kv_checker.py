"""The aliasing checker against a byte-by-byte brute force, and its cost at 100k blocks."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from kda_patches.kv_layout.checker import CheckerCache, Footprint, check_footprints

STORAGE = 160


def brute_force_safe(footprints: list[Footprint], nbytes: int) -> bool:
    """Paint every byte with its (footprint, block, group) owners and apply the three rules directly."""
    owners: dict[int, list[tuple[int, int, int]]] = {}
    for index, fp in enumerate(footprints):
        for block in range(fp.num_blocks):
            for start, end in fp.block_bytes(block):
                if start < 0 or end > nbytes:
                    return False
                for byte in range(start, end):
                    for _, other_block, other_group in owners.get(byte, []):
                        if other_block != block or other_group == fp.group:
                            return False
                    owners.setdefault(byte, []).append((index, block, fp.group))
    return True


@st.composite
def footprints(draw: st.DrawFn) -> list[Footprint]:
    result = []
    for index in range(draw(st.integers(1, 4))):
        runs, cursor = [], draw(st.integers(0, 6))
        for _ in range(draw(st.integers(1, 3))):
            length = draw(st.integers(1, 6))
            runs.append((cursor, length))
            cursor += length + draw(st.integers(0, 6))
        result.append(Footprint(f"layer{index}", "s", draw(st.integers(0, 2)), draw(st.integers(0, 40)),
                                draw(st.sampled_from([0, 1, 2, 3, 5, 8, 12, 16, 24])), draw(st.integers(0, 8)),
                                tuple(runs)))
    return result


@settings(max_examples=400, deadline=None)
@given(footprints())
def test_checker_matches_brute_force(fps: list[Footprint]) -> None:
    verdict = check_footprints(fps, STORAGE)
    assert verdict.safe == brute_force_safe(fps, STORAGE), verdict
    if verdict.status == "rejected" and verdict.witness and "owners" in verdict.witness:
        a, b = verdict.witness["a"], verdict.witness["b"]
        assert a["block"] != b["block"] or a["group"] == b["group"]


# Qwen3.6-27B-like, per TP4 rank: GDN 12 value / 4 key heads of 128 -> conv (3, 2560) bf16, ssm (12, 128, 128)
# fp32; full attention 1 KV head of 256 in bf16 -> 1024 bytes per token, block of 784 tokens -> page 802816.
QWEN36_CONV_BYTES, QWEN36_SSM_BYTES, QWEN36_PAGE = 3 * 2560 * 2, 12 * 128 * 128 * 4, 784 * 1024


def _hybrid_storage(num_blocks: int, dense: bool) -> list[Footprint]:
    """One 0.13-style raw tensor of a Qwen3.6-27B-like TP4 rank: 1 attention + 3 GDN layers sharing pages."""
    conv, ssm = QWEN36_CONV_BYTES, QWEN36_SSM_BYTES
    page = QWEN36_PAGE
    fps = [Footprint("attn", "kv", 0, 0, page, num_blocks, ((0, page),))]
    for gdn in range(3):
        if dense:
            fps += [Footprint(f"gdn{gdn}", "conv", gdn + 1, 0, conv, num_blocks, ((0, conv),)),
                    Footprint(f"gdn{gdn}", "ssm", gdn + 1, num_blocks * conv, ssm, num_blocks, ((0, ssm),))]
        else:
            fps += [Footprint(f"gdn{gdn}", "conv", gdn + 1, 0, page, num_blocks, ((0, conv),)),
                    Footprint(f"gdn{gdn}", "ssm", gdn + 1, conv, page, num_blocks, ((0, ssm),))]
    return fps


def test_checker_cost_at_100k_blocks() -> None:
    """Measured (printed with -s), not asserted: 16 identical raw tensors at 100k blocks each."""
    num_blocks = 100_000
    cache = CheckerCache()
    began = time.perf_counter()
    for _ in range(16):
        assert cache.check(_hybrid_storage(num_blocks, dense=False), None).safe
    upstream_s = time.perf_counter() - began
    began = time.perf_counter()
    verdict = check_footprints(_hybrid_storage(num_blocks, dense=True), None)
    rejected_s = time.perf_counter() - began
    assert verdict.status == "rejected"
    conv, ssm = QWEN36_CONV_BYTES, QWEN36_SSM_BYTES
    state_only = [Footprint("gdn", "conv", 0, 0, conv, num_blocks, ((0, conv),)),
                  Footprint("gdn", "ssm", 0, num_blocks * conv, ssm, num_blocks, ((0, ssm),))]
    began = time.perf_counter()
    assert check_footprints(state_only, None).safe
    accepted_dense_s = time.perf_counter() - began
    print(f"\ncheck 16 storages x 100k blocks upstream: {upstream_s * 1e3:.1f} ms (cache hits {cache.hits}); "
          f"reject dense-in-shared: {rejected_s * 1e3:.1f} ms; "
          f"accept dense state-only: {accepted_dense_s * 1e3:.1f} ms")


def test_unequal_stride_pairs_over_budget_are_unproven() -> None:
    fps = [Footprint("a", "s", 0, 0, 8, 1000, ((0, 4),)), Footprint("b", "s", 0, 4, 12, 1000, ((0, 4),))]
    assert check_footprints(fps, None, max_pair_work=10).status == "unproven"
