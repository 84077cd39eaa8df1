"""Every activation path a user has takes effect in vLLM's real CPU engine, in both state modes.

Paths: the vLLM plugin entry point alone (the package's installed ``vllm.general_plugins`` entry: vLLM calls
it in ``EngineCore.__init__``, after ``vllm.v1.engine.core`` bound ``get_kv_cache_configs`` by name), a
``kda_patches.pth`` line in the site-packages of a throwaway interpreter environment (the ``.pth`` that
``kda-patches install`` writes), and the ``kda-run`` launcher. Each runs STRICT in ``auto`` and ``separate``
mode against one baseline, and asserts the effect, not only the state: the engine's separate-state budget and
dense state bindings in separate mode, flagged GDN builds, layout decisions, the rebound aliases. The baseline
is the session's unpatched SD run (``conftest.py``'s ``sd_baseline``, shared with ``test_kv_engine_ab``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import sysconfig
from typing import Any

import pytest
from engine_runs import FAST_EXIT, GDN_LAYERS, PROMPT_LENGTHS, layout_facts

from kda_patches.install import PTH_NAME
from kda_patches.ledger import read_ledger_dir

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHILD = HERE / "engine_ab_child.py"


@pytest.fixture(scope="module")
def pth_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter environment whose site-packages holds the main venv's path and ``kda_patches.pth``."""
    env_dir = tmp_path_factory.mktemp("pth-env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site_dir = pathlib.Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                            "['purelib'])"], check=True, capture_output=True, text=True)
                            .stdout.strip())
    # .pth files run in name order: the main venv's packages first, then the overlay's own line, written by
    # the real installer (`kda-patches install --prefix ENV` targets ENV/lib/pythonX.Y/site-packages)
    (site_dir / "00_main_venv.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{ROOT}\n")
    done = subprocess.run([sys.executable, "-m", "kda_patches", "install", "--prefix", str(env_dir)],
                          capture_output=True, text=True, check=True)
    assert (site_dir / PTH_NAME).is_file(), done.stdout + done.stderr
    return str(python)


def run_path(path: str, model: str, workdir: pathlib.Path, name: str, pth_python: str | None,
             **env: str) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Run the engine workload through one activation path; return its tokens and every process's ledger."""
    status, out = workdir / f"status-{name}", workdir / f"{name}.json"
    child_env = {key: value for key, value in os.environ.items()
                 if not key.startswith("KDA_PATCHES") and key != "PYTHONPATH"}
    # the test-only fast exit of spawned children (tests/fast_exit; it does not activate the overlay)
    child_env.update(env, KDA_PATCHES_STATUS_DIR=str(status), VLLM_CPU_KVCACHE_SPACE="1",
                     KDA_TEST_PROMPT_LENGTHS=PROMPT_LENGTHS, PYTHONPATH=FAST_EXIT)
    command = {"plugin": [sys.executable, str(CHILD)],
               "pth": [pth_python or "", str(CHILD)],
               "launcher": [str(pathlib.Path(sys.executable).parent / "kda-run"), sys.executable, str(CHILD)]}[path]
    result = subprocess.run([*command, model, str(out)], env=child_env, capture_output=True, text=True,
                            timeout=540)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    tokens = json.loads(out.read_text())["tokens"]
    return tokens, read_ledger_dir(str(status)) if status.is_dir() else []


def counters(ledgers: list[dict[str, Any]], section: str) -> dict[str, int]:
    total: dict[str, int] = {}
    for ledger in ledgers:
        for key, value in ledger["counters"].get(section, {}).items():
            total[key] = total.get(key, 0) + value
    return total


def activations(ledgers: list[dict[str, Any]]) -> set[str]:
    return {key for ledger in ledgers for key in ledger["facts"].get("activation", {})}


@pytest.fixture(scope="module")
def baseline(sd_baseline: tuple[list[list[int]], list[dict[str, Any]]]) -> list[list[int]]:
    """The unpatched tokens: the session's ``sd_baseline`` (``conftest.py``; the paths run vLLM's default SD)."""
    tokens, ledgers = sd_baseline
    assert counters(ledgers, "kv_cache_layout") == {}
    return tokens


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["separate", "auto"])
@pytest.mark.parametrize("path", ["plugin", "pth", "launcher"])
def test_each_activation_path_takes_effect(tiny_model: str, baseline: list[list[int]], pth_python: str,
                                           tmp_path: pathlib.Path, path: str, mode: str) -> None:
    tokens, ledgers = run_path(path, tiny_model, tmp_path, f"{path}-{mode}", pth_python, KDA_PATCHES_STRICT="1",
                               KDA_PATCHES_KV_STATE_MODE=mode)
    assert tokens == baseline
    assert ledgers, "no process wrote a ledger"
    if path == "plugin":
        assert activations(ledgers) == {"vllm_plugin"}  # nothing imported the overlay before vLLM's plugin loader
    assert counters(ledgers, "gdn_host_flags").get("builds_flagged", 0) > 0
    facts = layout_facts(ledgers)
    if mode == "separate":
        budget = facts.get("separate_budget")
        assert budget is not None, f"{path}: the engine core reserved no separate-state memory"
        assert budget["reduced_memory"][0] < budget["available_memory"][0]
        assert facts["counters"].get("state_binds_dense", 0) == len(GDN_LAYERS)
        assert all(facts[name]["decision"] == "separate" for name in GDN_LAYERS)
    else:
        assert "separate_budget" not in facts
        assert all(facts[name]["decision"] == "upstream" for name in GDN_LAYERS)
        assert facts["counters"].get("state_binds_upstream", 0) == len(GDN_LAYERS)
    aliases = {key: value for ledger in ledgers for key, value in ledger["facts"].get("aliases", {}).items()}
    if path == "plugin":  # activated late: the engine core's by-name import had to be rebound
        assert any("vllm.v1.engine.core.get_kv_cache_configs" in value for value in aliases.values()), aliases
