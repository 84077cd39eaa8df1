"""``kda-patches conformance``: dispatch, JSON, exit status, matrix writing, refused specs."""

from __future__ import annotations

import json
import pathlib

import pytest

from kda_patches import cli
from kda_patches.registry import Patch, Target
from kda_patches.releases import matrix


def test_json_report_of_a_paired_stack(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["conformance", "vllm-ascend==0.28.0rc1", "--json"])
    report = json.loads(capsys.readouterr().out)
    (stack,) = report["stacks"]
    assert stack["stack"] == "vllm-ascend==0.28.0rc1 + vllm==0.28.0"
    assert stack["releases"] == {"vllm-ascend": "0.28.0rc1", "vllm": "0.28.0"}
    verdicts = {name: entry["verdict"] for name, entry in stack["patches"].items()}
    assert set(verdicts.values()) <= {"works", "stands down", "verifies", "inert", "broken"}
    assert status == (1 if "broken" in verdicts.values() else 0)
    for entry in stack["patches"].values():
        for target in entry["targets"]:
            assert target["runtime"] in ("ok", "not-applicable", "skipped", "absent")


def _noop(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def test_exit_status_and_text_name_a_broken_record(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    drifted = Patch("t_drift", "test record", (
        Target("vllm.v1.worker.utils", "allocate_kv_cache", _noop, min_version="0.30", max_version="0.40",
               parameters=("kv_cache_config", "device")),))
    monkeypatch.setattr("kda_patches.registry.all_patches", lambda: {drifted.name: drifted})
    assert cli.main(["conformance", "vllm==0.32.0"]) == 1
    out = capsys.readouterr().out
    assert "t_drift: BROKEN" in out and "found (kv_cache_config, device, layout, kernel_block_sizes)" in out
    monkeypatch.setattr("kda_patches.registry.all_patches", lambda: {})
    assert cli.main(["conformance", "vllm==0.32.0", "--brief"]) == 0


def test_write_matrix(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.md"
    assert cli.main(["conformance", "vllm==0.33.0", "--brief", "--write-matrix", str(path)]) in (0, 1)
    text = path.read_text()
    assert text == matrix.render_matrix(matrix.run_matrix(["vllm==0.33.0"]))
    assert "| vllm==0.33.0 |" in text


@pytest.mark.parametrize("bad", ["vllm==", "numpy==1.0", "vllm-ascend==0.30.0rc2+vllm-ascend==0.29.0rc1"])
def test_bad_spec_exits_2_with_the_accepted_form(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["conformance", bad]) == 2
    assert "kda-patches conformance:" in capsys.readouterr().err


def test_fetch_failure_exits_2_naming_the_command(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KDA_PATCHES_RELEASE_CACHE", str(tmp_path))
    assert cli.main(["conformance", "vllm==0.0.0.99999"]) == 2
    assert "pip download" in capsys.readouterr().err
