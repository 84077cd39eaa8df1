"""Real-engine runs of the ``kv_cache_layout`` tests: the tiny model, one engine run per fresh process, facts.

Shared by ``test_kv_engine_ab`` and ``test_kv_activation_paths``; their common fixtures (one tiny model and one
unpatched SD baseline per session) are in this folder's ``conftest.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from kda_patches.ledger import read_ledger_dir

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "engine_ab_child.py")
FAST_EXIT = os.path.join(os.path.dirname(HERE), "fast_exit")  # engine_shim's sitecustomize installs it
GDN_LAYERS = ("model.layers.0.linear_attn", "model.layers.2.linear_attn")
PROMPT_LENGTHS = "5,17,40"  # tokens that do not move with the block count (see test_kv_engine_ab)


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
    status = os.path.join(workdir, f"status-{name}")
    out = os.path.join(workdir, f"{name}.json")
    child_env = {key: value for key, value in os.environ.items() if not key.startswith("KDA_PATCHES")}
    child_env.update(env, KDA_PATCHES_STATUS_DIR=status, VLLM_CPU_KVCACHE_SPACE="1",
                     KDA_TEST_PROMPT_LENGTHS=PROMPT_LENGTHS,
                     PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(HERE, "engine_shim"), FAST_EXIT,
                                                              os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, CHILD, model, out], env=child_env, capture_output=True, text=True,
                            timeout=540)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    with open(out) as handle:
        tokens = json.load(handle)["tokens"]
    return tokens, read_ledger_dir(status) if os.path.isdir(status) else []


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
