"""Engine A/B on real vLLM 0.32 (CPU) with the tiny Qwen3-Next model: the patch on, in the default (auto)
mode and in the opt-in separate mode, gives the baseline's tokens; the ledgers show each layout decision.
Both conv-state layouts (SD, DS) are served.

Workload: prompts of 5, 17 and 40 tokens plus two sharing a 64-token prefix, 24 greedy tokens each, chunked
prefill. The random tiny model in bf16 has near-ties that flip with kernel paths: on the *unpatched* engine,
changing only ``num_gpu_blocks_override`` (4096 -> 2688, prefix caching off) already changes the greedy tokens
of a 77-token prompt. The separate mode shrinks the block count by design (its memory is taken from the KV
budget), so the A/B workload is one whose baseline tokens do not move with the block count.

Every run is the session's (``conftest.py``), shared with ``test_kv_activation_paths``: SD's baseline is
``sd_baseline``, its patched runs ``activation_run``'s ``.pth`` runs in separate and auto mode (STRICT, the overlay
imported at interpreter start in every process); DS's baseline is ``ds_baseline``, its patched run the plugin
activation path's separate-mode run (STRICT, DS conv states: ``engine_runs.ACTIVATION_LAYOUTS``), so the DS
A/B adds one engine start (its baseline), not two.
"""

from __future__ import annotations

import pytest
from engine_runs import GDN_LAYERS, activation_layout, layout_facts

SEPARATE_RUNS = (("pth", "separate"), ("plugin", "separate"))  # activation runs in separate mode: one per layout


@pytest.mark.engine
@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_engine_ab_identical_tokens_and_ledger_verdicts(conv_layout: str, request: pytest.FixtureRequest) -> None:
    # the same unpatched processes as the activation paths' baselines: run once per session (conftest)
    baseline, base_ledgers = request.getfixturevalue({"SD": "sd_baseline", "DS": "ds_baseline"}[conv_layout])
    assert "summary" not in layout_facts(base_ledgers)
    # the same patched process as an activation path's separate-mode run of this layout: run once (conftest)
    path = next(path for path, mode in SEPARATE_RUNS if activation_layout(path, mode) == conv_layout)
    separate, sep_ledgers = request.getfixturevalue("activation_run")(path, "separate")
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
