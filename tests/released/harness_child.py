"""Child process of the batch mechanism's own test (:mod:`test_release_harness`): no release, no layer.

``python harness_child.py SPEC OUT`` (:mod:`batch_child`): group argument ``MARKER`` (a file path). Setup
activates the overlay (``KDA_PATCHES=0`` from the parent), registers an ``atexit`` handler that writes
``MARKER.<side>`` (``HARNESS_SIDE``), then follows ``HARNESS_SETUP``: ``ok``, ``exit:N`` (``SystemExit(N)``) or
``raise`` (an uncaught ``RuntimeError``). A case ``boom`` raises ``ValueError`` naming its seed; any other case
returns ``{"outputs": [tensor([seed])], "snapshots": []}``.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import batch_child


def setup(args: list[str], cases: list[str]) -> dict[str, Any]:
    import kda_patches  # noqa: F401  (the driver reads its ledger)

    (marker,) = args
    side = os.environ["HARNESS_SIDE"]
    atexit.register(lambda: open(f"{marker}.{side}", "w").close())
    mode = os.environ["HARNESS_SETUP"]
    if mode.startswith("exit:"):
        raise SystemExit(int(mode.split(":")[1]))
    if mode == "raise":
        raise RuntimeError("setup refused (harness)")
    return {}


def run_case(state: dict[str, Any], case: str, seed: int) -> dict[str, Any]:
    import torch

    if case == "boom":
        raise ValueError(f"boom with seed {seed}")
    return {"outputs": [torch.tensor([seed])], "snapshots": []}


def describe(state: dict[str, Any]) -> dict[str, Any]:
    return {"pid": os.getpid()}


if __name__ == "__main__":
    batch_child.serve(setup, run_case, describe)
