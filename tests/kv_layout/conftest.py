"""Shared fixtures of the ``kv_cache_layout`` tests (both vLLM eras; vLLM is imported lazily), among them the
session's tiny model, its one unpatched engine run per conv-state layout (SD, DS) and its one run per activation
path and state mode, shared by the two engine test modules: six vLLM engine starts in all."""

from __future__ import annotations

from collections.abc import Callable
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


DS_BASELINE = ("KDA_PATCHES=0, VLLM_SSM_CONV_STATE_LAYOUT=DS, prompts 5,17,40, engine_ab_child.py on the tiny "
               "model")


@pytest.fixture(scope="session")
def ds_baseline(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[int]], list[Any]]:
    """One unpatched engine run with DS conv states, shared: the baseline of ``test_kv_engine_ab[DS]`` and of the
    plugin activation path (``engine_runs.ACTIVATION_LAYOUTS``: that path runs DS, so its run is the DS A/B's
    patched side too). Returns its tokens and every process's ledger; its failure names this configuration
    (:data:`DS_BASELINE`)."""
    from engine_runs import run_engine

    try:
        return run_engine(tiny_model, str(tmp_path_factory.mktemp("baseline-ds")), "baseline-DS", KDA_PATCHES="0",
                          VLLM_SSM_CONV_STATE_LAYOUT="DS")
    except AssertionError as error:
        pytest.fail(f"shared fixture ds_baseline ({DS_BASELINE}) failed: {error}", pytrace=False)


@pytest.fixture(scope="session")
def pth_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter environment whose site-packages holds the main venv's path and ``kda_patches.pth``."""
    from engine_runs import make_pth_python

    return make_pth_python(tmp_path_factory.mktemp("pth-env"))


ACTIVATION_RUN = ("KDA_PATCHES_STRICT=1, KDA_PATCHES_KV_STATE_MODE={mode}, activated through {path} only, prompts "
                  "5,17,40, engine_ab_child.py on the tiny model ({layout} conv states)")


@pytest.fixture(scope="session")
def activation_run(tiny_model: str, pth_python: str, tmp_path_factory: pytest.TempPathFactory
                   ) -> Callable[[str, str], tuple[list[list[int]], list[Any]]]:
    """``activation_run(path, mode)``: one STRICT engine run per activation path and state mode per session
    (:data:`ACTIVATION_RUN`, in the layout ``engine_runs.activation_layout`` names), shared:
    ``test_kv_activation_paths`` asserts on every one, ``test_kv_engine_ab[SD]`` asserts its layout A/B on the
    ``.pth`` runs (the overlay imported at interpreter start) and ``test_kv_engine_ab[DS]`` on the plugin's DS run.
    A failed run fails every test that asks for it, each naming the configuration."""
    from engine_runs import activation_layout, run_activation_path

    runs: dict[tuple[str, str], Any] = {}

    def run(path: str, mode: str) -> tuple[list[list[int]], list[Any]]:
        if (path, mode) not in runs:
            layout = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"} if activation_layout(path, mode) == "DS" else {}
            try:
                runs[path, mode] = run_activation_path(path, tiny_model, tmp_path_factory.mktemp(f"{path}-{mode}"),
                                                       f"{path}-{mode}", pth_python, KDA_PATCHES_STRICT="1",
                                                       KDA_PATCHES_KV_STATE_MODE=mode, **layout)
            except AssertionError as error:
                runs[path, mode] = error
        outcome = runs[path, mode]
        if isinstance(outcome, AssertionError):
            named = ACTIVATION_RUN.format(path=path, mode=mode, layout=activation_layout(path, mode))
            pytest.fail(f"shared fixture activation_run ({named}) failed: {outcome}", pytrace=False)
        return outcome

    return run
