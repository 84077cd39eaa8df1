"""serve-ab fails a throughput run that did not run the shape its arguments ask for (issue 26, H200 run 4: vLLM 0.33
ignored ``--input-len`` for the random dataset and ran its default 1024-token prompts under a 64-token shape)."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from kda_patches.bench import serve_ab
from kda_patches.bench.token_totals import (
    TOLERANCE,
    check_token_totals,
    printed_token_totals,
    requested_token_totals,
)

RANDOM = ["throughput", "--dataset-name", "random", "--num-prompts", "256"]


def printed(prompt: int, output: int) -> str:
    return f"Throughput: 1.0 requests/s\nTotal num prompt tokens:  {prompt}\nTotal num output tokens:  {output}\n"


def test_requested_totals_prefer_the_random_datasets_own_options_and_add_the_prefix():
    assert requested_token_totals([*RANDOM, "--input-len", "64", "--output-len", "32"]) == {"prompt": 16384,
                                                                                           "output": 8192}
    assert requested_token_totals([*RANDOM, "--input-len", "64", "--random-input-len=2048"]) == {"prompt": 524288}
    assert requested_token_totals([*RANDOM, "--random-input-len", "100", "--random-prefix-len", "28"]) == {
        "prompt": 256 * 128}


@pytest.mark.parametrize("bench", [
    ["throughput", "--dataset-name", "sharegpt", "--num-prompts", "8", "--input-len", "64"],  # not random
    ["throughput", "--num-prompts", "8", "--input-len", "64"],  # dataset not stated
    [*RANDOM, "--random-input-len", "64", "--random-range-ratio", "0.5"],  # ranged lengths
    ["throughput", "--dataset-name", "random", "--random-input-len", "64"],  # no request count
    RANDOM,  # no length stated
])
def test_shapes_whose_totals_cannot_be_known_are_not_checked(bench):
    assert requested_token_totals(bench) is None
    assert check_token_totals(bench, printed(1, 1)) is None


def test_the_run_4_mismatch_is_caught_with_the_fix_named():
    bench = [*RANDOM, "--input-len", "2048", "--output-len", "64"]  # what vLLM 0.33 ignored
    why = check_token_totals(bench, printed(256 * 1024, 256 * 128))
    assert "ran 262144 prompt tokens, the arguments ask for 524288" in why
    assert "ran 32768 output tokens, the arguments ask for 16384" in why
    assert "--random-input-len / --random-output-len" in why
    assert check_token_totals(bench, printed(524288, 16384)) is None


def test_the_tolerance_is_relative_and_inclusive():
    bench = [*RANDOM, "--random-input-len", "100"]
    asked = 25600
    assert check_token_totals(bench, printed(round(asked * (1 + TOLERANCE)), 0)) is None
    assert check_token_totals(bench, printed(round(asked * (1 + TOLERANCE)) + 1, 0)) is not None
    assert check_token_totals(bench, printed(round(asked * (1 - TOLERANCE)) - 1, 0)) is not None


def test_an_asked_total_the_benchmark_did_not_print_fails_and_latency_is_not_checked():
    bench = [*RANDOM, "--random-input-len", "100", "--random-output-len", "10"]
    assert "printed no 'Total num output tokens'" in check_token_totals(bench, "Total num prompt tokens: 25600\n")
    assert check_token_totals(["latency", *bench[1:]], "") is None
    assert printed_token_totals(printed(5, 6) + printed(7, 8)) == {"prompt": 7, "output": 8}  # the last printed


FAKE_BENCH = """\
import json, sys
argv = sys.argv
with open(argv[argv.index("--output-json") + 1], "w") as handle:
    json.dump({"elapsed_time": 2.0, "requests_per_second": 4.0, "tokens_per_second": 400.0}, handle)
print("Total num prompt tokens:  PROMPT")
print("Total num output tokens:  OUTPUT")
"""


@pytest.mark.parametrize("prompt_tokens, error", [(1024, None), (4096, "ran 4096 prompt tokens")])
def test_a_run_with_the_wrong_shape_is_a_failed_run(tmp_path, monkeypatch, prompt_tokens, error):
    # a stand-in `python` for the benchmark process: serve-ab's own process handling, log and JSON reading run
    script = tmp_path / "python"
    body = FAKE_BENCH.replace("PROMPT", str(prompt_tokens)).replace("OUTPUT", "64")
    script.write_text(f"#!{sys.executable}\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(serve_ab.sys, "executable", str(script))
    bench = [*RANDOM[:-1], "16", "--random-input-len", "64", "--random-output-len", "4"]
    record = serve_ab.run_bench_once(bench, False, str(tmp_path / "run"), 60.0)
    assert record["returncode"] == 0 and record["metrics"]["requests_per_second"] == 4.0
    if error is None:
        assert record["error"] is None
    else:
        assert error in record["error"] and "Total num prompt tokens:  4096" in record["log_tail"]
    assert json.load(open(os.path.join(tmp_path, "run", "result.json")))["elapsed_time"] == 2.0
