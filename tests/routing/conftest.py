"""Fixtures of the routing-core suite: dummy seam modules loaded fresh under records built here.

Plans run under the Triton interpreter on the CPU (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before the kernels load).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kda_patches.registry import Patch, register_patch, revert_patch

DUMMIES = "routing_dummies"

@pytest.fixture(autouse=True)
def routing_everywhere(routing: str) -> str:
    """Every routing test runs under both mechanisms (``routing``, tests/conftest.py) unless it is marked."""
    return routing


@pytest.fixture
def load_dummies() -> Iterator[Callable[..., Any]]:
    """Return ``load(*patches)``: register the records, then import :mod:`routing_dummies` afresh (post-import hooks).

    Every record registered here is reverted (last first) and the module forgotten at teardown.
    """
    registered: list[Patch] = []

    def load(*patches: Patch) -> Any:
        for patch in reversed(registered):
            revert_patch(patch)
        registered.clear()
        sys.modules.pop(DUMMIES, None)
        for patch in patches:
            revert_patch(patch)
            register_patch(patch)
            registered.append(patch)
        return importlib.import_module(DUMMIES)

    yield load
    for patch in reversed(registered):
        revert_patch(patch)
    sys.modules.pop(DUMMIES, None)

