"""``KDA_PATCHES_KIMI_PLAN`` parsing and the doctor's state-copy seam rows."""

from __future__ import annotations

import pytest

from kda_patches.flags import parse_flags


def test_kimi_plan_defaults_to_fork_and_accepts_overlay():
    assert parse_flags({}).kimi_plan == "fork"
    assert parse_flags({"KDA_PATCHES_KIMI_PLAN": " Overlay "}).kimi_plan == "overlay"
    assert parse_flags({"KDA_PATCHES_KIMI_PLAN": "overlay"}).as_dict()["KDA_PATCHES_KIMI_PLAN"] == "overlay"


def test_a_malformed_kimi_plan_names_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=r"KDA_PATCHES_KIMI_PLAN='ours'.*fork, overlay"):
        parse_flags({"KDA_PATCHES_KIMI_PLAN": "ours"})


def test_doctor_lists_every_declared_seam_with_its_clear():
    from kda_patches.doctor import describe_seams

    seams = describe_seams()
    assert seams["KDA_PATCHES_KIMI_PLAN"] in ("fork", "overlay")
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
