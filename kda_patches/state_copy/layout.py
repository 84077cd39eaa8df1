"""Metadata checks of the plan contract: cache layout, cache signature, index/flag/packed vectors.

Everything here reads tensor metadata only (sizes, strides, dtype, device; ``data_ptr`` only in
:func:`cache_signature`, which leaves out the row count ``shape[0]``: the kernels take it per launch),
so the same checks serve the eager plans and the fake implementations of the custom ops, which must
not touch pointers.
"""

from __future__ import annotations

from typing import Any

import torch

from kda_patches.state_copy.errors import LayoutError, refuse

INDEX_DTYPES = (torch.int32, torch.int64)
ALIGNMENT = 16


class CacheLayout:
    """The addressing facts of a recurrent-state cache ``[N, H, V, K]`` that the compiled kernels depend on.

    The row count ``N`` is not one of them: the kernels take it at each launch from the cache's
    ``shape[0]`` (``num_rows``, :mod:`~kda_patches.state_copy.kernels`), so a cache rebound to another
    row count (same pointer, strides and inner shape) keeps its plan.

    Attributes:
        inner_shape: ``(H, V, K)``.
        payload: items per row, ``H * V * K``.
        row_stride: ``stride(0)`` in items (``>= payload``; the difference is the page gap).
        dtype: the cache dtype.
        element_size: bytes per item.
    """

    __slots__ = ("dtype", "element_size", "inner_shape", "payload", "row_stride")

    def __init__(self, inner_shape: tuple[int, int, int], row_stride: int, dtype: torch.dtype,
                 element_size: int) -> None:
        self.inner_shape = inner_shape
        self.payload = inner_shape[0] * inner_shape[1] * inner_shape[2]
        self.row_stride = row_stride
        self.dtype = dtype
        self.element_size = element_size

    def as_dict(self) -> dict[str, Any]:
        """Return the layout as a JSON-serialisable dict (for the ledger)."""
        return {"inner_shape": [int(s) for s in self.inner_shape], "payload": int(self.payload),
                "row_stride": int(self.row_stride), "dtype": str(self.dtype)}


def check_layout(state: torch.Tensor, layer: str | None = None) -> None:
    """Check that ``state`` is a cache the plans can address (metadata only; no ``int()`` casts, so
    symbolic sizes under FakeTensor stay symbolic).

    Args:
        state: the recurrent-state cache ``[N, H, V, K]`` (a real or fake tensor).
        layer: layer name for error messages.
    Raises:
        LayoutError: not a 4-D tensor, ``N == 0``, an empty or non-dense inner ``[H, V, K]``,
            or overlapping pages (``stride(0) < H * V * K``).
    """
    if not isinstance(state, torch.Tensor):
        refuse("layout", f"the recurrent state must be a torch.Tensor, got {type(state).__name__}", layer,
               LayoutError)
    if state.dim() != 4:
        refuse("layout", f"the recurrent state must be [N, H, V, K], got shape {tuple(state.shape)}", layer,
               LayoutError)
    if any(size <= 0 for size in state.shape):
        refuse("layout", f"the recurrent state has an empty dimension: shape {tuple(state.shape)}", layer,
               LayoutError)
    expected = 1
    for dim in (3, 2, 1):
        if state.shape[dim] != 1 and state.stride(dim) != expected:
            refuse("inner_stride", f"the inner [H, V, K] of the recurrent state must be dense; got shape "
                   f"{tuple(state.shape)} strides {tuple(state.stride())} (dimension {dim} has stride "
                   f"{state.stride(dim)}, expected {expected}); allocate the cache with dense per-row states",
                   layer, LayoutError)
        expected = expected * state.shape[dim]
    if state.stride(0) < expected:
        refuse("overlap", f"cache rows overlap: stride(0)={state.stride(0)} < payload {expected} items; "
               "each row must own its H*V*K items (page gaps are fine)", layer, LayoutError)


def describe_layout(state: torch.Tensor, layer: str | None = None) -> CacheLayout:
    """Check ``state`` with :func:`check_layout` and describe it.

    Args:
        state: the recurrent-state cache ``[N, H, V, K]`` (a real tensor).
        layer: layer name for error messages.
    Returns:
        Its :class:`CacheLayout`.
    Raises:
        LayoutError: see :func:`check_layout`.
    """
    check_layout(state, layer)
    _, heads, values, keys = (int(size) for size in state.shape)
    return CacheLayout((heads, values, keys), int(state.stride(0)), state.dtype, state.element_size())


SIGNATURE_FIELDS = ("device", "dtype", "inner shape [H, V, K]", "strides", "data_ptr % 16")


def cache_signature(state: torch.Tensor) -> tuple[Any, ...]:
    """Return what a compiled plan depends on: device, dtype, inner shape ``(H, V, K)``, strides, ``data_ptr % 16``.

    Not the row count ``shape[0]``: the kernels take it per launch, so caches that differ only in it (a
    rebound view of the same pages, or two layers with different block counts) share one plan.
    """
    return (str(state.device), state.dtype, tuple(state.shape[1:]), tuple(state.stride()),
            state.data_ptr() % ALIGNMENT)


def serves_signature(prepared: tuple[Any, ...], state: torch.Tensor) -> bool:
    """Return whether a plan prepared for ``prepared`` (a :func:`cache_signature`) addresses ``state`` correctly.

    The signatures match, or ``state`` has one row and differs only in its row stride: the plan's row stride is a
    compiled constant multiplied by the index, and the one valid index of a one-row cache is 0 (``.view(-1, H, V, K)``
    of a one-page slice reports ``stride(0)`` = the payload, not the page).
    """
    found = cache_signature(state)
    if found == prepared:
        return True
    return state.shape[0] == 1 and (*found[:3], (prepared[3][0], *found[3][1:]), found[4]) == prepared


def describe_signature_change(prepared: tuple[Any, ...], found: tuple[Any, ...]) -> str:
    """Return what differs between two :func:`cache_signature` results, field by field (``"; "``-joined)."""
    return "; ".join(f"{name} {before} -> {after}"
                     for name, before, after in zip(SIGNATURE_FIELDS, prepared, found, strict=True) if before != after)


def check_indices(indices: Any, device: torch.device, layer: str | None = None) -> None:
    """Refuse anything but a same-device INT32/INT64 vector of row indices.

    Raises:
        LayoutError: with what was passed and what to pass instead.
    """
    if not isinstance(indices, torch.Tensor):
        refuse("indices", f"indices must be a torch.Tensor, got {type(indices).__name__}", layer, LayoutError)
    if indices.dim() != 1:
        refuse("indices", f"indices must be a 1-D vector, got shape {tuple(indices.shape)}", layer, LayoutError)
    if indices.dtype not in INDEX_DTYPES:
        refuse("indices", f"indices must be torch.int32 or torch.int64, got {indices.dtype}", layer, LayoutError)
    if indices.device != device:
        refuse("indices", f"indices are on {indices.device} but the cache is on {device}; move them with "
               f".to({str(device)!r}) before the call", layer, LayoutError)


def check_flags(flags: Any, count: Any, device: torch.device, layer: str | None = None) -> None:
    """Refuse flags that are not a same-device bool vector with one flag per selected row.

    Raises:
        LayoutError: with what was passed and what to pass instead.
    """
    if not isinstance(flags, torch.Tensor) or flags.dim() != 1 or flags.shape[0] != count:
        shape = tuple(flags.shape) if isinstance(flags, torch.Tensor) else type(flags).__name__
        refuse("flags", f"flags must be a vector of {count} booleans (one per index), got {shape}", layer,
               LayoutError)
    if flags.dtype != torch.bool:
        refuse("flags", f"flags must be torch.bool, got {flags.dtype}; pass (flags != 0)", layer, LayoutError)
    if flags.device != device:
        refuse("flags", f"flags are on {flags.device} but the cache is on {device}", layer, LayoutError)


def check_packed(packed: Any, count: Any, state: torch.Tensor, layer: str | None = None) -> None:
    """Refuse a scatter source that is not ``[S, H, V, K]`` on the cache's device.

    Raises:
        LayoutError: with the shape expected.
    """
    expected = (count, *state.shape[1:])
    if not isinstance(packed, torch.Tensor) or packed.dim() != 4 or tuple(packed.shape) != tuple(expected):
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        refuse("packed", f"packed states must have shape {tuple(expected)} ([S, H, V, K]), got {shape}", layer,
               LayoutError)
    if packed.device != state.device:
        refuse("packed", f"packed states are on {packed.device} but the cache is on {state.device}", layer,
               LayoutError)
    if not packed.dtype.is_floating_point:
        refuse("packed", f"packed states must be floating point (cast to {state.dtype}), got {packed.dtype}",
               layer, LayoutError)
