"""The harness itself: bitwise comparison catches NaN-payload flips; the loader refuses what is not declared."""

from __future__ import annotations

import importlib
import sys

import pytest
import released_ab
import torch
from release_loader import ReleaseStack, StandInNotProvided


def test_compare_runs_is_bitwise_and_sees_one_flipped_nan_payload() -> None:
    raw = torch.empty(64, dtype=torch.float32)
    raw.view(torch.int32).fill_(0x7FC0BEEF)  # NaN: torch.equal on the floats would call equal copies different
    run = {"outputs": [torch.randn(3)], "snapshots": [{"cache": raw}]}
    same = {"outputs": [run["outputs"][0].clone()], "snapshots": [{"cache": raw.clone()}]}
    assert released_ab.compare_runs(run, same) == []
    flipped = raw.clone()
    flipped.view(torch.int32)[17] ^= 1  # still a NaN, different payload
    problems = released_ab.compare_runs(run, {"outputs": same["outputs"], "snapshots": [{"cache": flipped}]})
    assert problems == ["snapshot 0 (after batch 0), cache cache: 1 elements differ, first at flat [17]"]


@pytest.fixture
def release_tree(tmp_path):
    package = tmp_path / "fakefork" / "ops"
    package.mkdir(parents=True)
    (package / "layer.py").write_text(
        "import torch\nfrom fakefork.kernels import fast_copy\nfrom vllm.config import VllmConfig\n"
        "def run(x):\n    return fast_copy(x)\n"
        "def configure():\n    return VllmConfig()\n")
    (package / "undeclared.py").write_text("import requests\n")
    stack = ReleaseStack(tmp_path, "fakefork", "1.2.3", ["fakefork.ops.layer", "fakefork.ops.undeclared"],
                         real=("torch",), standins={"fakefork.kernels": {"fast_copy": lambda x: x + 1}},
                         inert=("vllm",)).install()
    yield stack
    stack.uninstall()


def test_release_file_runs_under_its_name_with_its_filename_and_declared_imports(release_tree) -> None:
    module = importlib.import_module("fakefork.ops.layer")
    assert sys.modules["fakefork.ops.layer"] is module
    assert module.run.__code__.co_filename == str(release_tree.path_of("fakefork.ops.layer"))
    assert module.run(torch.ones(2)).tolist() == [2.0, 2.0]
    assert release_tree.bound["fakefork.kernels"] == {"fast_copy": "standin"}
    assert release_tree.bound["vllm.config"] == {"VllmConfig": "inert"}
    with pytest.raises(StandInNotProvided, match=r"vllm\.config\.VllmConfig is declared inert"):
        module.configure()
    assert importlib.metadata.version("fakefork") == "1.2.3"


def test_undeclared_import_in_a_release_file_fails_naming_it(release_tree) -> None:
    with pytest.raises(ImportError, match=r"import of .requests. is not declared"):
        importlib.import_module("fakefork.ops.undeclared")


def test_lifted_device_guard_is_left_out_and_only_that_one(tmp_path) -> None:
    package = tmp_path / "guarded"
    package.mkdir()
    (package / "op.py").write_text(
        "def copy(state, rows):\n    assert state.is_cuda or state.is_xpu\n    assert rows >= 0\n"
        "    return state[rows]\n")
    (package / "other.py").write_text("def copy(state):\n    assert state.is_cuda\n    return state\n")
    stack = ReleaseStack(tmp_path, "guarded", "0.1", ["guarded.op", "guarded.other"],
                         lifted={"guarded.op": ("state.is_cuda or state.is_xpu",),
                                 "guarded.other": ("state.is_cuda or state.is_xpu",)}).install()
    try:
        module = importlib.import_module("guarded.op")
        assert module.copy(torch.arange(4.0), 2).item() == 2.0  # a CPU tensor passes the lifted guard
        with pytest.raises(AssertionError):
            module.copy(torch.arange(4.0), -1)  # every other assert is the release's, kept
        assert module.copy.__code__.co_filename == str(stack.path_of("guarded.op"))
        assert stack.bound["guarded.op"] == {"assert state.is_cuda or state.is_xpu": "lifted"}
        with pytest.raises(ImportError, match=r"lifted guard\(s\) \[.state.is_cuda or state.is_xpu.\] not found"):
            importlib.import_module("guarded.other")  # the file's guard differs: the declaration is stale
    finally:
        stack.uninstall()
