"""Each verdict of the Ascend layout table decided by a synthetic case (``kda_patches.kv_layout.ascend_proof``).

The views are real torch views on a CPU storage, shaped like the fork's: block-first, page-interleaved states
(``_adjust_kv_layout``: ``stride(0)`` = the page), dense per-state or K/V slabs (0.26-0.29's slices, 0.30's MLA
latent/RoPE slabs), kernel-block splits. The checker's three rules, the harness's verdict order and the witness
bytes are checked; an overlap's witness is then reproduced by writing through one view and reading the other.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from kda_patches.kv_layout import ascend_table, checker
from kda_patches.kv_layout.ascend_verdict import describe_views, prove, run_case, verdict_of
from kda_patches.kv_layout.checker import Footprint

PAGE, BLOCKS = 64, 8


def config(*groups: list[str]) -> SimpleNamespace:
    return SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[SimpleNamespace(layer_names=g) for g in groups])


def pages(raw: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """Bytes ``[start, start + width)`` of every page: the page-interleaved view ``_adjust_kv_layout`` builds."""
    return raw.view(BLOCKS, PAGE)[:, start:start + width]


def test_aligned_pages_of_two_groups_are_proven() -> None:
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    views = {"attn": (pages(raw, 0, 32), pages(raw, 32, 32)), "gdn": [pages(raw, 0, 16), pages(raw, 16, 40)]}
    verdict, detail, storages, num_views = prove(config(["attn"], ["gdn"]), views)
    assert (verdict, detail, storages, num_views) == ("proven", "", 1, 4)


def test_dense_slab_beside_page_interleaved_states_overlaps_and_the_witness_is_real() -> None:
    """0.30's MLA pattern: K/V dense slabs from byte 0, the state layer's pages over the same bytes."""
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    k = raw[:BLOCKS * 48].view(BLOCKS, 48)
    v = raw[BLOCKS * 48:BLOCKS * 64].view(BLOCKS, 16)
    views = {"mla": (k, v), "kda": [pages(raw, 0, 16), pages(raw, 16, 40)]}
    verdict, detail, _, _ = prove(config(["mla"], ["kda"]), views)
    assert verdict == "overlap found"
    sides = re.findall(r"`(\w+)` (\w+) block (\d+) \(group \d\) bytes \[(\d+), (\d+)\)", detail)
    shared = int(re.search(r"share byte (\d+)", detail).group(1))
    assert len(sides) == 2 and sides[0][2] != sides[1][2], detail  # two different block ids
    for _, _, _, lo, hi in sides:
        assert int(lo) <= shared < int(hi)
    # reproduce it: a write through one side's view lands in the other side's block
    named = {("mla", "k"): k, ("mla", "v"): v, ("kda", "state0"): views["kda"][0], ("kda", "state1"): views["kda"][1]}
    (layer_a, state_a, block_a, _, _), (layer_b, state_b, block_b, _, _) = sides
    named[(layer_a, state_a)][int(block_a)].fill_(7)
    assert (named[(layer_b, state_b)][int(block_b)] == 7).any()


def test_two_layers_of_one_group_on_the_same_bytes_overlap() -> None:
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    views = {"gdn.0": [pages(raw, 0, 16)], "gdn.1": [pages(raw, 8, 16)]}
    verdict, detail, _, _ = prove(config(["gdn.0", "gdn.1"]), views)
    assert verdict == "overlap found" and "block 0 (group 0)" in detail and detail.count("block 0") == 2


def test_layers_of_different_groups_may_share_a_block_id() -> None:
    """The hybrid allocator's overlay: block b of group 0 and block b of group 1 are never live together."""
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    views = {"gdn.0": [pages(raw, 0, 64)], "attn.0": (pages(raw, 0, 32), pages(raw, 32, 32))}
    assert prove(config(["attn.0"], ["gdn.0"]), views)[0] == "proven"


def test_kernel_block_split_rows_belong_to_their_block_id() -> None:
    """0.30's attention view: two kernel blocks of PAGE/2 per block id, aligned with the state pages."""
    raw = torch.zeros(BLOCKS * PAGE // 2, dtype=torch.bfloat16)  # PAGE bytes = PAGE // 2 elements per block id
    kv = torch.as_strided(raw, (2, BLOCKS * 2, 4, 2), (8, 16, 2, 1))  # K/V interleaved per kernel block
    states = [torch.as_strided(raw, (BLOCKS, 8), (PAGE // 2, 1))]
    views = {"attn": (kv[0], kv[1]), "gdn": states}
    storages = describe_views(config(["attn"], ["gdn"]), views)
    (nbytes, footprints), = storages.values()
    assert nbytes == BLOCKS * PAGE
    k = next(fp for fp in footprints if fp.state == "k")
    assert (k.stride, k.num_blocks, k.runs) == (PAGE, BLOCKS, ((0, 16), (32, 16)))
    assert verdict_of(storages)[0] == "proven"


def test_out_of_storage_is_its_own_verdict() -> None:
    footprints = [Footprint("gdn", "state0", 0, base=PAGE * (BLOCKS - 1), stride=PAGE, num_blocks=2,
                            runs=((0, 16),))]
    verdict, detail, _, _ = verdict_of({"storage": (BLOCKS * PAGE, footprints)})
    assert verdict == "out of storage" and "outside the storage" in detail


def test_an_overlap_outranks_an_unproven_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    overlapping = [Footprint("a", "s", 0, 0, PAGE, BLOCKS, ((0, PAGE + 1),))]
    fine = [Footprint("b", "s", 0, 0, PAGE, BLOCKS, ((0, 8), (16, 8), (32, 8)))]
    monkeypatch.setattr(checker, "MAX_RUNS", 2)
    verdict, detail, _, _ = verdict_of({"x": (BLOCKS * PAGE * 2, fine), "y": (BLOCKS * PAGE * 2, overlapping)})
    assert verdict == "overlap found", detail
    verdict, detail, _, _ = verdict_of({"x": (BLOCKS * PAGE * 2, fine)})
    assert verdict == "not checkable" and detail.startswith("checker: 3 byte runs")


def test_rows_that_are_not_whole_block_ids_cannot_be_described() -> None:
    raw = torch.zeros(BLOCKS * PAGE + PAGE, dtype=torch.int8)
    with pytest.raises(ValueError, match="9 rows is not a multiple of 8 blocks"):
        describe_views(config(["gdn"]), {"gdn": [raw.view(BLOCKS + 1, PAGE)]})


def test_release_code_that_stops_is_not_checkable_with_its_release_line(monkeypatch: pytest.MonkeyPatch) -> None:
    code = compile("\n\ndef reshape():\n    raise AttributeError('runner has no use_widget')\n",
                   "/cache/releases/vllm-ascend-9.9/vllm_ascend/worker/model_runner_v1.py", "exec")
    namespace: dict = {}
    exec(code, namespace)

    class Stack:
        def run(self, model: dict, tp: int) -> None:
            namespace["reshape"]()

    result = run_case(Stack(), "Qwen3-Next-80B", 1)  # type: ignore[arg-type]
    assert result.verdict == "not checkable"
    assert result.detail == ("AttributeError: runner has no use_widget "
                             "(vllm_ascend/worker/model_runner_v1.py:4)")


def test_committed_readme_comparison_ignores_only_dates() -> None:
    assert ascend_table.same_but_date("x 2026-12-07 y", "x 2027-01-31 y")
    assert not ascend_table.same_but_date("x 2026-12-07 proven", "x 2026-12-07 overlap found")
