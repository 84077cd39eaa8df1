"""Baseline store and ledger aggregation (in-process, no subprocesses)."""

from __future__ import annotations

import json
import os

import pytest

from kda_patches.ledger import write_ledger_file
from kda_patches.regress import baseline as store
from kda_patches.regress.ledgers import (
    check_expectation,
    collect_ledgers,
    find_applied_patches,
    summarize_ledger,
    total_counters,
)


def test_baseline_round_trip(tmp_path) -> None:
    path = store.write_baseline(str(tmp_path), "mod:func", "mod:func", {"n": 2}, {"tokens": [1, 2]}, 1.5)
    assert os.path.basename(path) == "mod_func.json"
    record = store.load_baseline(str(tmp_path), "mod:func", {"n": 2})
    assert record["outputs"] == {"tokens": [1, 2]} and record["wall_s"] == 1.5
    assert record["environment"]["python"] and "packages" in record["environment"]
    assert store.describe_environment_drift(record) == []
    assert store.load_baseline(str(tmp_path), "other", {}) is None


def test_baseline_recorded_with_other_params_is_refused(tmp_path) -> None:
    store.write_baseline(str(tmp_path), "w", "m:f", {"n": 2}, [], 0.0)
    with pytest.raises(store.BaselineMismatch, match="recorded with parameters"):
        store.load_baseline(str(tmp_path), "w", {"n": 3})


def test_environment_drift_is_described(tmp_path) -> None:
    path = store.write_baseline(str(tmp_path), "w", "m:f", {}, [], 0.0)
    with open(path) as handle:
        record = json.load(handle)
    record["environment"]["packages"]["vllm"] = "0.0.1"
    record["environment"]["packages"]["gone-package"] = "1.0"
    drift = store.describe_environment_drift(record)
    assert any(line.startswith("vllm 0.0.1 -> ") for line in drift)
    assert "gone-package 1.0 -> absent" in drift


def _ledger(pid: int, role: str, state: str, counters: dict) -> dict:
    return {"pid": pid, "role": role, "counters": counters,
            "patches": {"gdn_host_flags": {"state": state, "reason": "r", "targets": {
                "m:C.build": {"state": state, "reason": "r"}, "n:D.build": {"state": "pending", "reason": "w"}}}}}


def test_ledgers_are_read_summarized_and_totalled(tmp_path) -> None:
    counters = {"gdn_host_flags": {"builds_seen": 5, "builds_flagged": 2}}
    write_ledger_file(_ledger(30, "VllmWorker-0", "applied", counters), str(tmp_path))
    write_ledger_file(_ledger(20, "EngineCore", "pending", {}), str(tmp_path))
    write_ledger_file(_ledger(10, "main", "applied", {"gdn_host_flags": {"builds_seen": 1}}), str(tmp_path))
    summaries = collect_ledgers(str(tmp_path))
    assert [s["pid"] for s in summaries] == [10, 20, 30]
    assert summaries[2]["patches"]["gdn_host_flags"]["applied_targets"] == ["m:C.build"]
    assert total_counters(summaries) == {"gdn_host_flags": {"builds_flagged": 2, "builds_seen": 6}}
    met, text = check_expectation(summaries, "gdn_host_flags:builds_flagged")
    assert met and "pid 30 VllmWorker-0 builds_flagged=2" in text
    met, text = check_expectation(summaries, "gdn_host_flags:never_counted")
    assert not met and "NOT met" in text and "pid 20 EngineCore: pending" in text
    assert check_expectation(summaries, "gdn_host_flags")[0]
    assert not check_expectation(summaries, "kimi_prefill")[0]
    assert find_applied_patches(summaries) == ["pid 10 main: gdn_host_flags", "pid 30 VllmWorker-0: gdn_host_flags"]
    assert collect_ledgers(str(tmp_path / "missing")) == []


def test_summary_keeps_a_final_marker_when_present() -> None:
    ledger = _ledger(1, "main", "disabled", {})
    assert summarize_ledger(ledger)["final"] is None
    ledger["final"] = True
    assert summarize_ledger(ledger)["final"] is True
