"""``kda-patches regress`` arguments and output, and the ``kda_ab`` pytest fixture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kda_patches.regress.cli import main
from kda_patches.regress.pytest_plugin import workload_spec
from kda_patches.regress.workloads import DEFAULT_WORKLOAD, resolve_workload

HERE = os.path.dirname(os.path.abspath(__file__))
DUMMY_ARGS = ["--workload", "kda_regress_dummy:compute", "--pythonpath", HERE]


def test_json_report_of_a_difference(capsys) -> None:
    code = main([*DUMMY_ARGS, "--param", 'mode="token"', "--expect", "dummy_offset:calls_routed", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["verdict"] == "different" and report["exit_code"] == 1
    assert report["comparison"]["first_difference"]["path"] == "tokens[5]"
    assert report["runs"]["baseline"]["switches"]["KDA_PATCHES"] == "0"
    assert report["runs"]["patched"]["switches"]["KDA_PATCHES_STRICT"] == "1"
    assert report["patched_counter_totals"] == {"dummy_offset": {"calls_routed": 16}}
    assert report["expectations"][0]["met"]


def test_text_report_baseline_options_and_tolerances(tmp_path, capsys) -> None:
    store = str(tmp_path / "b")
    assert main([*DUMMY_ARGS, "--param", "mode=drift", "--baseline", store, "--expect", "none"]) == 1
    assert "first difference" in capsys.readouterr().out
    assert main([*DUMMY_ARGS, "--param", "mode=drift", "--baseline", store, "--atol", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "baseline  stored" in out and "RESULT: EQUAL" in out and "atol=1e-05" in out
    assert main([*DUMMY_ARGS, "--param", "mode=drift", "--baseline", store, "--update-baseline", "--rtol", "1e-3"]) == 0
    assert "(updated)" in capsys.readouterr().out


def test_argument_errors_and_listing(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--update-baseline"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main(["--workload", "no-such-workload"])
    assert "registered: tiny-qwen3-next" in capsys.readouterr().err
    assert main(["--list-workloads"]) == 0
    assert DEFAULT_WORKLOAD in capsys.readouterr().out


def test_workload_resolution() -> None:
    assert resolve_workload(DEFAULT_WORKLOAD).expect == ("gdn_host_flags:builds_flagged",)
    assert resolve_workload("a.b:c").target == "a.b:c"
    assert workload_spec(resolve_workload) == "kda_patches.regress.workloads:resolve_workload"
    with pytest.raises(ValueError, match="importable"):
        workload_spec(lambda: None)


PLUGIN_TESTS = textwrap.dedent("""
    import kda_regress_dummy

    def test_equal(kda_ab):
        report = kda_ab(kda_regress_dummy.compute, {"mode": "none"}, expect=("dummy_offset:calls_routed",))
        assert report.verdict == "equal"

    def test_tolerance(kda_ab):
        kda_ab("kda_regress_dummy:compute", {"mode": "drift"}, atol=1e-5)

    def test_difference_fails_with_report(kda_ab):
        kda_ab("kda_regress_dummy:compute", {"mode": "token"})

    def test_stored_baseline(kda_ab):
        report = kda_ab("kda_regress_dummy:compute", {"mode": "none"}, baseline_dir="{store}")
        print("BASELINE-ACTION", report.baseline_action)
""")


def run_pytest(tmp_path, *options: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "-rA", *options,
                           str(tmp_path / "test_with_fixture.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_pytest_plugin_fixture_and_update_option(tmp_path) -> None:
    store = tmp_path / "store"
    (tmp_path / "test_with_fixture.py").write_text(PLUGIN_TESTS.replace("{store}", str(store)))
    result = run_pytest(tmp_path)
    assert "1 failed, 3 passed" in result.stdout, result.stdout + result.stderr
    assert "RESULT: DIFFERENT" in result.stdout and "tokens[5]: baseline" in result.stdout
    assert "BASELINE-ACTION created" in result.stdout
    again = run_pytest(tmp_path, "-k", "stored_baseline")
    assert "BASELINE-ACTION stored" in again.stdout, again.stdout
    updated = run_pytest(tmp_path, "-k", "stored_baseline", "--kda-update-baseline")
    assert "BASELINE-ACTION updated" in updated.stdout, updated.stdout
    assert "--kda-update-baseline" in run_pytest(tmp_path, "--help").stdout
