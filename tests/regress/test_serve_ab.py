"""``kda-patches bench serve-ab``: vLLM's own ``vllm bench``, KDA_PATCHES=0 vs =1, ratios from the raw results.

The engine test (two fresh ``vllm bench throughput`` processes on the tiny model, about 35 s each;
run under ``flock /tmp/kda-heavy.lock``) recomputes every ratio from the raw per-run results.
"""

from __future__ import annotations

import json
import re
import statistics

import pytest
import vllm_stack

from kda_patches.bench.cli import main as bench_main
from kda_patches.bench.serve_ab import check_bench_args, extract_metrics
from kda_patches.bench.serve_ab_report import summarize_rounds

BENCH = ["throughput", "--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "16",
         "--random-output-len", "4", "--enforce-eager", "--max-model-len", "64", "--dtype", "bfloat16"]


def test_arguments_it_owns_or_cannot_run_are_refused(tmp_path, capsys) -> None:
    for bench, expected in ((["--"], "got nothing"), (["--", "serve", "--model", "m"], "got serve --model m"),
                            (["--", "throughput", "--output-json", "x.json"], "--output-json is set per run")):
        with pytest.raises(SystemExit) as exit_info:
            bench_main(["serve-ab", "--out", str(tmp_path / "o"), *bench])
        assert exit_info.value.code == 2 and expected in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.json").write_text("{}")
    with pytest.raises(SystemExit):
        bench_main(["serve-ab", "--out", str(tmp_path / "full"), "--", *BENCH])
    assert "exists and is not empty" in capsys.readouterr().err
    assert check_bench_args(["--", "latency", "--batch-size", "2"]) == ["latency", "--batch-size", "2"]


def test_metrics_of_vllms_json_formats() -> None:
    throughput = {"elapsed_time": 2.0, "num_requests": 8, "total_num_tokens": 400, "requests_per_second": 4.0,
                  "tokens_per_second": 200.0}
    printed = "Total num prompt tokens:  300\nTotal num output tokens:  100\n"
    metrics = extract_metrics("throughput", throughput, printed)
    assert metrics == {"requests_per_second": 4.0, "tokens_per_second": 200.0, "elapsed_time": 2.0,
                       "output_tokens_per_second": 50.0}
    latency = {"avg_latency": 0.5, "latencies": [0.4, 0.6], "percentiles": {"10": 0.41, "50": 0.5, "99": 0.6},
               "mean_ttft_ms": 12.0}
    assert extract_metrics("latency", latency, "") == {"avg_latency": 0.5, "latency_p10": 0.41, "latency_p50": 0.5,
                                                       "latency_p99": 0.6, "mean_ttft_ms": 12.0}


def test_ratios_over_rounds() -> None:
    def record(base: float, patched: float) -> dict:
        return {"runs": {"baseline": {"metrics": {"requests_per_second": base, "avg_latency": 1 / base}},
                         "patched": {"metrics": {"requests_per_second": patched, "avg_latency": 1 / patched}}}}

    summary = summarize_rounds([record(10.0, 11.0), record(10.0, 9.0), record(8.0, 10.0)])
    rps = summary["requests_per_second"]
    assert rps["ratios"] == [1.1, 0.9, 1.25] and (rps["min"], rps["median"], rps["max"]) == (0.9, 1.1, 1.25)
    assert rps["direction"] == "higher" and summary["avg_latency"]["direction"] == "lower"
    assert summary["avg_latency"]["median"] == pytest.approx(1 / 1.1)


@pytest.mark.engine
def test_throughput_ab_on_the_tiny_model_writes_json_and_png(tmp_path, monkeypatch, capsys, fast_exit) -> None:
    vllm_stack.import_vllm("vllm")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    out = tmp_path / "ab"
    code = bench_main(["serve-ab", "--rounds", "1", "--out", str(out), "--", *BENCH])
    printed = capsys.readouterr().out
    print(printed)
    assert code == 0, printed
    assert "DEMONSTRATION of the method only, NOT a performance claim: a CPU build of vLLM and the tiny " \
           "random-weight model" in printed
    document = json.loads((out / "serve_ab.json").read_text())
    assert document["demonstration_only"] and document["tiny_model"] and document["kind"] == "throughput"
    (record,) = document["raw"]
    assert sorted(record["order"]) == ["baseline", "patched"]
    runs = record["runs"]
    for label, run in runs.items():
        assert run["returncode"] == 0 and run["result"]["num_requests"] == 4
        assert run["result"]["total_num_tokens"] == 4 * (16 + 4)  # our settings reached vLLM's bench
        with open(run["log"]) as handle:
            output_tokens = int(re.findall(r"Total num output tokens:\s+(\d+)", handle.read())[-1])
        assert output_tokens == 16
        run["output_tokens_per_second"] = output_tokens / run["result"]["elapsed_time"]
        applied = {name for entry in run["ledgers"] for name, patch in entry["patches"].items()
                   if patch["state"] == "applied"}
        assert (label == "patched") == bool(applied), (label, applied)
    worker = next(entry for entry in runs["patched"]["ledgers"] if entry["role"] == "VllmWorker-0")
    assert worker["patches"]["gdn_host_flags"]["state"] == "applied"
    expected = {key: runs["patched"]["result"][key] / runs["baseline"]["result"][key]
                for key in ("requests_per_second", "tokens_per_second", "elapsed_time")}
    expected["output_tokens_per_second"] = (runs["patched"]["output_tokens_per_second"]
                                            / runs["baseline"]["output_tokens_per_second"])
    metrics = document["metrics"]
    assert set(metrics) == set(expected)
    for key, ratio in expected.items():
        entry = metrics[key]
        assert entry["ratios"] == [pytest.approx(ratio, rel=1e-12)]
        assert entry["min"] == entry["median"] == entry["max"] == statistics.median(entry["ratios"])
        assert re.search(rf"^{key}\s+(higher|lower)\s+{ratio:.3f}\s+{ratio:.3f}\s+{ratio:.3f}\s", printed, re.M)
    png = (out / "serve_ab.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(str(out / "serve_ab.png")).shape
    assert height > 200 and width > 400
