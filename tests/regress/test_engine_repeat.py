"""engine_repeat: one engine per arm, the batch timed several times (issue 26: bisecting the engine slowdown)."""

from __future__ import annotations

import json
import os
import stat
import sys
import types

import pytest

from kda_patches.bench import engine_repeat
from kda_patches.bench.engine_repeat import (
    BASELINE,
    arm_order,
    engine_kwargs,
    format_summary,
    parse_arm,
    random_prompts,
    run_arms,
    summarize_arms,
)


def test_prompts_are_seeded_and_avoid_the_low_ids():
    first = random_prompts(3, 50, 12, seed=4)
    assert first == random_prompts(3, 50, 12, seed=4) and first != random_prompts(3, 50, 12, seed=5)
    assert {len(ids) for ids in first} == {50} and min(min(ids) for ids in first) == 10
    with pytest.raises(ValueError, match="no ordinary token ids"):
        random_prompts(1, 1, 10, seed=0)


def test_an_arm_is_patched_with_its_own_settings():
    assert parse_arm("patched") == ("patched", {"KDA_PATCHES": "1"})
    assert parse_arm("no-flags:KDA_PATCHES_DISABLE=gdn_host_flags,X=1") == (
        "no-flags", {"KDA_PATCHES": "1", "KDA_PATCHES_DISABLE": "gdn_host_flags", "X": "1"})
    assert parse_arm("off:KDA_PATCHES=0")[1] == {"KDA_PATCHES": "0"}  # an arm may override the switch itself
    for bad, message in (("baseline", "other than 'baseline'"), (":X=1", "other than"), ("a:X", "not VAR=VALUE")):
        with pytest.raises(ValueError, match=message):
            parse_arm(bad)


def test_the_baseline_runs_first_and_last_around_the_shuffled_arms():
    order = arm_order(["a", "b", "c", "d"], seed=1)
    assert order[0] == order[-1] == BASELINE and sorted(order[1:-1]) == ["a", "b", "c", "d"]
    assert {tuple(arm_order(["a", "b", "c", "d"], seed)) for seed in range(20)} != {tuple(order)}  # seed decides


def test_the_summary_pools_the_baseline_and_reports_its_drift():
    runs = [(BASELINE, {"elapsed_s": [1.0, 1.0, 1.2]}), ("patched", {"elapsed_s": [1.1, 1.3, 1.2]}),
            ("broken", {"error": "exited with status 1"}), (BASELINE, {"elapsed_s": [1.1, 1.1, 1.1]})]
    summary = summarize_arms(runs)
    assert summary[BASELINE]["repeats"] == 6 and summary[BASELINE]["median_s"] == pytest.approx(1.1)
    assert summary["patched"]["over_baseline"] == pytest.approx(1.2 / 1.1)
    assert summary[BASELINE]["baseline_drift"] == pytest.approx(1.1 / 1.0)
    assert summary["broken"] == {"repeats": 0}
    assert "no measured repeat" in "\n".join(format_summary(summary))


def test_engine_arguments_are_json_values():
    args = engine_repeat.child_parser().parse_args(
        ["--model", "m", "--num-prompts", "2", "--input-len", "3", "--output-len", "4", "--result", "r",
         "--engine-arg", "gpu_memory_utilization=0.6", "--engine-arg", 'additional_config={"a": 1}'])
    kwargs = engine_kwargs(args)
    assert kwargs["gpu_memory_utilization"] == 0.6 and kwargs["additional_config"] == {"a": 1}
    assert kwargs["load_format"] == "dummy" and kwargs["max_num_seqs"] == 256
    args.engine_arg = ["oops"]
    with pytest.raises(ValueError, match="not KEY=JSON"):
        engine_kwargs(args)


STAND_IN = """\
import json, os, sys
argv = sys.argv
status = os.environ["KDA_PATCHES_STATUS_DIR"]
os.makedirs(status, exist_ok=True)
with open(os.path.join(status, "step-times-1.json"), "w") as handle:
    json.dump({"pid": 1, "samples": {"engine_step": [0.5]}}, handle)
if os.environ.get("FAIL_ARM") == "1":
    sys.exit(5)
if "--profile-dir" in argv:
    profile = argv[argv.index("--profile-dir") + 1]
    os.makedirs(profile)
    open(os.path.join(profile, "worker.profiler_out.txt"), "w").write("table")
slow = 2.0 if os.environ.get("KDA_PATCHES") == "1" else 1.0
with open(argv[argv.index("--result") + 1], "w") as handle:
    json.dump({"startup_s": 0.1, "warmup_s": 0.2, "elapsed_s": [slow, slow], "output_tokens": 8}, handle)
"""


def test_arms_run_in_fresh_processes_with_their_environment(tmp_path, monkeypatch, capsys):
    script = tmp_path / "python"  # a stand-in interpreter for the arm processes
    script.write_text(f"#!{sys.executable}\n" + STAND_IN)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(engine_repeat.sys, "executable", str(script))
    monkeypatch.setenv("KDA_PATCHES", "1")  # the caller's own switch does not reach the baseline
    out = tmp_path / "out"
    status = engine_repeat.main(["--out", str(out), "--arm", "patched", "--arm", "dies:FAIL_ARM=1", "--",
                                 "--model", "m"])
    assert status == 1  # one arm failed
    document = json.load(open(out / "engine_repeat.json"))
    assert document["order"][0] == document["order"][-1] == BASELINE
    summary = document["summary"]
    assert summary["patched"]["over_baseline"] == pytest.approx(2.0) and summary["dies"] == {"repeats": 0}
    failed = next(run for run in document["runs"] if run["arm"] == "dies")
    assert failed["error"] == "exited with status 5" and failed["step_times"]["engine_step"]["count"] == 1
    assert "patched" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not empty"):
        run_arms({"patched": {"KDA_PATCHES": "1"}}, ["--model", "m"], str(out))
    with pytest.raises(SystemExit):
        engine_repeat.main(["--out", str(tmp_path / "two"), "--arm", "a", "--arm", "a", "--", "--model", "m"])
    assert not os.path.exists(tmp_path / "two")
    assert all(run["profile_tables"] == [] for run in document["runs"])  # no --profile: no profiled pass


def test_a_profiled_bisection_lists_each_arms_operator_tables(tmp_path, monkeypatch):
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n" + STAND_IN)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(engine_repeat.sys, "executable", str(script))
    out = tmp_path / "out"
    assert engine_repeat.main(["--out", str(out), "--profile", "--", "--model", "m"]) == 0
    runs = json.load(open(out / "engine_repeat.json"))["runs"]
    assert [len(run["profile_tables"]) for run in runs] == [1, 1, 1]
    assert runs[1]["profile_tables"][0] == str(out / "1-patched" / "profile" / "worker.profiler_out.txt")
    args = engine_repeat.child_parser().parse_args(["--model", "m", "--num-prompts", "1", "--input-len", "1",
                                                    "--output-len", "1", "--result", "r", "--profile-dir", "p"])
    config = engine_kwargs(args)["profiler_config"]
    assert config["profiler"] == "torch" and config["torch_profiler_dir"] == os.path.abspath("p")


class CountingEngine:
    """Stands in for vLLM's LLM in one child (the real engine takes ~20 s to start here): returns ``produce``
    tokens per request and records what it was asked."""

    produce = 4

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(get_vocab_size=lambda: 64))
        self.passes = []

    def start_profile(self):
        self.passes.append("profile on")

    def stop_profile(self):
        self.passes.append("profile off")

    def generate(self, prompts, params, use_tqdm=False):
        self.passes.append((len(prompts), params.max_tokens, params.ignore_eos))
        output = types.SimpleNamespace(token_ids=[1] * self.produce)
        return [types.SimpleNamespace(outputs=[output]) for _ in prompts]


CHILD = ["--model", "m", "--num-prompts", "3", "--input-len", "5", "--output-len", "4", "--repeats", "2"]


@pytest.mark.parametrize("produce, error", [(4, None), (3, "repeat 0: 9 output tokens, expected 3 x 4")])
def test_a_pass_with_another_output_count_is_an_error_not_a_sample(tmp_path, monkeypatch, produce, error):
    import vllm

    monkeypatch.setattr(vllm, "LLM", type("Engine", (CountingEngine,), {"produce": produce}))
    result = tmp_path / "result.json"
    if error:
        with pytest.raises(SystemExit, match=error):
            engine_repeat.child_main([*CHILD, "--result", str(result)])
        assert not result.exists()
        return
    assert engine_repeat.child_main([*CHILD, "--result", str(result)]) == 0
    written = json.load(open(result))
    assert len(written["elapsed_s"]) == 2 and written["warmup_s"] is not None and written["output_tokens"] == 12


def test_the_profiled_pass_comes_after_the_measured_ones_and_is_not_a_sample(tmp_path, monkeypatch):
    import vllm

    engines = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: engines.append(CountingEngine(**kwargs)) or engines[-1])
    result = tmp_path / "result.json"
    assert engine_repeat.child_main([*CHILD, "--result", str(result), "--profile-dir", str(tmp_path / "p")]) == 0
    assert engines[0].passes == [(3, 4, True)] * 3 + ["profile on", (3, 4, True), "profile off"]
    assert engines[0].kwargs["profiler_config"]["torch_profiler_dir"] == str(tmp_path / "p")
    assert len(json.load(open(result))["elapsed_s"]) == 2
