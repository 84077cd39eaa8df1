"""``kda-patches bench serve-ab``: the result written after every round, and ``--entry module`` (issue 26).

No benchmark process starts here: ``run_bench_once`` is replaced by a recorder that returns what a finished run
returns; ``--entry module`` is run against the installed vLLM's own benchmark module with its ``main`` recorded.
"""

from __future__ import annotations

import json
import os

import pytest
from serve_ab_fakes import BENCH, fake_run

from kda_patches.bench import serve_ab


def test_every_finished_round_is_on_disk_before_the_next_starts(tmp_path, monkeypatch):
    out = str(tmp_path / "ab")
    seen: list = []
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run(seen, out, stop_at_round=2))
    with pytest.raises(KeyboardInterrupt):
        serve_ab.run_serve_ab(BENCH, 4, out, entry="module")
    document = json.load(open(os.path.join(out, "serve_ab.json")))
    assert document["rounds_done"] == 2 and document["complete"] is False and document["rounds"] == 4
    assert document["metrics"]["tokens_per_second"]["ratios"] == [1.0, 1.01]
    assert document["entry"] == "module"
    assert seen[0] is None and seen[2]["rounds_done"] == 1  # round 1's first run saw round 0 written


def test_a_complete_run_says_so(tmp_path, monkeypatch):
    out = str(tmp_path / "ab")
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run([], out))
    assert serve_ab.run_serve_ab(BENCH, 2, out) == 0
    document = json.load(open(os.path.join(out, "serve_ab.json")))
    assert document["complete"] is True and document["rounds_done"] == 2 and document["entry"] == "cli"


def test_the_module_entry_runs_vllms_own_benchmark_main_with_its_own_parser(monkeypatch):
    import vllm.benchmarks.throughput as throughput

    called = {}
    monkeypatch.setattr(throughput, "main", lambda args: called.setdefault("args", args))
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    serve_ab.exec_vllm_module(["bench", "throughput", "--model", "/models/m", "--input-len", "16",
                               "--output-len", "4", "--output-json", "/tmp/x.json"])
    args = called["args"]
    assert (args.model, args.input_len, args.output_len, args.output_json) == ("/models/m", 16, 4, "/tmp/x.json")
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


@pytest.mark.parametrize("argv", [["throughput"], ["bench", "serve"], ["bench"]])
def test_the_module_entry_refuses_anything_but_an_offline_benchmark(argv):
    with pytest.raises(SystemExit, match=r"expects bench throughput\|latency"):
        serve_ab.exec_vllm_module(argv)


def test_the_entry_is_a_choice_of_the_command_line(capsys):
    with pytest.raises(SystemExit):
        serve_ab.build_parser().parse_args(["--entry", "server", "--", *BENCH])
    assert "invalid choice" in capsys.readouterr().err
    assert serve_ab.build_parser().parse_args(["--entry", "module", "--", *BENCH]).entry == "module"
