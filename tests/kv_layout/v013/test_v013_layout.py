"""Real vLLM 0.13.0: the checker against upstream's and the seed's layouts, the corruption the seed's
unconditional layouts cause, and the patch's accepted layouts (no copy, every (layer, block, state) round-trips).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from runner013 import build_runner, reshape

from kda_patches.kv_layout import views as V
from kda_patches.kv_layout.checker import check_footprints
from kda_patches.kv_layout.era013 import describe_entries
from kda_patches.ledger import get_ledger


def _storage_footprints(entries: list[Any], proposal: str) -> dict[Any, list[Any]]:
    """Footprints per storage under ``upstream`` or under the seed's unconditional ``seed`` layout."""
    storages: dict[Any, list[Any]] = {}
    for entry in entries:
        fps = entry.footprints
        if proposal == "seed":
            fps = entry.dense_proposal or entry.contiguous_proposal or fps
        storages.setdefault(entry.storage, []).extend(fps)
    return storages


def _seed_views(config: Any, kv: dict[str, Any]) -> dict[str, Any]:
    """The seed's layouts built for real: dense states in the shared raw tensor, K/V re-stride skipped."""
    out = {}
    for entry in describe_entries(config, kv):
        if entry.kind == "state":
            out[entry.name] = entry.make_dense()
        else:
            out[entry.name] = entry.make_contiguous()
    return out


def _fill_and_verify(config: Any, kv: dict[str, Any], owner_of_block: dict[int, int]) -> list[str]:
    """Write a distinct pattern per (layer, block, state) for the blocks each group owns; return mismatches."""
    from kda_patches.kv_layout.plan import layer_specs

    specs = layer_specs(config)
    writes = []
    for name, value in kv.items():
        group = specs[name][0]
        states = list(value) if isinstance(value, (list, tuple)) else [value[0], value[1]]
        for block, owner in owner_of_block.items():
            if owner != group:
                continue
            for index, state in enumerate(states):
                pattern = float((hash((name, block, index)) % 1000) + 1)
                state[block].fill_(pattern)
                writes.append((name, block, index, state, pattern))
    return [f"{name} block {block} state {index}" for name, block, index, state, pattern in writes
            if not torch.all(state[block] == pattern)]


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_checker_rejects_seed_layouts_on_shared_storage(conv_layout: str) -> None:
    runner, config, kbs = build_runner(2, 2, conv_layout=conv_layout)
    kv = reshape(runner, config, kbs)
    entries = describe_entries(config, kv)
    for fps in _storage_footprints(entries, "upstream").values():
        assert check_footprints(fps).safe
    for fps in _storage_footprints(entries, "seed").values():
        verdict = check_footprints(fps)
        assert verdict.status == "rejected"
        assert verdict.witness["a"]["block"] != verdict.witness["b"]["block"]


def test_seed_layouts_really_corrupt_another_groups_block() -> None:
    runner, config, kbs = build_runner(2, 2)
    kv = reshape(runner, config, kbs)
    # The block pool hands different block ids to different groups: group 0 (GDN) and 1 (attention).
    owner = {block: block % 2 for block in range(1, config.num_blocks)}
    assert _fill_and_verify(config, kv, owner) == []
    bad = _fill_and_verify(config, _seed_views(config, kv), owner)
    assert bad, "the seed's unconditional layout should overwrite another group's block"


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_state_only_storage_gets_dense_views_in_place(patched: Any, conv_layout: str) -> None:
    runner, config, kbs = build_runner(0, 2, conv_layout=conv_layout)
    raw_ptrs = {t.shared_by[0]: None for t in config.kv_cache_tensors}
    kv = reshape(runner, config, kbs)
    for name, states in kv.items():
        assert all(V.is_dense_state(state) for state in states)
        raw_ptrs[name] = {state.untyped_storage().data_ptr() for state in states}
        assert len(raw_ptrs[name]) == 1  # one storage: the raw tensor, no copy
        assert get_ledger().snapshot()["facts"]["kv_cache_layout"][name]["decision"] == "dense-in-place"
    assert len({ptr for ptrs in raw_ptrs.values() for ptr in ptrs}) == len(kv)
    owner = {block: 0 for block in range(config.num_blocks)}
    assert _fill_and_verify(config, kv, owner) == []
    expected = [tuple(s) for s in config.kv_cache_groups[0].kv_cache_spec.shapes]
    assert [tuple(state.shape[1:]) for state in next(iter(kv.values()))] == expected


def test_hybrid_auto_mode_keeps_upstream_and_says_why(patched: Any) -> None:
    runner, config, kbs = build_runner(2, 2)
    kv = reshape(runner, config, kbs)
    facts = get_ledger().snapshot()["facts"]["kv_cache_layout"]
    for name, value in kv.items():
        assert facts[name]["decision"] == "upstream"
        assert facts[name]["verdict"] == "rejected"
        if isinstance(value, list):
            assert value[0].stride(0) == config.kv_cache_groups[0].kv_cache_spec.page_size_bytes // 2
        else:
            assert V.is_hybrid_restrided(value)


def test_separate_mode_moves_states_out_and_makes_attention_contiguous(patched: Any) -> None:
    from kda_patches.kv_layout.budget import stamp_reservation

    patched("separate")
    runner, config, kbs = build_runner(2, 2)
    stamp = stamp_reservation(config)
    assert stamp["layers"] == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    kv = reshape(runner, config, kbs)
    facts = get_ledger().snapshot()["facts"]["kv_cache_layout"]
    pools = {t.shared_by[0]: t for t in config.kv_cache_tensors}
    for name, value in kv.items():
        if isinstance(value, list):
            assert facts[name]["decision"] == "separate"
            assert all(V.is_dense_state(state) for state in value)
        else:
            assert facts[name]["decision"] == "contiguous" and facts[name]["verdict"] == "accepted"
            assert value[0].is_contiguous() and value[1].is_contiguous()
            assert value[0].contiguous().data_ptr() == value[0].data_ptr()  # .contiguous() is a no-op
    assert pools and facts["summary"]["separate_bytes"] == stamp["bytes_per_block"] * config.num_blocks
    owner = {block: block % 2 for block in range(1, config.num_blocks)}
    assert _fill_and_verify(config, kv, owner) == []


def test_standalone_update_hybrid_layout_is_checked(patched: Any) -> None:
    runner, config, kbs = build_runner(2, 2)
    raw = runner._allocate_kv_cache_tensors(config)
    kv = runner._reshape_kv_cache_tensors(config, raw, kbs)
    runner._update_hybrid_attention_mamba_layout(kv)  # called on its own, as forks do
    facts = get_ledger().snapshot()["facts"]["kv_cache_layout"]
    assert facts["model.layers.1.self_attn.attn"]["decision"] == "upstream"
    assert V.is_hybrid_restrided(kv["model.layers.1.self_attn.attn"])
