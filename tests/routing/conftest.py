"""Fixtures of the routing-core suite: dummy seam modules loaded fresh under records built here.

Plans run under the Triton interpreter on the CPU (``TRITON_INTERPRET=1``, set by ``make test``; set here
too when missing, before the kernels load).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

if "kda_patches.state_copy.kernels" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kda_patches.registry import Patch, register_patch, revert_patch

DUMMIES = "routing_dummies"
MECHANISMS = ("rewrite", "alias")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alias_mechanism: the test is about the routed alias's own objects; "
                            "it runs under KDA_PATCHES_ROUTING=alias only")
    config.addinivalue_line("markers", "rewrite_mechanism: the test is about the rewritten twin; "
                            "it runs under KDA_PATCHES_ROUTING=rewrite only")
    config.addinivalue_line("markers", "both_mechanisms: runs under both mechanisms (overrides a module's mark)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run every routing test under both mechanisms, unless it is marked as about one of them (the closest
    mark wins: a test's own mark over its module's)."""
    if "routing" not in metafunc.fixturenames:
        return
    choices = {"alias_mechanism": ("alias",), "rewrite_mechanism": ("rewrite",), "both_mechanisms": MECHANISMS}
    closest = next((mark.name for mark in metafunc.definition.iter_markers() if mark.name in choices), None)
    metafunc.parametrize("routing", choices.get(closest, MECHANISMS), indirect=True)


@pytest.fixture(autouse=True)
def routing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Set ``KDA_PATCHES_ROUTING`` for the test (read when a seam is wrapped, i.e. when the dummies load);
    the ``strict`` / ``lenient`` fixtures keep it."""
    import kda_patches
    from kda_patches.flags import Flags

    mechanism = getattr(request, "param", "rewrite")
    current = kda_patches._FLAGS
    monkeypatch.setattr(kda_patches, "_FLAGS", Flags(strict=bool(current and current.strict), routing=mechanism))
    return mechanism


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

