"""Engine step times for serve-ab (issue 26: the patched engine measured slower, these say where the time goes)."""

from __future__ import annotations

import json
import os
import stat
import sys
import types

import pytest

from kda_patches.bench import serve_ab, step_times
from kda_patches.bench.step_times import (
    StepTimes,
    batch_kind,
    compare_step_times,
    format_comparison,
    install,
    install_from_env,
    load_step_times,
    summarize,
)


def scheduled(**per_request: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_scheduled_tokens=per_request)


def test_a_batch_is_prefill_when_any_request_gets_more_than_one_token():
    assert batch_kind(scheduled(a=1, b=1)) == "decode"
    assert batch_kind(scheduled(a=1, b=2)) == "prefill"  # one chunk among decodes: a mixed batch is prefill
    assert batch_kind(scheduled()) == "empty"
    assert batch_kind(object()) == "empty"


@pytest.fixture
def dummy_engine(monkeypatch):
    """A module with an engine and a runner, as the timer's targets (each test gets its own)."""
    module = types.ModuleType("kda_step_times_dummy")

    class Engine:
        def step(self):
            return "stepped"

    class Runner:
        def execute_model(self, scheduler_output):
            return sum(scheduler_output.num_scheduled_tokens.values())

    module.Engine, module.Runner = Engine, Runner
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_the_timer_records_each_call_under_its_label_and_batch_kind(dummy_engine, tmp_path):
    times = StepTimes()
    install(times, str(tmp_path), (("kda_step_times_dummy", "Engine.step", "engine_step"),
                                   ("kda_step_times_dummy", "Runner.execute_model", "execute_model"),
                                   ("kda_step_times_dummy", "Runner.sample_tokens", "sample_tokens"),  # absent
                                   ("kda_step_times_dummy", "Missing.step", "engine_step")), write_at_exit=False,
            flush_every_s=None)
    engine, runner = dummy_engine.Engine(), dummy_engine.Runner()
    assert engine.step() == "stepped" and engine.step() == "stepped"
    assert runner.execute_model(scheduled(a=3, b=1)) == 4  # results pass through
    assert runner.execute_model(scheduler_output=scheduled(a=1)) == 1
    assert sorted((label, len(values)) for label, values in times.samples.items()) == [
        ("engine_step", 2), ("execute_model[decode]", 1), ("execute_model[prefill]", 1)]
    path = times.write(str(tmp_path))
    assert os.path.basename(path) == f"step-times-{os.getpid()}.json"
    summary = load_step_times(str(tmp_path))
    assert summary["engine_step"]["count"] == 2 and summary["execute_model[prefill]"]["count"] == 1


KILLED_CHILD = """
import os, sys, time, types
from kda_patches.bench.step_times import StepTimes, install
module = types.ModuleType("kda_killed_engine")
class Engine:
    def step(self):
        return 1
module.Engine = Engine
sys.modules[module.__name__] = module
install(StepTimes(), sys.argv[1], (("kda_killed_engine", "Engine.step", "engine_step"),),
        flush_every_s=None if sys.argv[2] == "none" else float(sys.argv[2]))
engine = Engine()
for _ in range(3):
    engine.step()
time.sleep(0.6)
os._exit(0)  # as vLLM stops its engine core: no exit handler runs
"""


@pytest.mark.parametrize("flush_every_s", ["0.05", "none"])
def test_a_process_stopped_without_exit_handlers_keeps_the_samples_it_flushed(tmp_path, flush_every_s):
    import subprocess

    status = tmp_path / "status"
    status.mkdir()
    subprocess.run([sys.executable, "-c", KILLED_CHILD, str(status), flush_every_s], check=True, timeout=60)
    summary = load_step_times(str(status))
    if flush_every_s == "none":
        assert summary == {}  # the exit-only write is lost: what the flusher is for
    else:
        assert summary["engine_step"]["count"] == 3


def test_the_flush_interval_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="every_s=0"):
        StepTimes().start_flusher(str(tmp_path), 0)


def test_a_process_that_recorded_nothing_writes_no_file(tmp_path):
    assert StepTimes().write(str(tmp_path)) is None and load_step_times(str(tmp_path)) == {}


def test_the_switch_reaches_only_processes_with_a_status_directory(monkeypatch, tmp_path):
    installed = []
    monkeypatch.setattr(step_times, "install", lambda times, directory: installed.append(directory))
    monkeypatch.delenv(step_times.ENV, raising=False)
    monkeypatch.setenv(step_times.STATUS_DIR_ENV, str(tmp_path))
    assert install_from_env() is None  # switch off
    monkeypatch.setenv(step_times.ENV, "1")
    assert isinstance(install_from_env(), StepTimes) and installed == [str(tmp_path)]
    monkeypatch.delenv(step_times.STATUS_DIR_ENV)
    assert install_from_env() is None and installed == [str(tmp_path)]  # serve-ab's own process
    monkeypatch.setenv(step_times.ENV, "yes")
    with pytest.raises(ValueError, match="KDA_BENCH_STEP_TIMES='yes'"):
        install_from_env()


def test_the_targets_are_the_installed_vllm_engine_and_runner_methods():
    import vllm.v1.engine.core  # noqa: F401  (the real modules the timer names)

    found = []
    for module_name, qualname, _ in step_times.TARGETS:
        module = __import__(module_name, fromlist=["_"])
        owner_name, _, attribute = qualname.rpartition(".")
        found.append(attribute in vars(getattr(module, owner_name)))
    assert all(found), list(zip(step_times.TARGETS, found, strict=True))


def test_summary_percentiles_come_from_the_sorted_samples():
    summary = summarize([0.004, 0.001, 0.002, 0.003] * 25)
    assert summary["count"] == 100 and summary["max_ms"] == pytest.approx(4.0)
    assert summary["median_ms"] == pytest.approx(2.5) and summary["p90_ms"] == pytest.approx(4.0)
    assert summary["total_s"] == pytest.approx(0.25)


def run_with(baseline: dict, patched: dict) -> dict:
    return {"runs": {"baseline": {"step_times": baseline}, "patched": {"step_times": patched}}}


def timed(count: int, total_s: float) -> dict:
    return {"count": count, "total_s": total_s, "median_ms": total_s / count * 1e3}


def test_the_comparison_uses_rounds_with_both_sides_timed_and_labels_both_recorded():
    raw = [run_with({"engine_step": timed(100, 1.0)}, {"engine_step": timed(100, 1.2), "only_patched": timed(1, 1)}),
           run_with({"engine_step": timed(100, 1.0)}, {"engine_step": timed(102, 1.4)}),
           run_with({"engine_step": timed(100, 9.0)}, {}),  # a round without the patched side's times: left out
           {"runs": {"baseline": {"step_times": {"engine_step": timed(1, 1.0)}}}}]  # a cut round: one side only
    table = compare_step_times(raw)
    assert list(table) == ["engine_step"]
    row = table["engine_step"]
    assert (row["baseline_total_s"], row["patched_count"]) == (1.0, 101)
    assert row["patched_total_s"] == pytest.approx(1.3)
    assert row["total_ratio"] == pytest.approx(1.3)
    assert "engine_step" in format_comparison(table)[1]
    assert compare_step_times([run_with({}, {})]) == {}


FAKE_BENCH = """\
import json, os, sys
argv = sys.argv
with open(argv[argv.index("--output-json") + 1], "w") as handle:
    json.dump({"elapsed_time": 2.0, "requests_per_second": 4.0, "tokens_per_second": 400.0}, handle)
status = os.environ["KDA_PATCHES_STATUS_DIR"]
os.makedirs(status, exist_ok=True)
with open(os.path.join(status, "step-times-7.json"), "w") as handle:
    json.dump({"pid": 7, "samples": {"engine_step": [0.01, 0.03]}}, handle)
"""


def test_serve_ab_reads_each_runs_step_times_from_its_status_directory(tmp_path, monkeypatch):
    script = tmp_path / "python"  # a stand-in benchmark process that leaves an engine's step-times file
    script.write_text(f"#!{sys.executable}\n" + FAKE_BENCH)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(serve_ab.sys, "executable", str(script))
    record = serve_ab.run_bench_once(["throughput", "--num-prompts", "4"], True, str(tmp_path / "run"), 60.0)
    assert record["error"] is None
    assert record["step_times"]["engine_step"]["count"] == 2
    assert record["step_times"]["engine_step"]["total_s"] == pytest.approx(0.04)
    assert json.load(open(tmp_path / "run" / "status" / "step-times-7.json"))["pid"] == 7
