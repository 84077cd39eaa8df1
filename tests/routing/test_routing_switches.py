"""``KDA_PATCHES_KIMI_PLAN`` / ``KDA_PATCHES_GDN_PLAN`` / ``KDA_PATCHES_ROUTING`` parsing and the doctor's
state-copy seam rows."""

from __future__ import annotations

import pytest

from kda_patches.flags import parse_flags


def test_kimi_plan_defaults_to_fork_and_accepts_overlay():
    assert parse_flags({}).kimi_plan == "fork"
    assert parse_flags({"KDA_PATCHES_KIMI_PLAN": " Overlay "}).kimi_plan == "overlay"
    assert parse_flags({"KDA_PATCHES_KIMI_PLAN": "overlay"}).as_dict()["KDA_PATCHES_KIMI_PLAN"] == "overlay"


def test_gdn_plan_defaults_to_fork_and_accepts_overlay():
    assert parse_flags({}).gdn_plan == "fork"
    assert parse_flags({"KDA_PATCHES_GDN_PLAN": " Overlay "}).gdn_plan == "overlay"
    assert parse_flags({"KDA_PATCHES_GDN_PLAN": "overlay"}).as_dict()["KDA_PATCHES_GDN_PLAN"] == "overlay"
    assert not parse_flags({"KDA_PATCHES_GDN_PLAN": "overlay"}).warnings  # a known switch
    with pytest.raises(ValueError, match=r"KDA_PATCHES_GDN_PLAN='ours'.*fork, overlay"):
        parse_flags({"KDA_PATCHES_GDN_PLAN": "ours"})


def test_routing_defaults_to_rewrite_and_accepts_alias():
    assert parse_flags({}).routing == "rewrite"
    assert parse_flags({"KDA_PATCHES_ROUTING": " Alias "}).routing == "alias"
    assert parse_flags({"KDA_PATCHES_ROUTING": "alias"}).as_dict()["KDA_PATCHES_ROUTING"] == "alias"
    assert not parse_flags({"KDA_PATCHES_ROUTING": "alias"}).warnings  # a known switch


def test_a_malformed_routing_names_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=r"KDA_PATCHES_ROUTING='twin'.*rewrite, alias"):
        parse_flags({"KDA_PATCHES_ROUTING": "twin"})


def test_a_malformed_kimi_plan_names_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=r"KDA_PATCHES_KIMI_PLAN='ours'.*fork, overlay"):
        parse_flags({"KDA_PATCHES_KIMI_PLAN": "ours"})


def test_doctor_lists_every_declared_seam_with_its_clear():
    from kda_patches.doctor import describe_seams

    seams = describe_seams()
    assert seams["KDA_PATCHES_KIMI_PLAN"] in ("fork", "overlay")
    assert seams["KDA_PATCHES_GDN_PLAN"] in ("fork", "overlay")
    clears = {key.split(":")[1]: seam["clear"] for section in ("kimi_prefill", "gdn_state_copy")
              for key, seam in seams[section].items()}
    assert clears == {
        "AscendKimiGatedDeltaNetAttention._run_prefill": "function",
        "AscendKimiK3DeltaAttention._run_prefill": "function",
        "KimiK3DeltaAttention._forward": "none",
        "QwenGatedDeltaNetAttention._forward_core": "native",
        "OlmoHybridGatedDeltaNetAttention._forward_core": "native",
        "KimiGatedDeltaNetAttention._forward": "none",
        "AscendGatedDeltaNetAttention._forward_core": "function",
    }


def test_doctor_says_which_mechanism_each_seam_is_wrapped_with(routing, strict, monkeypatch):
    """A seam's routing fact (recorded when the registry wrapped it) shows in doctor; the switch too."""
    from kda_patches.doctor import describe_seams
    from kda_patches.ledger import get_ledger
    from kda_patches.patches import gdn_state_copy

    key = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention._forward_core"
    ledger = get_ledger()
    monkeypatch.setattr(ledger, "_facts", {section: dict(facts) for section, facts in ledger._facts.items()})
    ledger.set_fact(gdn_state_copy.LEDGER_PATH, f"routing {key}", {"seam": "q", "mechanism": routing})
    seams = describe_seams()
    assert seams["KDA_PATCHES_ROUTING"] == routing
    assert seams["gdn_state_copy"][key]["routing"] == routing
    unwrapped = "vllm_ascend.ops.gdn:AscendGatedDeltaNetAttention._forward_core"
    assert seams["gdn_state_copy"][unwrapped]["routing"] == "not wrapped here"
