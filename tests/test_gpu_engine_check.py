"""``scripts/gpu/vllm_engine_check.py`` on the CPU (issue 18): its dry run, and the op recorder's rules -- a missing
compiled op stays missing unless declared, a declared lookup-only op refuses to run, and torch's lookup comes back.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "vllm_engine_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("vllm_engine_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recorder():
    module = load_script()
    recorder = module.OpRecorder()
    recorder.install()
    yield module, recorder
    recorder.uninstall()


def test_the_dry_run_writes_the_model_and_lists_every_stand_in(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--dry-run"], capture_output=True,
                          text=True, check=True)
    assert "DRYRUN" in done.stdout
    report = json.loads((tmp_path / "vllm_engine.json").read_text())
    config = json.loads((tmp_path / "qwen3_5_tiny" / "config.json").read_text())
    assert report["model"] == config and config["layer_types"].count("linear_attention") == 2
    module = load_script()
    declared = {f"torch.ops._C.{name}" for name in {**module.OP_LOOKUP_ONLY, **module.OP_STAND_INS}}
    assert declared <= set(report["stood_in"]) and all(report["stood_in"].values())
    assert "runs" in report and report["runs"] == []  # nothing was started


def test_an_undeclared_missing_op_stays_missing_and_is_recorded(recorder):
    _, recorder = recorder
    name = "kda_test_op_that_does_not_exist"
    assert not hasattr(torch.ops._C, name)  # a capability probe keeps its answer
    assert name in recorder.looked_up and recorder.looked_up[name].endswith(str(_line_of_hasattr()))


def _line_of_hasattr() -> int:
    source = pathlib.Path(__file__).read_text().splitlines()
    return next(number for number, line in enumerate(source, 1) if "assert not hasattr(torch.ops._C, name)" in line)


def test_a_declared_lookup_only_op_is_found_and_refuses_to_run(recorder, monkeypatch):
    module, recorder = recorder
    monkeypatch.setitem(module.OP_LOOKUP_ONLY, "kda_test_lookup_only", "a test declaration")
    op = torch.ops._C.kda_test_lookup_only
    with pytest.raises(module.StoodInOpCalled, match="kda_test_lookup_only"):
        op(torch.zeros(2))


def test_uninstall_gives_torch_its_own_lookup_back(recorder, monkeypatch):
    module, recorder = recorder
    monkeypatch.setitem(module.OP_LOOKUP_ONLY, "kda_test_lookup_only", "a test declaration")
    recorder.uninstall()
    with pytest.raises(AttributeError):
        torch.ops._C.kda_test_lookup_only  # noqa: B018


def test_a_cuda_view_of_unpinned_memory_is_refused():
    module = load_script()
    with pytest.raises(RuntimeError, match="pinned"):
        module.cuda_view_of(torch.zeros(4, dtype=torch.int32))
