"""`kda-patches doctor` on the real installed stack (vLLM 0.32 CPU; no Ascend forks)."""

from __future__ import annotations

import json

from kda_patches.cli import main


def test_doctor_resolves_upstream_targets_and_reports_missing_forks(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["packages"]["vllm"].startswith("0.32")
    assert report["packages"]["vllm_ascend"] is None
    gdn = report["patches"]["gdn_host_flags"]["targets"]
    upstream = gdn["vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder.build [vllm]"]
    assert upstream == {"resolves": True, "reason": "version 0.32.0"}
    ascend = gdn["vllm_ascend.ops.gdn_attn_builder:AscendGDNAttentionMetadataBuilder.build [vllm-ascend]"]
    assert ascend["resolves"] is False and "not installed" in ascend["reason"]
    assert "bootstrap" in report
    assert report["device"]["backend"] == "cpu-interpreter"  # make test runs with TRITON_INTERPRET=1
    assert report["device"]["route_float32"]["kind"] == "fused"
    assert report["device"]["route_float16"]["kind"] == "fallback"
    assert "imports torch, vLLM" in report["note"]


def test_doctor_text_output_names_every_patch(capsys):
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    for name in report_patch_names():
        assert f"patch {name}" in text


def report_patch_names() -> list[str]:
    from kda_patches import registry

    return list(registry.all_patches())
