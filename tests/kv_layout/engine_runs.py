"""Real-engine runs of the ``kv_cache_layout`` tests: the tiny model, one engine run per fresh process, facts.

Shared by ``test_kv_engine_ab`` and ``test_kv_activation_paths``; their common fixtures (one tiny model, one
unpatched SD baseline and one run per activation path and state mode per session) are in this folder's
``conftest.py``. :func:`run_engine` activates the overlay through ``engine_shim``'s sitecustomize;
:func:`run_activation_path` through the path a user picks (plugin, ``.pth``, launcher).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import sysconfig
from typing import Any

from kda_patches.install import PTH_NAME
from kda_patches.ledger import read_ledger_dir

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "engine_ab_child.py")
FAST_EXIT = os.path.join(os.path.dirname(HERE), "fast_exit")  # engine_shim's sitecustomize installs it
GDN_LAYERS = ("model.layers.0.linear_attn", "model.layers.2.linear_attn")
PROMPT_LENGTHS = "5,17,40"  # tokens that do not move with the block count (see test_kv_engine_ab)
# the conv-state layout of each activation run (conftest's activation_run): vLLM's CPU default (SD, no layout set)
# except the plugin's, which runs DS and so is also the patched side of the DS layout A/B (test_kv_engine_ab[DS]):
# one engine start for both
ACTIVATION_LAYOUTS = {("plugin", "separate"): "DS"}


def build_tiny_model(path: str) -> None:
    """Save a random-weight Qwen3-Next model (2 GDN + 2 full-attention layers) from a fixed seed."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        decoder_sparse_step=1, max_position_embeddings=1024, initializer_range=0.05, torch_dtype="bfloat16")
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def run_engine(model: str, workdir: str, name: str, **env: str) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Run one engine in a fresh process, every process activated by ``engine_shim``'s sitecustomize (when the
    switches enable the overlay); return its tokens and every process's ledger.

    Raises:
        AssertionError: the run failed; the message names the run (``name``) and ends with its output.
    """
    pythonpath = os.pathsep.join(filter(None, [os.path.join(HERE, "engine_shim"), FAST_EXIT,
                                                os.environ.get("PYTHONPATH")]))
    return run_child([sys.executable, CHILD], model, pathlib.Path(workdir), name,
                     {key: value for key, value in os.environ.items() if not key.startswith("KDA_PATCHES")},
                     dict(env, PYTHONPATH=pythonpath))


def run_child(command: list[str], model: str, workdir: pathlib.Path, name: str, base_env: dict[str, str],
              env: dict[str, str]) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Run ``command MODEL OUT`` (the engine child) with ``base_env`` plus ``env`` and the run's status dir and
    workload; return its tokens and every process's ledger.

    Raises:
        AssertionError: the run failed; the message names the run (``name``) and ends with its output.
    """
    status, out = workdir / f"status-{name}", workdir / f"{name}.json"
    child_env = dict(base_env, **env, KDA_PATCHES_STATUS_DIR=str(status), VLLM_CPU_KVCACHE_SPACE="1",
                     KDA_TEST_PROMPT_LENGTHS=PROMPT_LENGTHS)
    result = subprocess.run([*command, model, str(out)], env=child_env, capture_output=True, text=True,
                            timeout=540)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    tokens = json.loads(out.read_text())["tokens"]
    return tokens, read_ledger_dir(str(status)) if status.is_dir() else []


def layout_facts(ledgers: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the ``kv_cache_layout`` facts and counters of all processes."""
    facts: dict[str, Any] = {}
    counters: dict[str, int] = {}
    for ledger in ledgers:
        facts.update(ledger["facts"].get("kv_cache_layout", {}))
        for key, value in ledger["counters"].get("kv_cache_layout", {}).items():
            counters[key] = counters.get(key, 0) + value
    facts["counters"] = counters
    return facts


def make_pth_python(env_dir: pathlib.Path) -> str:
    """Create an interpreter environment in ``env_dir`` whose site-packages holds the main venv's path and the
    ``kda_patches.pth`` that ``kda-patches install --prefix`` writes; return its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site_dir = pathlib.Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                            "['purelib'])"], check=True, capture_output=True, text=True)
                            .stdout.strip())
    # .pth files run in name order: the main venv's packages first, then the overlay's own line, written by
    # the real installer (`kda-patches install --prefix ENV` targets ENV/lib/pythonX.Y/site-packages)
    root = pathlib.Path(HERE).parents[1]
    (site_dir / "00_main_venv.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{root}\n")
    done = subprocess.run([sys.executable, "-m", "kda_patches", "install", "--prefix", str(env_dir)],
                          capture_output=True, text=True, check=True)
    assert (site_dir / PTH_NAME).is_file(), done.stdout + done.stderr
    return str(python)


def run_activation_path(path: str, model: str, workdir: pathlib.Path, name: str, pth_python: str,
                        **env: str) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Run the engine workload with the overlay activated only through ``path`` (``plugin``: vLLM's plugin entry
    point alone; ``pth``: ``pth_python``'s ``kda_patches.pth``; ``launcher``: ``kda-run``); return its tokens and
    every process's ledger.

    Raises:
        AssertionError: the run failed; the message names the run and ends with its output.
    """
    command = {"plugin": [sys.executable, CHILD],
               "pth": [pth_python, CHILD],
               "launcher": [str(pathlib.Path(sys.executable).parent / "kda-run"), sys.executable, CHILD]}[path]
    base = {key: value for key, value in os.environ.items()
            if not key.startswith("KDA_PATCHES") and key != "PYTHONPATH"}
    # the test-only fast exit of spawned children (tests/fast_exit; it does not activate the overlay)
    return run_child(command, model, workdir, name, base, dict(env, PYTHONPATH=FAST_EXIT))


def activation_layout(path: str, mode: str) -> str:
    """Return the conv-state layout (``SD`` / ``DS``) of the ``(path, mode)`` activation run
    (:data:`ACTIVATION_LAYOUTS`)."""
    return ACTIVATION_LAYOUTS.get((path, mode), "SD")
