"""drift_probe: fixed device and host work timed round after round, the GPU's clocks beside (issue 26, run 6)."""

from __future__ import annotations

import json

import pytest
from script_loader import load_script


@pytest.fixture
def probe():
    return load_script("gpu/drift_probe.py", "drift_probe_under_test")


def test_each_round_times_both_segments_and_carries_its_clock_window(probe, tmp_path, monkeypatch):
    def sampler(path):
        return None, "no nvidia-smi in this test"

    monkeypatch.setattr(probe.gpu_clocks, "start_sampler", sampler)
    monkeypatch.setattr(probe, "HOST_LOOP", 1000)
    out = tmp_path / "probe.json"
    assert probe.main(["--out", str(out), "--seconds", "0.3", "--device", "cpu", "--size", "32",
                       "--products", "2"]) == 0
    result = json.loads(out.read_text())
    assert len(result["rounds"]) >= 1 and result["gpu_clocks"]["note"] == "no nvidia-smi in this test"
    for record in result["rounds"]:
        assert record["device_ms"] > 0 and record["host_ms"] > 0 and record["start"] <= record["end"]
        assert record["gpu"] == {"count": 0}
    assert set(result["spread"]) == {"device_ms", "host_ms"}  # no clock samples: no clock spread invented
    assert sum(row["rounds"] for row in result["host_ms_by_core"].values()) == len(result["rounds"])


def test_a_pinned_probe_runs_every_round_on_its_core(probe, tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(probe.gpu_clocks, "start_sampler", lambda path: (None, "none"))
    monkeypatch.setattr(probe, "HOST_LOOP", 1000)
    allowed = os.sched_getaffinity(0)
    core = max(allowed)
    try:
        assert probe.main(["--out", str(tmp_path / "p.json"), "--seconds", "0.2", "--device", "cpu", "--size", "16",
                           "--products", "1", "--cpus", str(core)]) == 0
    finally:
        os.sched_setaffinity(0, allowed)
    result = json.loads((tmp_path / "p.json").read_text())
    assert {record["cpu"] for record in result["rounds"]} == {core} and result["cpus"] == str(core)


def test_the_spread_is_taken_over_the_values(probe):
    assert probe.spread([2.0, 1.0, 4.0]) == {"min": 1.0, "median": 2.0, "max": 4.0, "max_over_min": 4.0}

