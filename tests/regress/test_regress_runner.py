"""The A/B runner end to end on a cheap workload whose output depends on a dummy patch.

Each A/B starts two fresh interpreters (well under a second each): the baseline with
``KDA_PATCHES=0`` and the patched run with ``KDA_PATCHES=1`` + ``KDA_PATCHES_STRICT=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kda_patches.regress.processes import group_has_live_members, terminate_group, wait_for_group_exit
from kda_patches.regress.report import format_report, report_as_dict
from kda_patches.regress.runner import prepare_child_env, run_ab
from kda_patches.regress.workloads import resolve_workload

HERE = os.path.dirname(os.path.abspath(__file__))
DUMMY = resolve_workload("kda_regress_dummy:compute")
EXPECT = ("dummy_offset:calls_routed",)


def ab(**kwargs):
    kwargs.setdefault("expect", EXPECT)
    return run_ab(DUMMY, pythonpath=(HERE,), **kwargs)


def test_child_environment_forces_the_ab_switches() -> None:
    base = {"KDA_PATCHES": "1", "KDA_PATCHES_STRICT": "0", "KDA_PATCHES_ROLE": "x", "KDA_PATCHES_DISABLE": "a",
            "KDA_PATCHES_STATUS_DIR": "/elsewhere", "PYTHONPATH": "/p1", "HOME": "/h"}
    baseline = prepare_child_env(base, False, "/s/a", ("/extra",))
    assert baseline["KDA_PATCHES"] == "0" and "KDA_PATCHES_STRICT" not in baseline
    assert baseline["KDA_PATCHES_STATUS_DIR"] == "/s/a" and "KDA_PATCHES_ROLE" not in baseline
    assert baseline["PYTHONPATH"] == os.pathsep.join(["/extra", "/p1"]) and baseline["HOME"] == "/h"
    patched = prepare_child_env(base, True, "/s/b")
    assert (patched["KDA_PATCHES"], patched["KDA_PATCHES_STRICT"]) == ("1", "1")
    assert patched["KDA_PATCHES_DISABLE"] == "a"  # bisecting switches pass through


def test_equal_outputs_with_patch_applied_and_ledgers_reported() -> None:
    report = ab(params={"mode": "none"})
    assert report.verdict == "equal" and report.exit_code == 0, format_report(report)
    assert report.baseline.source == report.patched.source == "run"
    assert report.baseline.wall_s > 0 and report.patched.workload_s > 0
    assert report.expectations and all(met for met, _ in report.expectations)
    (main,) = report.patched.ledgers
    assert main["patches"]["dummy_offset"]["state"] == "applied"
    assert main["counters"]["dummy_offset"] == {"calls_routed": 16}
    assert all(p["state"] != "applied" for e in report.baseline.ledgers for p in e["patches"].values())
    text = format_report(report)
    assert "RESULT: EQUAL" in text and f"pid {main['pid']}  role main" in text
    assert "dummy_offset: calls_routed=16" in text and "wall" in text
    assert report.work_dir is None  # temporary work dir removed after a clean run


def test_difference_is_detected_and_first_difference_reported() -> None:
    report = ab(params={"mode": "token"})
    assert report.verdict == "different" and report.exit_code == 1
    first = report.comparison.first
    assert first.path == "tokens[5]" and first.patched == first.baseline + 1
    assert report.comparison.differing == 1
    text = format_report(report)
    assert "RESULT: DIFFERENT" in text and f"tokens[5]: baseline {first.baseline}, patched {first.patched}" in text
    as_json = json.loads(json.dumps(report_as_dict(report)))
    assert as_json["comparison"]["first_difference"]["path"] == "tokens[5]" and as_json["exit_code"] == 1


def test_tolerance_flags_apply_to_tensors_only_as_asked() -> None:
    exact = ab(params={"mode": "drift"})
    assert exact.verdict == "different" and exact.comparison.first.path == "scores[0]"
    assert exact.comparison.differing == 8
    tolerant = ab(params={"mode": "drift"}, atol=1e-5)
    assert tolerant.verdict == "equal", format_report(tolerant)
    assert 0 < tolerant.comparison.max_abs_diff < 1e-5


def test_ledgers_of_every_process_are_aggregated() -> None:
    report = ab(params={"mode": "none", "processes": 3})
    assert report.verdict == "equal", format_report(report)
    ledgers = report.patched.ledgers
    assert len(ledgers) == 3 and len({entry["pid"] for entry in ledgers}) == 3
    assert sorted(entry["role"] for entry in ledgers) == ["SpawnProcess-1", "SpawnProcess-2", "main"]
    assert all(entry["counters"]["dummy_offset"]["calls_routed"] == 16 for entry in ledgers)
    assert "all processes: dummy_offset: calls_routed=48" in format_report(report)


def test_unmet_expectation_fails_the_run() -> None:
    report = ab(params={"mode": "none"}, expect=("dummy_offset:calls_bypassed", "gdn_host_flags"))
    assert report.verdict == "equal" and report.exit_code == 1
    assert [met for met, _ in report.expectations] == [False, False]
    assert "expect FAIL dummy_offset:calls_bypassed: NOT met" in format_report(report)


def test_strict_skip_in_the_patched_run_is_an_error() -> None:
    report = ab(params={"mode": "drifted-signature"})
    assert report.verdict == "error" and report.exit_code == 2
    assert report.baseline.ok and not report.patched.ok
    assert "patched run exited with status 1" in report.errors
    assert "KDA_PATCHES_STRICT=1" in report.patched.log_tail
    (main,) = report.patched.ledgers
    assert main["patches"]["dummy_offset"]["state"] == "skipped"
    assert report.work_dir and os.path.isfile(os.path.join(report.work_dir, "patched", "run.log"))
    assert "RESULT: ERROR" in format_report(report)


def test_failing_workload_reports_its_log_and_skips_the_patched_run() -> None:
    report = ab(params={"mode": "raise"})
    assert report.verdict == "error" and report.patched.source == "not run"
    assert "dummy workload failed on purpose" in report.baseline.log_tail
    assert "dummy workload failed on purpose" in format_report(report)


def test_process_group_liveness() -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    assert group_has_live_members(process.pid)
    terminate_group(process.pid, process)
    assert process.returncode is not None and not group_has_live_members(process.pid)
    assert wait_for_group_exit(process.pid, 1.0)


def test_a_run_past_its_timeout_is_killed_and_reported() -> None:
    report = ab(params={"mode": "hang"}, timeout_s=3)
    assert report.verdict == "error" and report.baseline.error == "timed out after 3 s"
    assert report.baseline.wall_s < 10 and report.patched.source == "not run"


def test_baseline_is_created_reused_compared_and_updated(tmp_path) -> None:
    store = str(tmp_path / "baselines")
    created = ab(params={"mode": "none"}, baseline_dir=store)
    assert created.verdict == "equal" and created.baseline_action == "created"
    assert os.path.isfile(created.baseline_file)

    reused = ab(params={"mode": "none"}, baseline_dir=store)
    assert reused.baseline.source == "stored" and reused.baseline_action == "stored"
    assert reused.baseline.wall_s == created.baseline.wall_s and reused.verdict == "equal"

    with open(created.baseline_file) as handle:
        record = json.load(handle)
    record["outputs"]["tokens"][2] += 100  # the stored baseline, not a fresh run, is what is compared
    with open(created.baseline_file, "w") as handle:
        json.dump(record, handle)
    tampered = ab(params={"mode": "none"}, baseline_dir=store)
    assert tampered.verdict == "different" and tampered.comparison.first.path == "tokens[2]"
    assert "stored" in format_report(tampered)

    updated = ab(params={"mode": "none"}, baseline_dir=store, update_baseline=True)
    assert updated.baseline.source == "run" and updated.baseline_action == "updated"
    assert updated.verdict == "equal"

    mismatch = ab(params={"mode": "token"}, baseline_dir=store)
    assert mismatch.verdict == "error" and "recorded with parameters" in mismatch.errors[0]


def test_work_dir_keeps_logs_outputs_and_ledgers(tmp_path) -> None:
    report = ab(params={"mode": "none"}, work_dir=str(tmp_path / "work"))
    assert report.work_dir == str(tmp_path / "work")
    for side in ("baseline", "patched"):
        names = set(os.listdir(tmp_path / "work" / side))
        assert {"outputs.json", "run.log", "status"} <= names
        assert os.listdir(tmp_path / "work" / side / "status")


def test_a_baseline_that_differs_from_itself_is_reported_as_such_not_blamed_on_the_overlay() -> None:
    blamed = ab(params={"mode": "unstable"})
    assert blamed.verdict == "different"  # one baseline run: the overlay would be blamed
    report = ab(params={"mode": "unstable"}, baseline_runs=2)
    assert report.verdict == "baseline unstable" and report.exit_code == 3, format_report(report)
    text = format_report(report)
    assert "RESULT: BASELINE UNSTABLE" in text and "the unpatched runs DIFFER" in text
    assert report_as_dict(report)["baseline_self_check"] == {"equal": False, "runs": 2, "differing": 1}


def test_two_agreeing_baselines_are_stated_and_the_schedule_is_reported() -> None:
    report = ab(params={"mode": "none"}, baseline_runs=2)
    assert report.verdict == "equal" and report.exit_code == 0
    text = format_report(report)
    assert "baseline self-check: 2 unpatched runs agree" in text
    assert "schedule  not stated by the workload" in text  # a module:function workload says nothing
    assert resolve_workload("tiny-qwen3-next").schedule.startswith("timing-independent")
