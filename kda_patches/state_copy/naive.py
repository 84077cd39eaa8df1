"""Pure-torch twins of the state-copy plans: the reference every kernel and plan test compares with.

Same signatures and the exact same semantics as :class:`~kda_patches.state_copy.plan.LayerStatePlan`:

- gather: packed row ``s`` is cache row ``indices[s]``; rows whose index is negative or ``>= N``, or
  whose flag is false, are zeros; duplicates are fine; the result has the cache dtype.
- scatter: packed row ``s`` (final states of any dtype: FP32, BF16, FP16, ...) is cast to the cache
  dtype with torch's ``.to()`` -- the cast the plans fold into their scatter kernels and must equal bit
  for bit, NaN and Inf included -- and written to cache row ``indices[s]``; invalid indices are
  skipped; valid destinations must be unique (caller precondition).

These do host synchronizations (boolean indexing) and are meant for tests, not for serving.
"""

from __future__ import annotations

import torch


def valid_rows(indices: torch.Tensor, num_rows: int, flags: torch.Tensor | None = None) -> torch.Tensor:
    """Return the bool vector of selected rows that address a cache row (and whose flag is set).

    Args:
        indices: ``[S]`` integer row indices.
        num_rows: ``N``, the number of cache rows.
        flags: optional ``[S]`` bools (nonzero = keep).
    Returns:
        ``[S]`` torch.bool on ``indices.device``.
    """
    valid = (indices >= 0) & (indices < num_rows)
    if flags is not None:
        valid = valid & flags.to(device=indices.device, dtype=torch.bool)
    return valid


def gather_states(state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None = None) -> torch.Tensor:
    """Gather cache rows into a new packed tensor.

    Args:
        state: cache ``[N, H, V, K]`` (any strides).
        indices: ``[S]`` int32/int64 row indices (any values).
        flags: optional ``[S]`` bools; false rows come back as zeros.
    Returns:
        ``[S, H, V, K]`` contiguous tensor of ``state.dtype``.
    """
    valid = valid_rows(indices, state.shape[0], flags)
    safe = torch.where(valid, indices.long(), torch.zeros_like(indices, dtype=torch.long))
    packed = state[safe].contiguous()
    packed[~valid] = 0
    return packed


def scatter_states(state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
    """Write packed rows back into the cache (in place), cast to the cache dtype.

    Args:
        state: cache ``[N, H, V, K]``, modified in place.
        packed: ``[S, H, V, K]`` final states of any dtype (cast with ``packed.to(state.dtype)``).
        indices: ``[S]`` int32/int64 destination rows; invalid ones are skipped.
    Returns:
        None.
    """
    valid = valid_rows(indices, state.shape[0])
    if bool(valid.any()):
        state[indices[valid].long()] = packed[valid].to(state.dtype)
