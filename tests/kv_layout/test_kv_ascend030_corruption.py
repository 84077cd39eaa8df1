"""vllm-ascend 0.30's RELEASED KV-cache layout of Kimi K3 lets two requests corrupt each other (issue 53.2).

The fork's config, spec, planner, allocation and reshape code runs from the release cache on CPU tensors
(:class:`~kda_patches.kv_layout.ascend_stack.AscendStack` with ``device="cpu"``; TP 8 and the smallest pool the
release's own planner accepts for max_model_len 4096), exactly as the layout table's cases do on the meta
device. Two requests then hold the two block ids of the checker's witness, each in its own KV-cache group (the block
pool hands a block id to one group at a time): request A the first KDA layer's blocks, request B the MLA layers'.
Writing every cache view of one request changes the other's bytes, in both directions. The same two-request write on
the same release with Qwen3-Next (proven) changes nothing: the harness is not what collides.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kda_patches.kv_layout import ascend_models
from kda_patches.kv_layout.ascend_engine import engine_environment
from kda_patches.kv_layout.ascend_stack import AscendStack
from kda_patches.kv_layout.ascend_verdict import describe_views, ranked_verdict

# the smallest pools the release's planner accepts at TP 8 for max_model_len 4096 (it refuses fewer blocks)
NUM_BLOCKS = {"Kimi K3": 16, "Qwen3-Next-80B": 32}


def build(model: str) -> tuple[Any, dict[str, Any]]:
    stack = AscendStack("0.30.0rc2", "0.30.0", device="cpu", num_blocks=NUM_BLOCKS[model])
    logging.disable(logging.WARNING)
    try:
        with engine_environment():
            _, config, views = stack.run(ascend_models.MODELS[model], 8)
    finally:
        logging.disable(logging.NOTSET)
    assert config.num_blocks == NUM_BLOCKS[model] and all(
        tensor.device.type == "cpu" for value in views.values() for tensor in value)
    return config, views


def group_of(config: Any) -> dict[str, int]:
    return {name: index for index, group in enumerate(config.kv_cache_groups) for name in group.layer_names}


def request_views(config: Any, views: dict[str, Any], group: int, block: int) -> list[tuple[str, torch.Tensor]]:
    """Every cache view a request holding ``block`` in ``group`` writes: each layer's K/V or states, that block's rows
    (a view with k times as many rows as blocks gives block b rows b*k .. b*k+k-1, as the fork's kernels read it)."""
    groups = group_of(config)
    held = []
    for name, value in views.items():
        if groups[name] != group:
            continue
        for index, tensor in enumerate(value):
            rows = tensor.shape[0] // config.num_blocks
            held.append((f"{name}[{index}]", tensor[block * rows:(block + 1) * rows]))
    return held


def write_then_changed(writer: list[tuple[str, torch.Tensor]], reader: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Fill the reader's views with 1, the writer's with 2; return the reader views whose bytes changed."""
    for _, tensor in reader:
        tensor.fill_(1)
    for _, tensor in writer:
        tensor.fill_(2)
    return [name for name, tensor in reader if not bool((tensor == 1).all())]


def test_kimi_k3_requests_overwrite_each_other_on_the_released_030_layout() -> None:
    config, views = build("Kimi K3")
    verdict, _, found, _, _ = ranked_verdict(describe_views(config, views))
    assert verdict == "overlap found"
    witness, _ = found
    a, b = witness["a"], witness["b"]
    assert a["block"] != b["block"] and a["group"] != b["group"]
    request_a = request_views(config, views, b["group"], b["block"])  # the first KDA layer's group
    request_b = request_views(config, views, a["group"], a["block"])  # the MLA layers' group
    assert f"{b['layer']}[0]" in dict(request_a) and f"{a['layer']}[0]" in dict(request_b)
    changed_by_a = write_then_changed(request_a, request_b)
    assert f"{a['layer']}[0]" in changed_by_a  # A's conv-state write lands in B's MLA latent K
    changed_by_b = write_then_changed(request_b, request_a)
    assert f"{b['layer']}[0]" in changed_by_b  # and B's K write in A's conv state


def test_the_same_two_requests_do_not_collide_on_a_proven_030_layout() -> None:
    config, views = build("Qwen3-Next-80B")
    assert ranked_verdict(describe_views(config, views))[0] == "proven"
    groups = group_of(config)
    attention = groups["model.layers.3.self_attn.attn"]
    state = groups["model.layers.0.linear_attn"]
    for first, second in ((8, 9), (9, 8), (0, config.num_blocks - 1)):
        request_a = request_views(config, views, state, first)
        request_b = request_views(config, views, attention, second)
        assert request_a and request_b
        assert write_then_changed(request_a, request_b) == [] and write_then_changed(request_b, request_a) == []
