"""A recording double of a layer's plan for the indexed route's tests (the plan is tested in tests/state_copy)."""

from __future__ import annotations

import torch


class RecordingPlan:
    """Records every copy it is handed (gathers give rows of ones)."""

    final_dtypes = (torch.float32,)

    def __init__(self) -> None:
        self.copies: list[str] = []

    def gather(self, state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
        self.copies.append("gather")
        return torch.ones(indices.shape[0], *state.shape[1:], dtype=state.dtype)

    def scatter(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
        self.copies.append("scatter")
