"""Helpers of the state-copy suite: bit views and page-gapped caches with poisoned gaps."""

from __future__ import annotations

import torch

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
        torch.float64: torch.int64, torch.int32: torch.int32, torch.int64: torch.int64, torch.uint8: torch.uint8,
        torch.int16: torch.int16}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Return an integer view of ``tensor`` for bit-exact comparisons (NaN payloads, -0.0)."""
    return tensor.view(BITS[tensor.dtype])


class PagedCache:
    """A cache ``[N, H, V, K]`` carved out of a larger backing with page gaps and a storage offset.

    Attributes:
        state: the cache view.
        backing: the flat backing tensor (gaps and the offset prefix hold a poison pattern).
        payload_mask: bool ``[backing.numel()]``, True where the cache's rows live.
    """

    def __init__(self, state: torch.Tensor, backing: torch.Tensor) -> None:
        self.state = state
        self.backing = backing
        mask = torch.zeros(backing.numel(), dtype=torch.bool, device=backing.device)
        mask.as_strided(state.shape, state.stride(), state.storage_offset()).fill_(True)
        self.payload_mask = mask
        self._gap_before = bits(backing[~mask]).clone()

    def gaps_untouched(self) -> bool:
        """Return whether every item outside the rows still holds its poison."""
        return torch.equal(bits(self.backing[~self.payload_mask]), self._gap_before)

    def clone(self) -> PagedCache:
        """Return an independent copy with the same layout (for the naive reference)."""
        backing = self.backing.clone()
        state = backing.as_strided(self.state.shape, self.state.stride(), self.state.storage_offset())
        return PagedCache(state, backing)


def build_cache(device: torch.device, dtype: torch.dtype = torch.float32, num_rows: int = 6,
                inner: tuple[int, int, int] = (2, 3, 8), gap: int = 5, offset: int = 3,
                seed: int = 0) -> PagedCache:
    """Build a random :class:`PagedCache` whose gaps, head, offset prefix and tail hold a NaN-pattern poison.

    The backing holds one more row stride before row 0 (the head) and after row ``N - 1`` (the tail), so a
    kernel that takes ``index == -1`` or ``index == N`` as valid reads or writes poisoned memory in bounds,
    which the tests then see as a changed poison byte (not as a crash).

    Args:
        device: where to allocate.
        dtype: cache dtype (floating).
        num_rows: ``N``.
        inner: ``(H, V, K)``.
        gap: items between rows (page gap).
        offset: items between the head row stride and row 0 (the storage offset is ``stride + offset``).
        seed: RNG seed of the row contents.
    Returns:
        The cache.
    """
    generator = torch.Generator().manual_seed(seed)
    stride0 = inner[0] * inner[1] * inner[2] + gap
    start = stride0 + offset  # a whole poisoned row stride before row 0: index -1 stays in bounds
    total = start + (num_rows + 1) * stride0
    backing = torch.full((total,), -7, dtype=BITS[dtype]).view(dtype)
    state = backing.as_strided((num_rows, *inner), (stride0, inner[1] * inner[2], inner[2], 1), start)
    state.copy_((torch.randn((num_rows, *inner), generator=generator) * 3).to(dtype))
    backing = backing.to(device)
    return PagedCache(backing.as_strided(state.shape, state.stride(), start), backing)
