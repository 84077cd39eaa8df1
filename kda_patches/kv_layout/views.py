"""Torch side of the layout proof: describe views as :class:`Footprint` records, build proposed views.

Every function here takes real tensors (the views vLLM built) and returns metadata or new *views* of the
same storage; the only allocation is :func:`allocate_separate_states` (the opt-in separate mode).
Imported at wrap time only (it imports torch).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kda_patches.kv_layout.checker import Footprint

MAX_RUNS_PER_VIEW = 4096


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """Return ``(device, storage data_ptr)``: views with the same key share raw bytes."""
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def storage_nbytes(tensor: torch.Tensor) -> int:
    """Return the size in bytes of the storage underlying ``tensor``."""
    return tensor.untyped_storage().nbytes()


def byte_runs(sizes: list[int], strides: list[int], itemsize: int) -> tuple[tuple[int, int], ...] | None:
    """Return the merged byte runs ``((start, length), ...)`` that one element grid addresses.

    Args:
        sizes: sizes of the dimensions inside one block.
        strides: their strides in bytes (non-negative).
        itemsize: bytes per element.
    Returns:
        Sorted, disjoint runs relative to the grid's origin, or None when there would be more than
        ``MAX_RUNS_PER_VIEW`` runs (the caller then treats the layout as unproven).
    """
    dims = sorted((stride, size) for size, stride in zip(sizes, strides, strict=True) if size != 1)
    if any(size == 0 for _, size in dims):
        return ()
    run = itemsize
    while dims and dims[0][0] <= run:  # next dimension continues (or overlaps) the current run
        stride, size = dims.pop(0)
        run = (size - 1) * stride + run
    count = math.prod(size for _, size in dims)
    if count > MAX_RUNS_PER_VIEW:
        return None
    offsets = torch.zeros(1, dtype=torch.int64)
    for stride, size in dims:
        offsets = (offsets[:, None] + torch.arange(size, dtype=torch.int64)[None, :] * stride).reshape(-1)
    merged: list[list[int]] = []
    for start in sorted(offsets.tolist()):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + run)
        else:
            merged.append([start, start + run])
    return tuple((start, end - start) for start, end in merged)


def view_footprint(view: torch.Tensor, layer: str, state: str, group: int, block_dim: int = 0,
                   blocks_per_id: int = 1) -> Footprint | None:
    """Describe the bytes a view addresses per block id.

    Args:
        view: the cache view (any dtype, any strides) into a raw storage.
        layer, state, group: names for the proof and the ledger.
        block_dim: the dimension indexed by (kernel) block.
        blocks_per_id: kernel blocks per manager block id (``view.shape[block_dim]`` must be a multiple).
    Returns:
        The :class:`Footprint`, or None when the view is too irregular to describe.
    """
    itemsize = view.element_size()
    sizes, strides = list(view.shape), [s * itemsize for s in view.stride()]
    block_size, block_stride = sizes.pop(block_dim), strides.pop(block_dim)
    if blocks_per_id < 1 or block_size % blocks_per_id:
        return None
    if blocks_per_id > 1:
        sizes.append(blocks_per_id)
        strides.append(block_stride)
    runs = byte_runs(sizes, strides, itemsize)
    if runs is None:
        return None
    return Footprint(layer, state, group, view.storage_offset() * itemsize, block_stride * blocks_per_id,
                     block_size // blocks_per_id, runs)


def dense_state_layout(state_nbytes: list[int], num_blocks: int, region_base: int) -> list[tuple[int, int]]:
    """Return ``(base, stride)`` in bytes of each state when regrouped densely inside one region.

    State ``i`` of every block comes after all blocks of states ``0..i-1``: block ``b`` of state ``i``
    starts at ``region_base + num_blocks * sum(state_nbytes[:i]) + b * state_nbytes[i]``.
    """
    layout, offset = [], region_base
    for nbytes in state_nbytes:
        layout.append((offset, nbytes))
        offset += num_blocks * nbytes
    return layout


def dense_state_views(storage_view: torch.Tensor, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype],
                      num_blocks: int, region_base: int) -> list[torch.Tensor]:
    """Build dense per-state views ``[num_blocks, *shape]`` on the storage of ``storage_view`` (no copy).

    Args:
        storage_view: any tensor on the raw storage (its storage is reused, its own view is ignored).
        shapes, dtypes: the states' per-block shapes and dtypes.
        num_blocks: block ids the views address.
        region_base: byte offset in the storage where state 0 of block 0 starts.
    """
    storage = storage_view.untyped_storage()
    views = []
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]
    for (base, _), shape, dtype in zip(dense_state_layout(sizes, num_blocks, region_base), shapes, dtypes, strict=True):
        if base % dtype.itemsize:
            raise ValueError(f"dense state at byte {base} is not aligned to {dtype}")
        typed = torch.empty(0, dtype=dtype, device=storage_view.device)
        typed.set_(storage, 0, (storage.nbytes() // dtype.itemsize,), (1,))
        strides = torch.empty((num_blocks, *shape), device="meta").stride()
        views.append(torch.as_strided(typed, (num_blocks, *shape), strides, base // dtype.itemsize))
    return views


def dense_state_footprints(layer: str, group: int, state_nbytes: list[int], num_blocks: int,
                           region_base: int) -> list[Footprint]:
    """Footprints of :func:`dense_state_views` (computed without building the views)."""
    return [Footprint(layer, f"state{index}", group, base, stride, num_blocks, ((0, stride),))
            for index, (base, stride) in enumerate(dense_state_layout(state_nbytes, num_blocks, region_base))]


def allocate_separate_states(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], num_blocks: int,
                             device: Any) -> list[torch.Tensor]:
    """Allocate dense zero-filled state tensors ``[num_blocks, *shape]`` outside the shared KV pool."""
    pairs = zip(shapes, dtypes, strict=True)
    return [torch.zeros((num_blocks, *shape), dtype=dtype, device=device) for shape, dtype in pairs]


def is_dense_state(view: torch.Tensor) -> bool:
    """Return whether ``view`` is a dense per-state tensor (each block's state right after the previous one)."""
    inner = view[0] if view.shape[0] else view
    return view.dim() >= 1 and view.stride(0) == inner.numel() and inner.is_contiguous()


def find_block_dim(view: torch.Tensor, kernel_num_blocks: int) -> int | None:
    """Return the dimension of an attention view indexed by kernel block, or None when ambiguous.

    vLLM backends use ``(2, num_blocks, ...)`` (FlashAttention-style) or ``(num_blocks, ...)``.
    """
    shape = tuple(view.shape)
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == kernel_num_blocks and kernel_num_blocks != 2:
        return 1
    if shape and shape[0] == kernel_num_blocks and (len(shape) < 2 or shape[1] != kernel_num_blocks):
        return 0
    return None


def is_hybrid_restrided(view: torch.Tensor) -> bool:
    """Return whether a ``(2, num_blocks, ...)`` attention view carries 0.13's per-block K/V interleave."""
    return view.dim() >= 3 and view.shape[0] == 2 and view.stride(0) < view.stride(1)


def contiguous_kv_view(view: torch.Tensor) -> torch.Tensor:
    """Return the plain ``(2, num_blocks, ...)`` contiguous view over the same bytes region (no copy).

    The region starts at the re-strided view's storage offset; K of all blocks comes first, then V.
    """
    return torch.as_strided(view, tuple(view.shape), torch.empty(tuple(view.shape), device="meta").stride(),
                            view.storage_offset())
