"""Engine A/B on real vLLM 0.32 (CPU) with the tiny Qwen3-Next model: the patch on, in the default (auto)
mode and in the opt-in separate mode, gives the baseline's tokens; the ledgers show each layout decision.
Both conv-state layouts (SD, DS) are served.

Workload: prompts of 5, 17 and 40 tokens plus two sharing a 64-token prefix, 24 greedy tokens each, chunked
prefill. The random tiny model in bf16 has near-ties that flip with kernel paths: on the *unpatched* engine,
changing only ``num_gpu_blocks_override`` (4096 -> 2688, prefix caching off) already changes the greedy tokens
of a 77-token prompt. The separate mode shrinks the block count by design (its memory is taken from the KV
budget), so the A/B workload is one whose baseline tokens do not move with the block count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kda_patches.ledger import read_ledger_dir

HERE = os.path.dirname(os.path.abspath(__file__))
GDN_LAYERS = ("model.layers.0.linear_attn", "model.layers.2.linear_attn")


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


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen3-next"))
    build_tiny_model(path)
    return path


PROMPT_LENGTHS = "5,17,40"


def run_engine(model: str, workdir: str, name: str, **env: str) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Run one engine in a fresh process; return its tokens and every process's ledger."""
    status = os.path.join(workdir, f"status-{name}")
    out = os.path.join(workdir, f"{name}.json")
    child_env = {key: value for key, value in os.environ.items() if not key.startswith("KDA_PATCHES")}
    child_env.update(env, KDA_PATCHES_STATUS_DIR=status, VLLM_CPU_KVCACHE_SPACE="1",
                     KDA_TEST_PROMPT_LENGTHS=PROMPT_LENGTHS,
                     PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(HERE, "engine_shim"),
                                                              os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, os.path.join(HERE, "engine_ab_child.py"), model, out],
                            env=child_env, capture_output=True, text=True, timeout=540)
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


@pytest.mark.engine
@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_engine_ab_identical_tokens_and_ledger_verdicts(tiny_model: str, tmp_path: Any, conv_layout: str) -> None:
    workdir = str(tmp_path)
    layout = {"VLLM_SSM_CONV_STATE_LAYOUT": conv_layout}
    baseline, base_ledgers = run_engine(tiny_model, workdir, "baseline", KDA_PATCHES="0", **layout)
    assert "summary" not in layout_facts(base_ledgers)
    separate, sep_ledgers = run_engine(tiny_model, workdir, "separate", KDA_PATCHES_KV_STATE_MODE="separate",
                                       KDA_PATCHES_STRICT="1", **layout)
    assert separate == baseline
    facts = layout_facts(sep_ledgers)
    for name in GDN_LAYERS:
        assert facts[name]["decision"] == "separate", facts[name]
        assert facts[name]["verdict"] == "rejected"
    assert facts["counters"]["state_binds_dense"] == len(GDN_LAYERS)
    budget = facts["separate_budget"]
    assert budget["reduced_memory"][0] < budget["available_memory"][0]
    assert facts["summary"]["separate_bytes"] == budget["workers"][0]["reserved_bytes"] > 0
    print(f"\n[{conv_layout}] separate mode: {budget['workers'][0]}")
    if conv_layout == "SD":
        auto, auto_ledgers = run_engine(tiny_model, workdir, "auto", KDA_PATCHES_STRICT="1", **layout)
        assert auto == baseline
        facts = layout_facts(auto_ledgers)
        for name in GDN_LAYERS:
            assert (facts[name]["decision"], facts[name]["verdict"]) == ("upstream", "rejected"), facts[name]
        assert facts["counters"]["state_binds_upstream"] == len(GDN_LAYERS)
        print(f"[SD] auto summary: {facts['summary']}")
