"""vLLM 0.13-0.28 adapter: ``_reshape_kv_cache_tensors`` / ``_update_hybrid_attention_mamba_layout``.

In 0.13 every raw tensor of a hybrid model is shared by one layer of each cache group; each layer views the
whole tensor with ``num_blocks = raw_bytes // page_size``: attention as ``(2, num_blocks, ...)`` re-strided to
a per-block K/V interleave, state layers as one ``[num_blocks, *shape]`` view per state whose ``stride(0)``
is the (padded) page. The result dict maps layer names to a tensor (attention) or a list of state tensors.
vLLM 0.26 builds the same views (its reshape reads the config from ``self.kv_cache_config``). vLLM 0.27-0.28
give a state layer one raw ``[num_blocks, 1, 1, page_bytes]`` int8 page view instead, which
``MambaBase.bind_kv_cache`` slices into states: those are described as the 0.3x adapter does
(:func:`kda_patches.kv_layout.era032.describe_page_view`), chosen dense states ride on the page view and the
``bind_kv_cache`` wrapper binds them.
"""

from __future__ import annotations

import math
from typing import Any

from kda_patches.kv_layout import views as V
from kda_patches.kv_layout.era032 import describe_page_view, is_page_view
from kda_patches.kv_layout.plan import LayerEntry, layer_specs, plan_layouts


def _state_entry(name: str, group: int, states: list[Any]) -> LayerEntry:
    first = states[0]
    footprints = []
    for index, state in enumerate(states):
        fp = V.view_footprint(state, name, f"state{index}", group)
        if fp is None or V.storage_key(state) != V.storage_key(first):
            footprints = None
            break
        footprints.append(fp)
    entry = LayerEntry(name, group, "state", V.storage_key(first), V.storage_nbytes(first), footprints)
    shapes = [tuple(state.shape[1:]) for state in states]
    dtypes = [state.dtype for state in states]
    num_blocks = first.shape[0]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]
    entry.separate_nbytes = num_blocks * sum(sizes)
    if footprints is not None and not all(V.is_dense_state(state) for state in states):
        region = first.storage_offset() * first.element_size()
        entry.dense_proposal = V.dense_state_footprints(name, group, sizes, num_blocks, region)
        entry.make_dense = lambda: V.dense_state_views(first, shapes, dtypes, num_blocks, region)
    entry.make_separate = lambda: V.allocate_separate_states(shapes, dtypes, num_blocks, first.device)
    return entry


def _attention_entry(name: str, group: int, spec: Any, view: Any) -> LayerEntry:
    nbytes = V.storage_nbytes(view)
    num_blocks = nbytes // spec.page_size_bytes
    footprint = None
    dim = None
    if num_blocks > 0:
        for candidate in range(1, 65):  # kernel blocks per manager block (kernel block splitting)
            dim = V.find_block_dim(view, num_blocks * candidate)
            if dim is not None:
                footprint = V.view_footprint(view, name, "kv", group, dim, candidate)
                break
    entry = LayerEntry(name, group, "attention", V.storage_key(view), nbytes,
                       None if footprint is None else [footprint])
    if footprint is not None and dim == 1 and V.is_hybrid_restrided(view):
        per_id = view.shape[1] // footprint.num_blocks
        contiguous = V.contiguous_kv_view(view)
        proposal = V.view_footprint(contiguous, name, "kv", group, 1, per_id)
        if proposal is not None:
            entry.contiguous_proposal = [proposal]
            entry.make_contiguous = lambda: contiguous
    return entry


def _make_apply(kv_caches: dict[str, Any], name: str, container: type) -> Any:
    """Return ``apply(kind, views)`` writing chosen views back into ``kv_caches`` (state lists stay lists)."""

    def apply(kind: str, views: Any) -> None:
        kv_caches[name] = container(views) if kind == "state" and container in (list, tuple) else views

    return apply


def describe_entries(kv_cache_config: Any, kv_caches: dict[str, Any]) -> list[LayerEntry]:
    """Describe every layer of ``kv_caches`` (the dict the 0.13 reshape returns) as a :class:`LayerEntry`.

    Each entry's ``apply`` writes the chosen views back into ``kv_caches``.
    """
    import torch

    entries = []
    for name, (group, spec) in layer_specs(kv_cache_config).items():
        value = kv_caches.get(name)
        if value is None:
            continue
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value) \
                and hasattr(spec, "shapes"):
            entry = _state_entry(name, group, list(value))
        elif isinstance(value, torch.Tensor) and hasattr(spec, "page_size_bytes") and not hasattr(spec, "shapes"):
            entry = _attention_entry(name, group, spec, value)
        elif isinstance(value, torch.Tensor) and hasattr(spec, "shapes") and is_page_view(value):
            entries.append(describe_page_view(name, group, spec, value))  # 0.27-0.28: bind_kv_cache slices it
            continue
        else:
            first = value[0] if isinstance(value, (list, tuple)) and value else value
            key = V.storage_key(first) if isinstance(first, torch.Tensor) else None
            nbytes = V.storage_nbytes(first) if isinstance(first, torch.Tensor) else None
            entry = LayerEntry(name, group, "other", key, nbytes, None)

        entry.apply = _make_apply(kv_caches, name, type(value))
        entries.append(entry)
    return entries


def apply_layouts(kv_cache_config: Any, kv_caches: dict[str, Any], mode: str,
                  states: bool = True) -> dict[str, Any]:
    """Decide and apply the 0.13 layouts in place on ``kv_caches``; return the ledger summary.

    Args:
        kv_cache_config: the runner's ``KVCacheConfig`` (groups, specs, and the separate-mode reservation).
        kv_caches: layer -> view(s), as upstream's reshape produced them; modified in place.
        mode: ``auto`` or ``separate``.
        states: False leaves state layers alone (the standalone ``_update_hybrid_attention_mamba_layout`` path).
    """
    from kda_patches.kv_layout.budget import reserved_layers

    entries = describe_entries(kv_cache_config, kv_caches)
    if not states:
        for entry in entries:
            if entry.kind == "state":
                entry.dense_proposal = None
                entry.note = "state views left as they are (decided outside _reshape_kv_cache_tensors)"
    return plan_layouts(entries, mode, reserved_layers(kv_cache_config), "vllm-0.13")
