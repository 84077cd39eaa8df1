"""Shared fixtures of the ``kv_cache_layout`` tests (both vLLM eras; vLLM is imported lazily), among them the
session's tiny model and its one unpatched SD engine run, shared by the two engine test modules."""

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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The random-weight tiny Qwen3-Next model (fixed seed), built once for every engine test of this folder."""
    from engine_runs import build_tiny_model

    path = str(tmp_path_factory.mktemp("tiny-qwen3-next"))
    build_tiny_model(path)
    return path


SD_BASELINE = ("KDA_PATCHES=0, VLLM_SSM_CONV_STATE_LAYOUT=SD (vLLM's CPU default), prompts 5,17,40, "
               "engine_ab_child.py on the tiny model")


@pytest.fixture(scope="session")
def sd_baseline(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[int]], list[Any]]:
    """One unpatched engine run, shared: the baseline of ``test_kv_engine_ab[SD]`` and of every activation path
    in ``test_kv_activation_paths`` (the same process: the overlay off, the same workload, SD conv states,
    which vLLM's CPU platform picks when no layout is set). Returns its tokens and every process's ledger;
    its failure names this configuration (:data:`SD_BASELINE`)."""
    from engine_runs import run_engine

    try:
        return run_engine(tiny_model, str(tmp_path_factory.mktemp("baseline-sd")), "baseline-SD", KDA_PATCHES="0",
                          VLLM_SSM_CONV_STATE_LAYOUT="SD")
    except AssertionError as error:
        pytest.fail(f"shared fixture sd_baseline ({SD_BASELINE}) failed: {error}", pytrace=False)
