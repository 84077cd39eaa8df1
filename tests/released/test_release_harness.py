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


def test_a_batch_keeps_each_cases_result_and_each_sides_failure(tmp_path) -> None:
    """One process per side runs every case; a raising case is reported for itself, the others keep their results;
    a side whose setup exits (any status) or raises fails every case's lookup naming the case, its seed, the
    configuration and the status; the processes end with the real status after running their atexit handlers."""
    marker = str(tmp_path / "atexit")
    sides = {"ok": "ok", "exits": "exit:3", "raises": "raise"}
    batch = released_ab.Batch("harness batch (harness_child.py)", "harness_child.py", (marker,),
                              ("first", "boom", "last"),
                              tuple((side, released_ab.Side(False, (("HARNESS_SIDE", side), ("HARNESS_SETUP", mode))))
                                    for side, mode in sides.items()))
    run = released_ab.run_batch(batch)
    assert released_ab.run_batch(batch) is run  # asked again (another test file): not run again

    for case in ("first", "last"):
        assert run.case(case, "ok")["outputs"][0].tolist() == [run.seeds[case]]
    assert len(set(run.seeds.values())) == 3  # a fresh seed per case
    assert run.process("ok")["pid"] == run.process("ok")["ledger"]["pid"]  # the driver's ledger is the child's
    boom = rf"case boom, seed {run.seeds['boom']}\nok \(KDA_PATCHES=0 .*\) raised in this case:\n(.|\n)*ValueError"
    with pytest.raises(AssertionError, match=boom):
        run.case("boom", "ok")

    with pytest.raises(AssertionError, match=r"harness batch \(harness_child.py\): case last, seed \d+\nexits "
                                             r"\(KDA_PATCHES=0 .*\): child harness_child.py .* exited 3:"):
        run.case("last", "exits")
    with pytest.raises(AssertionError, match=r"raises .* exited 1:\n(.|\n)*RuntimeError: setup refused"):
        run.case("first", "raises")
    for side in sides:  # atexit handlers ran before the fast exit, whatever the status
        assert (tmp_path / f"atexit.{side}").exists(), side
