"""Real vLLM 0.32: ``allocate_kv_cache`` views through the patch, bound by the real ``MambaBase.bind_kv_cache``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers032 import allocate, build_config, make_gdn_layer

from kda_patches.kv_layout import views as V
from kda_patches.kv_layout.budget import reduced_memory, stamp_reservation
from kda_patches.kv_layout.checker import check_footprints
from kda_patches.kv_layout.era032 import describe_entries
from kda_patches.ledger import get_ledger


def _facts() -> dict[str, Any]:
    return get_ledger().snapshot()["facts"]["kv_cache_layout"]


def _bind_all(config: Any, kv: dict[str, Any]) -> dict[str, tuple[torch.Tensor, ...]]:
    bound = {}
    for group in config.kv_cache_groups:
        if not hasattr(group.kv_cache_spec, "shapes"):
            continue
        for name in group.layer_names:
            layer = make_gdn_layer(group.kv_cache_spec)
            layer.bind_kv_cache(kv[name])
            bound[name] = layer.kv_cache
    return bound


def _round_trip(bound: dict[str, tuple[torch.Tensor, ...]], num_blocks: int) -> None:
    """Every (layer, block, state) keeps the pattern written through its own view."""
    for name, states in bound.items():
        for block in range(num_blocks):
            for index, state in enumerate(states):
                state[block].fill_(float((hash((name, block, index)) % 512) + 1))
    for name, states in bound.items():
        for block in range(num_blocks):
            for index, state in enumerate(states):
                assert torch.all(state[block] == float((hash((name, block, index)) % 512) + 1)), (name, block, index)


def test_checker_rejects_dense_states_on_overlaid_pool() -> None:
    config, layout = build_config(2, 2)
    entries = describe_entries(config, allocate(config, layout))
    upstream = [fp for entry in entries for fp in entry.footprints]
    assert check_footprints(upstream).safe
    seed = [fp for entry in entries for fp in (entry.dense_proposal or entry.footprints)]
    verdict = check_footprints(seed)
    assert verdict.status == "rejected" and verdict.witness["a"]["group"] != verdict.witness["b"]["group"]


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_state_only_pool_binds_dense_states_in_place(patched: Any, conv_layout: str) -> None:
    config, layout = build_config(0, 2, conv_layout=conv_layout)
    kv = allocate(config, layout)
    bound = _bind_all(config, kv)
    pool = next(iter(kv.values())).untyped_storage().data_ptr()
    for name, states in bound.items():
        assert _facts()[name]["decision"] == "dense-in-place"
        assert all(V.is_dense_state(state) and state.untyped_storage().data_ptr() == pool for state in states)
        declared = config.kv_cache_groups[0].kv_cache_spec.shapes
        assert [tuple(s.shape[1:]) for s in states] == [tuple(s) for s in declared]
    assert get_ledger().counters("kv_cache_layout")["state_binds_dense"] >= 2
    _round_trip(bound, config.num_blocks)


def test_overlaid_pool_keeps_upstream_in_auto_mode(patched: Any) -> None:
    config, layout = build_config(2, 2)
    kv = allocate(config, layout)
    bound = _bind_all(config, kv)
    for name, states in bound.items():
        fact = _facts()[name]
        assert (fact["decision"], fact["verdict"]) == ("upstream", "rejected")
        assert "KDA_PATCHES_KV_STATE_MODE=separate" in fact["reason"]
        assert states[0].stride(0) * states[0].element_size() == 131072  # upstream page stride


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_separate_mode_binds_dense_states_outside_the_pool(patched: Any, conv_layout: str) -> None:
    patched("separate")
    config, layout = build_config(2, 2, conv_layout=conv_layout)
    stamp = stamp_reservation(config)
    assert stamp["bytes_per_block"] == 2 * 68608 and stamp["pool_bytes_per_block"] == 2 * 131072
    kv = allocate(config, layout)
    bound = _bind_all(config, kv)
    pool = kv["model.layers.1.self_attn.attn"].untyped_storage().data_ptr()
    for name, states in bound.items():
        assert _facts()[name]["decision"] == "separate"
        assert all(V.is_dense_state(state) and state.untyped_storage().data_ptr() != pool for state in states)
    assert _facts()["summary"]["separate_bytes"] == stamp["reserved_bytes"]
    _round_trip(bound, config.num_blocks)


def test_separate_budget_shrinks_memory_instead_of_over_allocating() -> None:
    config, _ = build_config(2, 2)
    memory = 1 << 30
    [reduced] = reduced_memory([config], [memory])
    pool, extra = 2 * 131072, 2 * 68608
    blocks = reduced // pool
    assert blocks * (pool + extra) <= memory < (blocks + 2) * (pool + extra)
