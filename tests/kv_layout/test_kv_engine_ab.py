"""Engine A/B on real vLLM 0.32 (CPU) with the tiny Qwen3-Next model: the patch on, in the default (auto)
mode and in the opt-in separate mode, gives the baseline's tokens; the ledgers show each layout decision.
Both conv-state layouts (SD, DS) are served.

Workload: prompts of 5, 17 and 40 tokens plus two sharing a 64-token prefix, 24 greedy tokens each, chunked
prefill. The random tiny model in bf16 has near-ties that flip with kernel paths: on the *unpatched* engine,
changing only ``num_gpu_blocks_override`` (4096 -> 2688, prefix caching off) already changes the greedy tokens
of a 77-token prompt. The separate mode shrinks the block count by design (its memory is taken from the KV
budget), so the A/B workload is one whose baseline tokens do not move with the block count.

The SD runs are the session's (``conftest.py``), shared with ``test_kv_activation_paths``: the baseline is
``sd_baseline``, the patched runs are ``activation_run``'s ``.pth`` runs in separate and auto mode (STRICT, the
overlay imported at interpreter start in every process). The DS runs are this test's own, activated by
``engine_shim``'s sitecustomize.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_runs import GDN_LAYERS, layout_facts, run_engine


@pytest.mark.engine
@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_engine_ab_identical_tokens_and_ledger_verdicts(tiny_model: str, tmp_path: Any, conv_layout: str,
                                                        request: pytest.FixtureRequest) -> None:
    workdir = str(tmp_path)
    layout = {"VLLM_SSM_CONV_STATE_LAYOUT": conv_layout}
    if conv_layout == "SD":  # the same unpatched process as the activation paths' baseline: run once (conftest)
        baseline, base_ledgers = request.getfixturevalue("sd_baseline")
    else:
        baseline, base_ledgers = run_engine(tiny_model, workdir, "baseline", KDA_PATCHES="0", **layout)
    assert "summary" not in layout_facts(base_ledgers)
    if conv_layout == "SD":  # the same patched processes as the .pth activation path's: run once (conftest)
        separate, sep_ledgers = request.getfixturevalue("activation_run")("pth", "separate")
    else:
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
        auto, auto_ledgers = request.getfixturevalue("activation_run")("pth", "auto")
        assert auto == baseline
        facts = layout_facts(auto_ledgers)
        for name in GDN_LAYERS:
            assert (facts[name]["decision"], facts[name]["verdict"]) == ("upstream", "rejected"), facts[name]
        assert facts["counters"]["state_binds_upstream"] == len(GDN_LAYERS)
        print(f"[SD] auto summary: {facts['summary']}")
