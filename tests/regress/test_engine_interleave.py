"""engine_interleave: arms alive side by side, passes alternated, paired ratios (issue 26: the H200's drift)."""

from __future__ import annotations

import io
import json
import os
import stat
import sys
import time

import pytest

from kda_patches.bench import engine_repeat
from kda_patches.bench.engine_interleave import (
    SHARED_MEMORY,
    cycle_order,
    format_pairs,
    run_interleaved,
    share_memory,
    summarize_pairs,
)
from kda_patches.bench.engine_repeat import BASELINE

# A stand-in interpreter for the arms' processes (vLLM's engine takes ~20 s to start here): it speaks the
# --serve-fd protocol. Pass k of an arm takes (1 + k) s on the "clock" -- the machine drifting from cycle to cycle,
# the same for every arm -- times SLOW when patched; FAIL_AT=k ends the process at its k-th pass; FORK_HOLD=1 leaves
# a forked process holding the reply pipe.
STAND_IN = """
import json, os, sys, time
argv = sys.argv[1:]
run_dir = os.path.dirname(argv[argv.index("--result") + 1])
with open(os.path.join(run_dir, "argv.json"), "w") as handle:
    json.dump(argv, handle)
with open(os.path.join(run_dir, "affinity.json"), "w") as handle:
    json.dump(sorted(os.sched_getaffinity(0)), handle)
reply = os.fdopen(int(argv[argv.index("--serve-fd") + 1]), "w", buffering=1)
if os.environ.get("FORK_HOLD") and os.fork() == 0:  # like a forked engine core: holds the reply pipe open
    time.sleep(25)
    os._exit(0)
reply.write(json.dumps({"ready": True, "startup_s": 0.5, "warmup_s": 0.25}) + "\\n")
factor = float(os.environ.get("SLOW", "1")) if os.environ.get("KDA_PATCHES") == "1" else 1.0
passes = []
for line in sys.stdin:
    if line.strip() == "quit":
        break
    if len(passes) + 1 == int(os.environ.get("FAIL_AT", "0")):
        sys.exit(3)
    passes.append((1 + len(passes)) * factor)
    now = time.time()
    reply.write(json.dumps({"elapsed_s": passes[-1], "start": now, "end": now + 0.05}) + "\\n")
with open(argv[argv.index("--result") + 1], "w") as handle:
    json.dump({"startup_s": 0.5, "warmup_s": 0.25, "elapsed_s": passes, "output_tokens": 8}, handle)
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n" + STAND_IN)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(engine_repeat.sys, "executable", str(script))
    return script


def no_sampler(path):
    return None, "no GPU clock record in this test"


def test_engines_that_live_side_by_side_share_the_memory_and_replace_any_given_share():
    args = ["--model", "m", "--engine-arg", "gpu_memory_utilization=0.6", "--engine-arg", "seed_like=1"]
    shared = share_memory(args, 2)
    assert shared == ["--model", "m", "--engine-arg", "seed_like=1", "--engine-arg",
                      f"gpu_memory_utilization={SHARED_MEMORY / 2:.4f}"]
    assert share_memory(["--model", "m"], 4)[-1] == f"gpu_memory_utilization={SHARED_MEMORY / 4:.4f}"


def test_every_cycle_runs_each_arm_once_in_a_seeded_order():
    names = [BASELINE, "a", "b", "c"]
    orders = [cycle_order(names, cycle, seed=3) for cycle in range(6)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert len({tuple(order) for order in orders}) > 1  # the order changes between cycles
    assert orders == [cycle_order(names, cycle, seed=3) for cycle in range(6)]


def test_the_ratio_pairs_each_pass_with_the_baselines_pass_of_the_same_cycle():
    # the machine slows down 1.0 -> 3.0 over three cycles; the arm is 10 % slower within every cycle
    passes = [{"cycle": cycle, "arm": arm, "elapsed_s": (1 + cycle) * (1.1 if arm == "arm" else 1.0)}
              for cycle in range(3) for arm in (BASELINE, "arm")]
    passes.append({"cycle": 3, "arm": "arm", "elapsed_s": 0.1})  # no baseline pass in cycle 3: not paired
    row = summarize_pairs(passes)["arm"]
    assert row["paired"] == 3 and row["passes"] == 4
    assert row["ratio_median"] == pytest.approx(1.1) and row["ratio_min"] == pytest.approx(1.1)
    assert row["ratio_max"] == pytest.approx(1.1) and row["faster_cycles"] == 0
    assert "ratio_median" not in summarize_pairs(passes)[BASELINE]


def test_interleaved_arms_cancel_the_drift_and_record_every_pass(tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv("SLOW", "1.25")
    out = tmp_path / "out"
    document = run_interleaved({"patched": {"KDA_PATCHES": "1"}}, ["--model", "m", "--engine-arg",
                               "gpu_memory_utilization=0.6"], str(out), cycles=4, start_sampler=no_sampler)
    assert "error" not in document and len(document["passes"]) == 8
    row = document["summary"]["patched"]
    # pass k takes (1 + k) s on both sides: pooled medians would mix cycles, the pairs do not
    assert row["ratio_min"] == row["ratio_max"] == pytest.approx(1.25) and row["paired"] == 4
    assert [record["cycle"] for record in document["passes"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(record["gpu"] == {"count": 0} for record in document["passes"])
    assert document["gpu_clocks"]["note"] == "no GPU clock record in this test"
    for position, name in enumerate((BASELINE, "patched")):
        argv = json.load(open(out / f"{position}-{name}" / "argv.json"))
        assert argv.count("--engine-arg") == 1 and f"gpu_memory_utilization={SHARED_MEMORY / 2:.4f}" in argv
    assert json.load(open(out / "engine_repeat.json"))["summary"] == document["summary"]
    assert [run["elapsed_s"] for run in document["runs"]] == [[1.0, 2.0, 3.0, 4.0], [1.25, 2.5, 3.75, 5.0]]
    assert all(run["returncode"] == 0 for run in document["runs"])
    assert "1.250" in "\n".join(format_pairs(document))


def test_an_arm_that_dies_stops_the_run_and_every_engine_is_ended(tmp_path, stand_in):
    out = tmp_path / "out"
    document = run_interleaved({"dies": {"KDA_PATCHES": "1", "FAIL_AT": "2"}}, ["--model", "m"], str(out),
                               cycles=5, start_sampler=no_sampler)
    assert "arm dies: its process ended" in document["error"]
    assert {record["cycle"] for record in document["passes"]} <= {0, 1}  # nothing after the failure
    runs = {run["arm"]: run for run in document["runs"]}
    assert runs["dies"]["returncode"] == 3 and runs[BASELINE]["returncode"] == 0  # the baseline was asked to quit
    assert "stopped early" in format_pairs(document)[-1]
    status = engine_repeat.main(["--out", str(tmp_path / "cli"), "--interleave", "2", "--arm",
                                 "dies:FAIL_AT=1", "--", "--model", "m"])
    assert status == 1


def test_an_arm_whose_forked_engine_holds_the_pipe_is_still_seen_to_end(tmp_path, stand_in):
    document = run_interleaved({"dies": {"KDA_PATCHES": "1", "FAIL_AT": "1", "FORK_HOLD": "1"}}, ["--model", "m"],
                               str(tmp_path / "out"), cycles=2, timeout_s=20, start_sampler=no_sampler)
    assert "arm dies: its process ended with status 3" in document["error"]  # not "no answer within 20 s"


def test_each_pass_gets_the_gpu_clock_samples_of_its_window(tmp_path, stand_in):
    def sampler(path):
        now = time.time()
        with open(path, "w") as handle:  # one sample every 10 ms for a minute either side of now
            for step in range(-6000, 6000):
                moment = now + step / 100
                stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(moment)) + f".{int(moment % 1 * 1000):03d}"
                handle.write(f"{stamp}, 1980, 2619, 400.5, 55, 0x0000000000000004\n")
        return None, "written by the test"

    document = run_interleaved({"patched": {"KDA_PATCHES": "1"}}, ["--model", "m"], str(tmp_path / "out"),
                               cycles=2, start_sampler=sampler)
    assert document["gpu_clocks"]["samples"] == 12000 and document["gpu_clocks"]["skipped_lines"] == 0
    for record in document["passes"]:
        assert record["gpu"]["count"] >= 1 and record["gpu"]["sm_mhz_median"] == 1980
        assert record["gpu"]["throttled_fraction"] == 1.0  # 0x4: the power cap
    assert "sm 1980 MHz" in "\n".join(format_pairs(document))


def test_every_arm_runs_on_the_same_pinned_cores(tmp_path, stand_in):
    core = min(os.sched_getaffinity(0))
    out = tmp_path / "out"
    document = run_interleaved({"patched": {"KDA_PATCHES": "1"}}, ["--model", "m"], str(out), cycles=1,
                               start_sampler=no_sampler, cpus=frozenset({core}))
    assert document["cpus"] == [core]
    assert [json.load(open(out / f"{n}-{name}" / "affinity.json")) for n, name in enumerate((BASELINE, "patched"))] \
        == [[core], [core]]
    unpinned = run_interleaved({}, ["--model", "m"], str(tmp_path / "free"), cycles=1, start_sampler=no_sampler)
    assert unpinned["cpus"] is None
    assert json.load(open(tmp_path / "free" / f"0-{BASELINE}" / "affinity.json")) == sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="not available"):
        run_interleaved({}, ["--model", "m"], str(tmp_path / "x"), cycles=1, cpus=frozenset({4095}))
    with pytest.raises(SystemExit):  # pinning is for the interleaved runs
        engine_repeat.main(["--out", str(tmp_path / "y"), "--cpus", "0", "--", "--model", "m"])


def test_a_run_needs_a_cycle_and_an_empty_directory(tmp_path):
    with pytest.raises(ValueError, match="cycles=0"):
        run_interleaved({}, ["--model", "m"], str(tmp_path / "a"), cycles=0)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        run_interleaved({}, ["--model", "m"], str(tmp_path / "b"), cycles=1)


def test_a_served_child_answers_ready_then_one_line_per_pass(tmp_path, monkeypatch):
    import vllm

    from tests.regress.test_engine_repeat import CountingEngine

    engines = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: engines.append(CountingEngine(**kwargs)) or engines[-1])
    read_fd, write_fd = os.pipe()
    monkeypatch.setattr(sys, "stdin", io.StringIO("pass\npass\nquit\npass\n"))
    result = tmp_path / "result.json"
    child = ["--model", "m", "--num-prompts", "3", "--input-len", "5", "--output-len", "4", "--repeats", "9"]
    assert engine_repeat.child_main([*child, "--result", str(result), "--serve-fd", str(write_fd)]) == 0
    with os.fdopen(read_fd) as replies:
        lines = [json.loads(line) for line in replies]
    assert lines[0]["ready"] is True and [sorted(line) for line in lines[1:]] == [["elapsed_s", "end", "start"]] * 2
    assert len(engines[0].passes) == 3  # the unmeasured pass and two commanded ones: nothing after quit
    assert json.load(open(result))["elapsed_s"] == [line["elapsed_s"] for line in lines[1:]]
    monkeypatch.setattr(sys, "stdin", io.StringIO("go\n"))
    read_fd, write_fd = os.pipe()
    with pytest.raises(SystemExit, match="unknown command 'go'"):
        engine_repeat.child_main([*child, "--result", str(tmp_path / "r2.json"), "--serve-fd", str(write_fd)])
    os.close(read_fd)
