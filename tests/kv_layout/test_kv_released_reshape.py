"""vLLM 0.26, 0.27.1 and 0.28: the RELEASED KV-cache reshaping (and released ``bind_kv_cache``) under the overlay.

The runner methods, specs, config classes and the K/V-first ROCm backend are the release's own code, loaded from
the release cache (:mod:`released_runner` says what is stood in). The overlay's wrappers are the ones the
``kv_cache_layout`` record selects for that version; every (layer, block, state) is then written through the views
the model would use and read back, so a layout that lets two block ids share bytes fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import wrapt
from released_runner import ReleasedStack

from kda_patches import registry, static_check
from kda_patches.kv_layout import views as V
from kda_patches.kv_layout.budget import stamp_reservation
from kda_patches.kv_layout.plan import layer_specs
from kda_patches.ledger import get_ledger
from kda_patches.patches import kv_cache_layout

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner."
BIND = "vllm.model_executor.layers.mamba.abstract:MambaBase.bind_kv_cache"
VERSIONS = ("0.26.0", "0.27.1", "0.28.0")


@pytest.fixture(scope="module", params=VERSIONS)
def stack(request) -> ReleasedStack:
    return ReleasedStack(request.param)


def selected(key: str, version: str) -> registry.Target:
    """The sibling the record applies on ``version``; its fingerprint must match the release's own signature."""
    target = registry.select_target(kv_cache_layout.PATCH, key, version)
    assert target is not None, f"no {key} target for vLLM {version}"
    module, _, qualname = key.partition(":")
    release_file = STACKS_FILES[module](version)
    parameters = static_check.read_parameters(release_file, qualname)
    verdict = registry.check_key(kv_cache_layout.PATCH, key, version, parameters)
    assert verdict.ok, (verdict, release_file)
    return target


def _runner_file(version: str) -> Any:
    from kda_patches.releases.fetch import release_dir

    return release_dir("vllm", version) / "vllm/v1/worker/gpu_model_runner.py"


def _abstract_file(version: str) -> Any:
    from kda_patches.releases.fetch import release_dir

    return release_dir("vllm", version) / "vllm/model_executor/layers/mamba/abstract.py"


STACKS_FILES = {"vllm.v1.worker.gpu_model_runner": _runner_file,
                "vllm.model_executor.layers.mamba.abstract": _abstract_file}


@pytest.fixture
def patched_stack(stack: ReleasedStack, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Subclasses of the released runner (and layer) with the record's selected wrappers; yields (stack, mode)."""
    mode = {"value": "auto"}
    monkeypatch.setattr(kv_cache_layout, "_mode", lambda: mode["value"])
    runner_class = type("PatchedRunner", (stack.runner_class,), {})
    for method in ("_reshape_kv_cache_tensors", "_update_hybrid_attention_mamba_layout"):
        wrapt.wrap_function_wrapper(runner_class, method, selected(RUNNER + method, stack.version).wrapper)
    layer_class = stack.layer_class
    if layer_class is not None:
        layer_class = type("PatchedLayer", (layer_class,), {})
        wrapt.wrap_function_wrapper(layer_class, "bind_kv_cache", selected(BIND, stack.version).wrapper)
    patched = ReleasedStack.__new__(ReleasedStack)
    patched.__dict__.update(stack.__dict__, runner_class=runner_class, layer_class=layer_class)
    return patched, lambda value: mode.__setitem__("value", value)


def reshape(stack: ReleasedStack, num_attention: int, num_gdn: int, separate: bool = False) -> tuple[Any, dict]:
    runner, config, kernel_block_sizes = stack.build(num_attention, num_gdn)
    if separate:
        stamp_reservation(config)  # what the engine core's get_kv_cache_configs wrapper does in separate mode
    raw = runner._allocate_kv_cache_tensors(config)
    kv = runner._reshape_kv_cache_tensors(raw, kernel_block_sizes)
    return config, stack.bind_states(config, kv)


def fill_and_verify(config: Any, bound: dict[str, Any], owner_of_block: dict[int, int]) -> list[str]:
    """Write a distinct value per (layer, block, state) for the blocks each group owns; return what changed."""
    specs = layer_specs(config)
    writes = []
    for name, value in bound.items():
        group = specs[name][0]
        states = list(value) if isinstance(value, list) else [value[0], value[1]]
        for block, owner in owner_of_block.items():
            if owner != group:
                continue
            for index, state in enumerate(states):
                pattern = float(len(writes) % 997 + 1)
                state[block].fill_(pattern)
                writes.append((name, block, index, state, pattern))
    return [f"{name} block {block} state {index}" for name, block, index, state, pattern in writes
            if not torch.all(state[block] == pattern)]


def decisions() -> dict[str, Any]:
    return get_ledger().snapshot()["facts"]["kv_cache_layout"]


def test_upstream_release_views_are_memory_safe(stack: ReleasedStack) -> None:
    """The harness itself: the release's own layout round-trips every block its group owns."""
    config, bound = reshape(stack, 2, 2)
    assert fill_and_verify(config, bound, {block: block % 2 for block in range(1, config.num_blocks)}) == []


def test_state_only_storage_gets_dense_views_in_place(patched_stack: Any) -> None:
    stack, _ = patched_stack
    config, bound = reshape(stack, 0, 2)
    raw_pointers = set()
    for name, states in bound.items():
        assert decisions()[name]["decision"] == "dense-in-place", decisions()[name]
        assert all(V.is_dense_state(state) for state in states)
        pointers = {state.untyped_storage().data_ptr() for state in states}
        assert len(pointers) == 1  # one storage: the raw tensor, no copy
        raw_pointers |= pointers
        assert [tuple(state.shape[1:]) for state in states] == [tuple(s) for s in config.kv_cache_groups[0]
                                                                 .kv_cache_spec.shapes]
    assert len(raw_pointers) == len(bound)
    assert fill_and_verify(config, bound, {block: 0 for block in range(config.num_blocks)}) == []
    if stack.layer_class is not None:
        assert get_ledger().counters("kv_cache_layout").get("state_binds_dense", 0) >= 2


def test_hybrid_auto_mode_keeps_upstream_and_says_why(patched_stack: Any) -> None:
    stack, _ = patched_stack
    config, bound = reshape(stack, 2, 2)
    page = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    for name, value in bound.items():
        assert decisions()[name]["decision"] == "upstream" and decisions()[name]["verdict"] == "rejected"
        if isinstance(value, list):
            assert value[1].stride(0) * value[1].element_size() == page  # the page-strided upstream view
        else:
            assert V.is_hybrid_restrided(value)
    assert fill_and_verify(config, bound, {block: block % 2 for block in range(1, config.num_blocks)}) == []


def test_separate_mode_moves_states_out_and_makes_attention_contiguous(patched_stack: Any) -> None:
    stack, set_mode = patched_stack
    set_mode("separate")
    config, bound = reshape(stack, 2, 2, separate=True)
    for name, value in bound.items():
        if isinstance(value, list):
            assert decisions()[name]["decision"] == "separate"
            assert all(V.is_dense_state(state) for state in value)
        else:
            assert decisions()[name]["decision"] == "contiguous" and decisions()[name]["verdict"] == "accepted"
            assert value[0].is_contiguous() and value[1].is_contiguous()
            assert value[0].contiguous().data_ptr() == value[0].data_ptr()  # .contiguous() is a no-op
    assert fill_and_verify(config, bound, {block: block % 2 for block in range(1, config.num_blocks)}) == []
