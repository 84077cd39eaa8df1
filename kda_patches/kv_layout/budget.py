"""KV budget of the opt-in separate mode (``KDA_PATCHES_KV_STATE_MODE=separate``).

Dense state tensors allocated outside the shared pool cost ``num_blocks * state_bytes`` per state layer.
Rather than over-allocating, the engine's ``get_kv_cache_configs`` is asked again with less memory per
worker: ``available * pool / (pool + extra)`` where ``pool`` and ``extra`` are the bytes per block id of the
shared pool and of the separate states, so that ``num_blocks * (pool + extra)`` stays within the original
budget. The reservation is stamped on each returned ``KVCacheConfig`` (attribute :data:`STAMP`, which
survives the worker's deepcopy and pickling); a worker allocates separate states only for layers listed
there. The layers listed are the state layers whose storage is shared with a layer of another cache group,
the only case where in-place dense regrouping can be refused by the checker.
"""

from __future__ import annotations

import math
from typing import Any

STAMP = "_kda_separate_state_budget"


def _is_state_spec(spec: Any) -> bool:
    return hasattr(spec, "shapes") and hasattr(spec, "dtypes")


def _layer_spans(kv_cache_config: Any) -> list[tuple[str, Any, int, int]]:
    """Return ``(layer, storage id, first byte, end byte)`` of every layer's region in the pool."""
    from kda_patches.kv_layout.plan import layer_specs

    specs = layer_specs(kv_cache_config)
    spans = []
    for index, tensor in enumerate(kv_cache_config.kv_cache_tensors):
        shared_by = getattr(tensor, "shared_by", None)
        if shared_by is not None:  # 0.13 era: every sharer views the whole raw tensor
            spans.extend((name, index, 0, tensor.size) for name in shared_by)
            continue
        num_blocks = kv_cache_config.num_blocks
        for position, name in enumerate(tensor.layers):  # 0.3x era: one backing buffer, strided regions
            page = specs[name][1].page_size_bytes if name in specs else tensor.block_stride
            first = tensor.offset + position * tensor.layer_stride
            spans.append((name, ("pool", getattr(tensor, "host_resident", False)), first,
                          first + (num_blocks - 1) * tensor.block_stride + page))
    return spans


def shared_state_layers(kv_cache_config: Any) -> dict[str, int]:
    """Return ``{state layer: dense bytes per block}`` for state layers sharing storage with another group."""
    from kda_patches.kv_layout.plan import layer_specs

    specs = layer_specs(kv_cache_config)
    spans = _layer_spans(kv_cache_config)
    shared = {}
    for name, storage, lo, hi in spans:
        if name not in specs or not _is_state_spec(specs[name][1]):
            continue
        group = specs[name][0]
        if any(other != name and other_storage == storage and other_lo < hi and lo < other_hi
               and specs.get(other, (group,))[0] != group
               for other, other_storage, other_lo, other_hi in spans):
            spec = specs[name][1]
            pairs = zip(spec.shapes, spec.dtypes, strict=True)
            shared[name] = sum(math.prod(shape) * dtype.itemsize for shape, dtype in pairs)
    return shared


def pool_bytes_per_block(kv_cache_config: Any) -> int:
    """Return the bytes of the shared pool per block id."""
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors or not kv_cache_config.num_blocks:
        return 0
    if getattr(tensors[0], "shared_by", None) is not None:
        return sum(tensor.size for tensor in tensors) // kv_cache_config.num_blocks
    return max(tensor.size for tensor in tensors) // kv_cache_config.num_blocks


def stamp_reservation(kv_cache_config: Any) -> dict[str, Any]:
    """Compute and stamp the separate-state reservation of one worker's config; return it."""
    layers = shared_state_layers(kv_cache_config)
    per_block = sum(layers.values())
    stamp = {"layers": sorted(layers), "bytes_per_block": per_block, "num_blocks": kv_cache_config.num_blocks,
             "reserved_bytes": per_block * kv_cache_config.num_blocks,
             "pool_bytes_per_block": pool_bytes_per_block(kv_cache_config)}
    setattr(kv_cache_config, STAMP, stamp)
    return stamp


def reserved_layers(kv_cache_config: Any) -> set[str] | None:
    """Return the layers the engine reserved separate-state memory for, or None when it reserved none."""
    stamp = getattr(kv_cache_config, STAMP, None)
    return None if stamp is None else set(stamp["layers"])


def reduced_memory(kv_cache_configs: list[Any], available_memory: list[int]) -> list[int] | None:
    """Return per-worker memory that leaves room for the separate states, or None when none are needed."""
    reduced, needed = [], False
    for config, memory in zip(kv_cache_configs, available_memory, strict=True):
        extra = sum(shared_state_layers(config).values())
        pool = pool_bytes_per_block(config)
        if extra and pool:
            needed = True
            reduced.append(int(memory * pool // (pool + extra)))
        else:
            reduced.append(memory)
    return reduced if needed else None


def separate_extra_bytes(kv_cache_config: Any) -> int:
    """Return the extra bytes the separate mode costs for ``kv_cache_config`` at its block count."""
    return sum(shared_state_layers(kv_cache_config).values()) * kv_cache_config.num_blocks
