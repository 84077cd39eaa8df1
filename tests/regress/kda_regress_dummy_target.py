"""Target module of the dummy patch used by the A/B runner tests (plain functions, no torch)."""

from __future__ import annotations


def next_token(step: int) -> int:
    """Return a deterministic 'token id' for ``step``."""
    return (step * 7919 + 13) % 1000


def score(step: int) -> float:
    """Return a deterministic float for ``step``."""
    return 1.0 / (step + 3)
