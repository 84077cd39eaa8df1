"""Shared fixtures of the ``kv_cache_layout`` tests (both vLLM eras; vLLM is imported lazily)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Register the ``kv_cache_layout`` patch (revert afterwards); yields a setter for the state mode."""
    import kda_patches.patches.kv_cache_layout as module
    from kda_patches import registry

    mode = {"value": "auto"}
    monkeypatch.setattr(module, "_mode", lambda: mode["value"])
    registry.register_patch(module.PATCH)
    yield lambda value: mode.__setitem__("value", value)
    registry.revert_patch(module.PATCH)
