"""Ledger semantics: states, counters, facts, atomic files, fork behaviour."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from kda_patches.ledger import Ledger, get_ledger, read_ledger_dir, write_ledger_file


def test_patch_state_prefers_the_most_significant_target():
    ledger = Ledger()
    ledger.record_target("p", "m:a", "applied", "ok")
    ledger.record_target("p", "m:b", "pending", "waiting")
    assert ledger.patch_state("p") == ("applied", "ok")
    ledger.record_target("p", "m:c", "skipped", "drift")
    assert ledger.patch_state("p") == ("skipped", "drift")
    with pytest.raises(ValueError, match="unknown patch state"):
        ledger.record_target("p", "m:d", "half-applied")


def test_snapshot_is_json_and_written_atomically(tmp_path):
    ledger = Ledger()
    ledger.status_dir = str(tmp_path)
    ledger.count("path", "calls_seen", 2)
    ledger.set_fact("section", "layer.0", {"kind": "fused"})
    written = ledger.flush(force=True)
    data = json.loads(open(written).read())
    assert data["counters"]["path"]["calls_seen"] == 2
    assert data["facts"]["section"]["layer.0"] == {"kind": "fused"}
    assert [p.name for p in tmp_path.iterdir()] == [f"ledger-{ledger.pid}.json"]  # no temp files left
    assert read_ledger_dir(str(tmp_path))[0]["pid"] == ledger.pid


def test_failed_write_leaves_previous_file_and_no_temp_files(tmp_path, monkeypatch):
    write_ledger_file({"pid": 7, "version": 1}, str(tmp_path))

    def broken_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        write_ledger_file({"pid": 7, "version": 2}, str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["ledger-7.json"]
    assert json.loads((tmp_path / "ledger-7.json").read_text())["version"] == 1


def _child_report(queue) -> None:
    ledger = get_ledger()
    queue.put((ledger.pid, ledger.patch_state("fork_demo")[0], ledger.counters("fork_path")))


def test_forked_child_inherits_states_but_not_counters():
    parent = get_ledger()
    parent.record_target("fork_demo", "m:x", "applied", "wrapped")
    parent.count("fork_path", "calls", 5)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_report, args=(queue,))
    child.start()
    pid, state, counters = queue.get(timeout=60)
    child.join(60)
    assert pid == child.pid and pid != parent.pid
    assert state == "applied"
    assert counters == {}
