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


EXIT_WRITE = '''
import json, os, signal, sys
import kda_patches.ledger as ledger_module

status, marker = sys.argv[1], sys.argv[2]

def on_term(number, frame):  # as vLLM's worker: SIGTERM raises SystemExit wherever the main thread is
    written = [name for name in os.listdir(status) if name.startswith("ledger-")]
    final = json.load(open(os.path.join(status, written[0])))["final"] if written else None
    open(marker, "w").write(json.dumps({"final_on_disk": final}))
    raise SystemExit(143)

signal.signal(signal.SIGTERM, on_term)
ledger = ledger_module.get_ledger()
ledger.status_dir = status
ledger.count("section", "calls")
original = ledger_module.write_ledger_file

def write_with_term(snapshot, folder):  # the executor's SIGTERM arrives during the exit-time write
    if snapshot["final"]:
        os.kill(os.getpid(), signal.SIGTERM)
    return original(snapshot, folder)

ledger_module.write_ledger_file = write_with_term
'''


def test_a_sigterm_during_the_exit_write_is_delivered_after_it(tmp_path):
    import json
    import subprocess
    import sys

    status, marker, script = tmp_path / "status", tmp_path / "marker.json", tmp_path / "exit_write.py"
    status.mkdir()
    script.write_text(EXIT_WRITE)
    subprocess.run([sys.executable, str(script), str(status), str(marker)], timeout=60, capture_output=True)
    # the handler ran (the signal was not lost) and saw the complete ledger already written
    assert json.loads(marker.read_text()) == {"final_on_disk": True}
    [written] = status.glob("ledger-*.json")
    assert json.loads(written.read_text())["final"] is True


def test_deferred_signals_restore_the_handlers_and_hold_nothing_off_the_main_thread():
    import signal
    import threading

    from kda_patches.ledger import DeferredSignals

    def mine(number, frame):
        raise AssertionError("not expected")

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with DeferredSignals() as held:
            assert signal.getsignal(signal.SIGTERM) is not mine
        assert signal.getsignal(signal.SIGTERM) is mine and held.held == []
        seen = []
        worker = threading.Thread(target=lambda: seen.append(DeferredSignals().__enter__()._previous))
        worker.start()
        worker.join()
        assert seen == [{}]
    finally:
        signal.signal(signal.SIGTERM, previous)
