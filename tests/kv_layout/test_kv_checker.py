"""The aliasing checker against a byte-by-byte brute force, and its cost at 100k blocks."""

from __future__ import annotations

import time

import pytest
from hypothesis import example, given, settings
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


def fp(name: str, group: int, base: int, stride: int, blocks: int, *runs: tuple[int, int]) -> Footprint:
    return Footprint(name, "s", group, base, stride, blocks, runs)


# Boundary cases, each with its expected verdict worked out by hand (bytes in the comments). The order of the
# footprints matters: the checker's candidate filter compares ``lo`` of the earlier one with ``hi`` of the later.
BOUNDARY_CASES = {
    # A [0,4), B [4,8), one group: adjacent, no byte shared
    "adjacent_same_group": ([fp("A", 0, 0, 0, 1, (0, 4)), fp("B", 0, 4, 0, 1, (0, 4))], True),
    # A [4,8) starts on B's last byte [0,5): one byte shared within one group (A listed first)
    "one_byte_overlap_later_ends_there": ([fp("A", 0, 4, 0, 1, (0, 4)), fp("B", 0, 0, 0, 1, (0, 5))], False),
    # the same two, B listed first
    "one_byte_overlap_earlier_ends_there": ([fp("B", 0, 0, 0, 1, (0, 5)), fp("A", 0, 4, 0, 1, (0, 4))], False),
    # A [0,4) and B [3,7): overlap of one byte again, other direction of the filter
    "one_byte_overlap_start": ([fp("A", 0, 0, 0, 1, (0, 4)), fp("B", 0, 3, 0, 1, (0, 4))], False),
    # same block id in two groups on the same bytes: what the hybrid allocator relies on
    "same_block_two_groups": ([fp("A", 0, 0, 8, 3, (0, 8)), fp("B", 1, 0, 8, 3, (0, 8))], True),
    # equal strides 8, A block b = [8b, 8b+8), B block c = [8c+8, 8c+12): B block 0 is A block 1 (k = -1)
    "equal_stride_next_block": ([fp("A", 0, 0, 8, 2, (0, 8)), fp("B", 1, 8, 8, 2, (0, 4))], False),
    # equal strides 8, A block b = [8b, 8b+4), B block c = [8c+4, 8c+8): halves of one page, touching only
    "equal_stride_touching_halves": ([fp("A", 0, 0, 8, 3, (0, 4)), fp("B", 0, 4, 8, 3, (0, 4))], True),
    # equal strides 8, B [8c+3, 8c+7) reaches one byte into A's half [8b, 8b+4): same block, one group
    "equal_stride_one_byte_into_half": ([fp("A", 0, 0, 8, 3, (0, 4)), fp("B", 0, 3, 8, 3, (0, 4))], False),
    # unequal strides: A [8b, 8b+4) b<3, B [12c+4, 12c+8) c<2: B block 1 [16,20) is A block 2
    "unequal_stride_overlap": ([fp("A", 0, 0, 8, 3, (0, 4)), fp("B", 1, 4, 12, 2, (0, 4))], False),
    # unequal strides: A [0,4),[8,12); B [4,8),[20,24): never shared
    "unequal_stride_disjoint": ([fp("A", 0, 0, 8, 2, (0, 4)), fp("B", 1, 4, 16, 2, (0, 4))], True),
    # last byte of the storage (160): A block 19 ends exactly there, B one byte past it
    "ends_at_storage_end": ([fp("A", 0, 0, 8, 20, (0, 8))], True),
    "one_byte_past_storage_end": ([fp("A", 0, 0, 8, 19, (0, 8)), fp("B", 1, 153, 0, 1, (0, 8))], False),
}


@pytest.mark.parametrize("name", sorted(BOUNDARY_CASES))
def test_checker_boundary_cases(name: str) -> None:
    fps, expected = BOUNDARY_CASES[name]
    assert brute_force_safe(fps, STORAGE) is expected  # the hand derivation agrees with the byte painter
    verdict = check_footprints(fps, STORAGE)
    assert verdict.safe is expected, verdict


def _with_boundary_examples(test):
    for name in sorted(BOUNDARY_CASES):
        test = example(BOUNDARY_CASES[name][0])(test)
    return test


@settings(max_examples=400, deadline=None)
@given(footprints())
@_with_boundary_examples
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
