"""The state-copy benchmark runs end to end (tiny CPU smoke run) and refuses an existing output file."""

from __future__ import annotations

import json

import pytest
import torch

from kda_patches.bench import main


def test_bench_smoke_run_writes_raw_samples_and_refuses_overwrite(tmp_path, device):
    output = tmp_path / "bench.json"
    argv = ["state-copy", "--output", str(output), "--device", str(device), "--rows", "12", "--inner", "2,3,8",
            "--gap-items", "5", "--selected", "1,3", "--trials", "2", "--graph-calls", "3", "--graph-instances", "2",
            "--dtypes", "float32,bfloat16", "--fused-variants", "64/2/stream", "--seed", "7"]
    assert main(argv) == 0
    result = json.loads(output.read_text())
    assert result["benchmark"] == "state-copy" and len(result["source_sha256"]) == 64
    impls = {record["impl"] for record in result["records"]}
    assert impls == {"fused", "fallback", "torch-native", "fused-64w2-stream", "reference-contiguous-copy"}
    assert all(len(record["samples_us"]) == 2 for record in result["records"])
    assert {record["mode"] for record in result["records"]} >= {"wall", "enqueue"}
    assert result["compiler_entries_after_seal"] == {"JITFunction.run": 0, "InterpretedFunction.run": 0,
                                                     "triton.compile": 0}
    assert result["summary"]["checks"]["compiler_entries_after_seal"]["met"] is True
    assert main(argv) == 2  # the output exists: refused, untouched
    assert json.loads(output.read_text()) == result


def test_gdn_bench_smoke_run_native_vs_plan_with_cast_cases(tmp_path, device):
    output = tmp_path / "gdn.json"
    argv = ["gdn-state-copy", "--output", str(output), "--device", str(device), "--rows", "12",
            "--shapes", "tiny=2,3,8;tinier=1,4,8", "--gap-items", "5", "--selected", "1,3", "--trials", "2",
            "--graph-calls", "3", "--graph-instances", "2", "--cases", "float32:float32,bfloat16:float32",
            "--seed", "3"]
    assert main(argv) == 0
    result = json.loads(output.read_text())
    assert result["benchmark"] == "gdn-state-copy" and len(result["source_sha256"]) == 64
    cases = {(r["shape"], r["dtype"], r["final_dtype"]) for r in result["records"]}
    assert cases == {(shape, cache, final) for shape in ("tiny", "tinier")
                     for cache, final in (("float32", "float32"), ("bfloat16", "float32"))}
    impls = {(r["dtype"], r["final_dtype"], r["impl"]) for r in result["records"]}
    assert ("float32", "float32", "plan+torch-cast") not in impls  # only where the dtypes differ
    assert {impl for _, _, impl in impls} == {"native", "plan", "plan+torch-cast", "copy"}
    assert {r["op"] for r in result["records"]} == {"gather", "scatter", "pair"}
    assert {r["op"] for r in result["records"] if r["impl"] == "copy"} == {"scatter"}  # the size-matched floor
    scatters = [row for row in result["summary"]["rows"] if row["op"] == "scatter"]
    assert scatters and all(row["impls"]["copy"]["wall"] > 0 for row in scatters)
    assert all(len(r["samples_us"]) == 2 for r in result["records"])
    assert result["compiler_entries_after_seal"] == {"JITFunction.run": 0, "InterpretedFunction.run": 0,
                                                     "triton.compile": 0}
    plan = result["plans"]["tiny/bfloat16:float32"]
    assert plan["final_dtypes"] == ["float32"] and len(plan["variants"]) == 4
    assert main(argv) == 2 and json.loads(output.read_text()) == result


def test_best_loop_runs_warmup_then_the_loops_and_reports_the_fastest() -> None:
    from kda_patches.bench.timing import best_loop_us

    ticks: list[int] = []
    best = best_loop_us(lambda: ticks.append(1), calls=50, loops=4, warmup=7)
    assert len(ticks) == 7 + 4 * 50
    assert 0 < best < 1e6


@pytest.mark.gpu
def test_replay_graphs_times_every_call_in_each_round(device) -> None:
    import random

    from kda_patches.bench.timing import replay_graphs

    source = torch.randn(1024, device=device)
    targets = {name: torch.zeros_like(source) for name in ("copy", "scaled")}
    ran = {"copy": 0, "scaled": 0}

    def counted(name, launch):
        def call(step):
            ran[name] += 1  # host code: runs at warm-up and capture only, never at replay
            return launch()
        return call

    calls = {"copy": counted("copy", lambda: targets["copy"].copy_(source)),
             "scaled": counted("scaled", lambda: torch.mul(source, 2.0, out=targets["scaled"]))}
    samples = replay_graphs(calls, graph_calls=5, trials=6, device=device, shuffler=random.Random(3), instances=3)
    assert set(samples) == set(calls) and all(len(values) == 6 and min(values) > 0 for values in samples.values())
    assert ran == {"copy": 3 * (3 + 5), "scaled": 3 * (3 + 5)}  # three captures, each 3 warm-up calls and 5 captured
    assert torch.equal(targets["copy"], source) and torch.equal(targets["scaled"], source * 2.0)


def test_gdn_bench_measures_the_pdl_plan_only_where_the_target_has_pdl(tmp_path, device, capsys):
    output = tmp_path / "gdn.json"
    argv = ["gdn-state-copy", "--output", str(output), "--device", str(device), "--rows", "12", "--shapes",
            "tiny=2,3,8", "--gap-items", "5", "--selected", "1,3", "--trials", "2", "--graph-calls", "3",
            "--graph-instances", "2", "--cases", "bfloat16:float32", "--seed", "3", "--pdl"]
    assert main(argv) == 0
    impls = {record["impl"] for record in json.loads(output.read_text())["records"]}
    from kda_patches.state_copy.device import PDL, target_facts

    if target_facts(device).honours(PDL):  # an SM90+ GPU: measured, bit-exact checked first like every impl
        assert "plan+pdl" in impls
    else:
        assert "plan+pdl" not in impls
        assert "plan+pdl is not measured: ['pdl: cpu-interpreter has no programmatic dependent launch']" in \
            capsys.readouterr().out


def test_random_selections_draw_rows_flags_and_finals_in_the_documented_order():
    from kda_patches.bench.state_copy import build_cache, random_selections

    state = build_cache(torch.device("cpu"), torch.bfloat16, 16, [2, 4, 8], 5)
    index_sets, flag_sets, last = random_selections(state, 6, 3, torch.Generator().manual_seed(9), torch.float32)
    twin = torch.Generator().manual_seed(9)  # rows of every set, then every flag vector, then the finals
    rows = [torch.randperm(16, generator=twin)[:6] for _ in range(3)]
    flags = [torch.rand(6, generator=twin) < 0.75 for _ in range(3)]
    assert all(a.dtype == torch.int32 and torch.equal(a, b.to(torch.int32))
               for a, b in zip(index_sets, rows, strict=True))
    assert all(len(set(a.tolist())) == 6 for a in index_sets)  # distinct rows
    assert all(torch.equal(a, b) for a, b in zip(flag_sets, flags, strict=True))
    assert last.shape == (6, 2, 4, 8) and last.dtype == torch.float32
    assert torch.equal(last, torch.randn((6, 2, 4, 8), generator=twin))
