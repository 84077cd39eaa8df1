"""vLLM 0.3x-era adapter: ``allocate_kv_cache`` views and ``MambaBase.bind_kv_cache``.

In 0.3x one backing buffer holds every ``KVCacheTensor``; block ``b`` of layer ``l`` starts at
``offset + l * layer_stride + b * block_stride`` and cache groups overlay each other (the tiny Qwen3-Next
model puts ``layers.0.linear_attn`` and ``layers.1.self_attn.attn`` both at offset 0, pages of 131072 bytes).
A state layer's view is a raw ``[B, 1, 1, C]`` int8 page view that ``MambaBase.bind_kv_cache`` slices into
per-state views whose ``stride(0)`` is the page. The chosen dense states ride on that page-view tensor as the
attribute :data:`STATE_VIEWS_ATTR`; the ``bind_kv_cache`` wrapper binds them instead of slicing.
Attention views already keep each block's K and V together, so there is no re-stride to skip here.
"""

from __future__ import annotations

import math
from typing import Any

from kda_patches.kv_layout import views as V
from kda_patches.kv_layout.checker import Footprint
from kda_patches.kv_layout.plan import LayerEntry, layer_specs, plan_layouts

STATE_VIEWS_ATTR = "_kda_state_views"


def is_page_view(view: Any) -> bool:
    """Whether ``view`` is a state layer's raw ``[B, 1, 1, C]`` int8 page view (vLLM 0.27+)."""
    return view.dim() == 4 and view.element_size() == 1 and tuple(view.shape[1:3]) == (1, 1)


def describe_page_view(name: str, group: int, spec: Any, view: Any) -> LayerEntry:
    """Describe a state layer's page view; the chosen states are attached to it as :data:`STATE_VIEWS_ATTR`."""
    shapes = [tuple(shape) for shape in spec.shapes]
    dtypes = list(spec.dtypes)
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]
    num_blocks = view.shape[0]
    footprints: list[Footprint] | None = None
    base = view.storage_offset() * view.element_size()
    if is_page_view(view) and view.shape[3] >= sum(sizes):
        footprints, offset = [], 0
        for index, size in enumerate(sizes):
            footprints.append(Footprint(name, f"state{index}", group, base + offset, view.stride(0), num_blocks,
                                        ((0, size),)))
            offset += size
    entry = LayerEntry(name, group, "state", V.storage_key(view), V.storage_nbytes(view), footprints)
    entry.separate_nbytes = num_blocks * sum(sizes)
    if footprints is not None and not (len(sizes) == 1 and view.stride(0) == sizes[0]):
        entry.dense_proposal = V.dense_state_footprints(name, group, sizes, num_blocks, base)
        entry.make_dense = lambda: V.dense_state_views(view, shapes, dtypes, num_blocks, base)
    entry.make_separate = lambda: V.allocate_separate_states(shapes, dtypes, num_blocks, view.device)

    def apply(kind: str, states: Any) -> None:
        setattr(view, STATE_VIEWS_ATTR, tuple(states))

    entry.apply = apply
    return entry


def describe_entries(kv_cache_config: Any, kv_caches: dict[str, Any]) -> list[LayerEntry]:
    """Describe every layer view returned by 0.3x ``allocate_kv_cache`` as a :class:`LayerEntry`."""
    specs = layer_specs(kv_cache_config)
    entries = []
    for tensor in kv_cache_config.kv_cache_tensors:
        num_blocks = kv_cache_config.num_blocks_of(tensor) if hasattr(kv_cache_config, "num_blocks_of") \
            else kv_cache_config.num_blocks
        for name in tensor.layers:
            view = kv_caches.get(name)
            if view is None or name not in specs:
                continue
            group, spec = specs[name]
            if hasattr(spec, "shapes") and getattr(spec, "has_layer_views", True):
                entries.append(describe_page_view(name, group, spec, view))
                continue
            footprint = None
            if getattr(spec, "has_layer_views", True) and num_blocks and view.dim() >= 1 \
                    and view.shape[0] % num_blocks == 0:
                footprint = V.view_footprint(view, name, "kv", group, 0, view.shape[0] // num_blocks)
            entries.append(LayerEntry(name, group, "attention" if footprint is not None else "other",
                                      V.storage_key(view), V.storage_nbytes(view),
                                      None if footprint is None else [footprint]))
    return entries


def apply_layouts(kv_cache_config: Any, kv_caches: dict[str, Any], mode: str) -> dict[str, Any]:
    """Decide the 0.3x state layouts and attach the chosen dense states to the page views; return the summary."""
    from kda_patches.kv_layout.budget import reserved_layers

    entries = describe_entries(kv_cache_config, kv_caches)
    return plan_layouts(entries, mode, reserved_layers(kv_cache_config), "vllm-0.3x")


def bound_state_views(layer: Any, kv_cache: Any) -> tuple[Any, ...] | None:
    """Return the dense states planned for ``kv_cache`` if they match the layer's state shapes and dtypes.

    Returns:
        The states to bind, or None when none were planned (upstream binding applies).
    Raises:
        ValueError: states were planned but do not match what the layer declares.
    """
    states = getattr(kv_cache, STATE_VIEWS_ATTR, None)
    if states is None:
        return None
    shapes = [tuple(shape) for shape in layer.get_state_shape()]
    dtypes = list(layer.get_state_dtype())
    found = [(tuple(state.shape[1:]), state.dtype) for state in states]
    declared = list(zip(shapes, dtypes, strict=True))
    if found != declared:
        raise ValueError(f"planned dense states {found} do not match the layer's states {declared}")
    return tuple(states)
