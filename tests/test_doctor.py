"""`kda-patches doctor` on the real installed stack (vLLM 0.32 CPU; no Ascend forks)."""

from __future__ import annotations

import json

import pytest

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


# -- fla_npu (issue 53.2): a fake package for fla_npu itself; everything else is the real installed stack ------------

def install_fake_fla_npu(root, monkeypatch, distribution: str | None, version: str = "") -> None:
    """An importable ``fla_npu`` under ``root`` (never imported by doctor), with a distribution's metadata if named."""
    (root / "fla_npu").mkdir()
    (root / "fla_npu" / "__init__.py").write_text("raise ImportError('doctor must not import fla_npu')\n")
    if distribution is not None:
        info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        (info / "top_level.txt").write_text("fla_npu\n")
    monkeypatch.syspath_prepend(str(root))


def test_doctor_says_fla_npu_is_not_installed(capsys):
    from kda_patches.doctor import describe_fla_npu

    assert describe_fla_npu(None) == {"distribution": None, "version": None,
                                      "stride_aware_state_kernels": "not installed",
                                      "needed": "vllm-ascend not installed"}
    assert main(["doctor"]) == 0
    assert "stride-aware state kernels: not installed" in capsys.readouterr().out


def test_fla_npu_of_the_v26_6_line_lacks_stride_aware_state_kernels(tmp_path, monkeypatch):
    from kda_patches.doctor import describe_fla_npu

    install_fake_fla_npu(tmp_path, monkeypatch, "flash-linear-attention-npu", "26.6.0")
    report = describe_fla_npu("0.30.0rc2")
    assert (report["distribution"], report["version"]) == ("flash-linear-attention-npu", "26.6.0")
    assert report["stride_aware_state_kernels"].startswith("no: 26.6.0 predates the stride-aware state kernels")
    assert report["needed"].startswith("yes: vllm-ascend 0.30 binds GDN/KDA state views page-strided")


def test_fla_npu_main_build_is_undetermined_and_names_its_commit(tmp_path, monkeypatch):
    from kda_patches.doctor import describe_fla_npu

    install_fake_fla_npu(tmp_path, monkeypatch, "flash-linear-attention-npu", "26.7.0.dev0+main.17e24fdd")
    verdict = describe_fla_npu("0.29.0rc1")["stride_aware_state_kernels"]
    assert verdict.startswith("cannot be determined from Python: a main build of 17e24fdd")
    assert "e1f7a5d7 and bb310ef9" in verdict and "833fb6d7" in verdict


def test_fla_npu_tier_wheel_after_the_read_lines_is_undetermined(tmp_path, monkeypatch):
    from kda_patches.doctor import describe_fla_npu

    install_fake_fla_npu(tmp_path, monkeypatch, "flash-linear-attention-npu-a3", "26.9.1+deva4a7958")
    report = describe_fla_npu("0.29.0rc1")
    assert report["distribution"] == "flash-linear-attention-npu-a3"
    assert report["stride_aware_state_kernels"].startswith("cannot be determined from Python: the kernels")
    assert report["needed"].startswith("no: vllm-ascend up to 0.29 binds dense per-state views")


def test_fla_npu_without_metadata_is_undetermined(tmp_path, monkeypatch):
    from kda_patches.doctor import describe_fla_npu

    install_fake_fla_npu(tmp_path, monkeypatch, None)
    report = describe_fla_npu(None)
    assert report["version"] is None
    assert report["stride_aware_state_kernels"].startswith("cannot be determined: fla_npu is importable but no")


@pytest.mark.parametrize(("version", "lacks"), [
    ("0.1.0", True), ("26.1.0", True), ("26.6.0", True), ("26.6.9+main.abc", True),
    ("1.0.0", False), ("26.7.0.dev0+main.abc", False), ("26.9.1", False)])
def test_only_the_release_lines_read_without_the_commits_say_no(version, lacks):
    from kda_patches.doctor import fla_npu_stride_aware

    assert fla_npu_stride_aware(version).startswith("no: ") is lacks
    assert fla_npu_stride_aware(version).startswith("cannot be determined") is not lacks
