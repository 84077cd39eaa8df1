"""Activation in fresh interpreters: no torch/vLLM on import, switches, status files, CLI status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kda_patches.cli import aggregate_ledgers, main


def run_python(code: str, **env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDA_PATCHES")}
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_import_pulls_in_neither_torch_nor_vllm():
    result = run_python("import kda_patches, sys; print(sorted(m for m in ('torch', 'vllm', 'wrapt', 'triton') "
                        "if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_master_switch_off_registers_no_hooks():
    result = run_python("import kda_patches, json; from kda_patches import hooks;"
                        "print(json.dumps([len(hooks._callbacks), kda_patches.get_ledger().snapshot()['patches']]))",
                        KDA_PATCHES="0")
    assert result.returncode == 0, result.stderr
    pending_hooks, patches = json.loads(result.stdout)
    assert pending_hooks == 0
    assert patches and all(p["state"] == "disabled" for p in patches.values())


def test_enabled_overlay_patches_vllm_builder_on_import():
    code = ("import kda_patches; import vllm.v1.attention.backends.gdn_attn as g;"
            "print(type(vars(g.GDNAttentionMetadataBuilder)['build']).__name__,"
            " kda_patches.get_ledger().patch_state('gdn_host_flags')[0])")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["FunctionWrapper", "applied"]


def test_disabled_patch_leaves_target_alone():
    code = ("import kda_patches; import vllm.v1.attention.backends.gdn_attn as g;"
            "print(type(vars(g.GDNAttentionMetadataBuilder)['build']).__name__,"
            " kda_patches.get_ledger().patch_state('gdn_host_flags')[0])")
    result = run_python(code, KDA_PATCHES_DISABLE="gdn_host_flags")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["function", "disabled"]


def test_unknown_patch_name_warns_on_stderr():
    result = run_python("import kda_patches", KDA_PATCHES_ONLY="gdn_hostflags")
    assert result.returncode == 0
    assert "gdn_hostflags" in result.stderr and "gdn_host_flags" in result.stderr


def test_status_dir_receives_every_process_ledger(tmp_path):
    code = "import kda_patches; kda_patches.get_ledger().count('demo_path', 'calls_seen', 3)"
    for _ in range(2):
        assert run_python(code, KDA_PATCHES_STATUS_DIR=str(tmp_path)).returncode == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(f.startswith("ledger-") and f.endswith(".json") for f in files)
    ledgers = [json.loads((tmp_path / f).read_text()) for f in files]
    assert aggregate_ledgers(ledgers)["counters"]["demo_path"]["calls_seen"] == 6


def test_cli_status_from_directory(tmp_path, capsys):
    code = "import kda_patches; kda_patches.get_ledger().count('demo_path', 'routed', 2)"
    assert run_python(code, KDA_PATCHES_STATUS_DIR=str(tmp_path)).returncode == 0
    assert main(["status", "--json", "--from", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["aggregate"]["processes"] == 1
    assert report["aggregate"]["counters"]["demo_path"]["routed"] == 2
    assert report["aggregate"]["patch_states"]["gdn_host_flags"] == {"pending": 1}


def test_cli_status_rejects_missing_directory(tmp_path, capsys):
    assert main(["status", "--from", str(tmp_path / "nope")]) == 2
    assert "KDA_PATCHES_STATUS_DIR" in capsys.readouterr().err


def test_console_script_status_lists_patches():
    script = os.path.join(os.path.dirname(sys.executable), "kda-patches")
    if not os.path.exists(script):
        pytest.fail("console script kda-patches missing: run `make setup` (pip install -e .)")
    result = subprocess.run([script, "status", "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "gdn_host_flags" in json.loads(result.stdout)["ledgers"][0]["patches"]
