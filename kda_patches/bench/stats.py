"""Arithmetic of benchmark samples that needs no device: medians, and the blocks of graph-replay samples that
:func:`kda_patches.bench.timing.replay_graphs` captures one graph per block for.

Kept apart from :mod:`kda_patches.bench.timing` so that reading a saved result (``gdn_report``, probe tables) does
not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["capture_medians", "check_graph_instances", "median"]


def median(samples: Sequence[float]) -> float:
    """Return the median of ``samples`` (the mean of the middle two for an even count)."""
    ordered = sorted(samples)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def check_graph_instances(trials: int, instances: int) -> None:
    """Refuse ``instances`` captures per call that cannot split ``trials`` rounds evenly.

    Raises:
        ValueError: ``instances`` is below 1 or does not divide ``trials`` (names both and the fix).
    """
    if instances < 1 or trials % instances:
        raise ValueError(f"graph instances {instances} must be at least 1 and divide the trials ({trials}): "
                         "pick trials as a multiple of the instances")


def capture_medians(samples: list[float], instances: int) -> list[float]:
    """Return the median of each capture's block of graph-replay ``samples``.

    Args:
        samples: one call's graph samples as :func:`~kda_patches.bench.timing.replay_graphs` returns them
            (block after block, equal blocks).
        instances: the captures they came from (``graph_instances``).
    Raises:
        ValueError: ``instances`` does not split the samples evenly (from :func:`check_graph_instances`).
    """
    check_graph_instances(len(samples), instances)
    per = len(samples) // instances
    return [median(samples[block * per:(block + 1) * per]) for block in range(instances)]
