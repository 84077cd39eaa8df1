"""Fixtures of the kimi_prefill suite: the reference modules patched through the registry, STRICT on/off.

The reference layers live next to this file (``kimi_*.py``, imported by basename like the state-copy
suite's helpers). On the CPU the state-copy plans run under the Triton interpreter
(``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` before the kernels load).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import kimi_workload
import pytest

from kda_patches.registry import revert_patch


@pytest.fixture
def load_reference() -> Iterator[Callable[..., dict[str, Any]]]:
    """Return ``load(patched=True, variant=False)``: fresh reference modules (by name), patched via post-import hooks.

    Every patch registered here is reverted and the modules are forgotten at teardown.
    """
    registered: list[Any] = []

    def load(patched: bool = True, variant: bool = False) -> dict[str, Any]:
        patch = kimi_workload.reference_patch("kimi_prefill_reference", variant=variant) if patched else None
        for old in registered:
            revert_patch(old)
        registered.clear()
        if patch is not None:
            registered.append(patch)
        return kimi_workload.load_reference_modules(patch)

    yield load
    for patch in registered:
        revert_patch(patch)
    for name in kimi_workload.REFERENCE_MODULES:
        sys.modules.pop(name, None)

