"""The state-copy benchmark runs end to end (tiny CPU smoke run) and refuses an existing output file."""

from __future__ import annotations

import json

from kda_patches.bench import main


def test_bench_smoke_run_writes_raw_samples_and_refuses_overwrite(tmp_path, device):
    output = tmp_path / "bench.json"
    argv = ["state-copy", "--output", str(output), "--device", str(device), "--rows", "12", "--inner", "2,3,8",
            "--gap-items", "5", "--selected", "1,3", "--trials", "2", "--graph-calls", "3",
            "--dtypes", "float32,bfloat16", "--fused-variants", "64/2/stream", "--seed", "7"]
    assert main(argv) == 0
    result = json.loads(output.read_text())
    assert result["benchmark"] == "state-copy" and len(result["source_sha256"]) == 64
    impls = {record["impl"] for record in result["records"]}
    assert impls == {"fused", "fallback", "torch-native", "fused-64w2-stream", "reference-contiguous-copy"}
    assert all(len(record["samples_us"]) == 2 for record in result["records"])
    assert {record["mode"] for record in result["records"]} >= {"wall", "enqueue"}
    assert result["compiler_entries_after_seal"] == {"JITFunction.run": 0, "triton.compile": 0}
    assert result["summary"]["checks"]["compiler_entries_after_seal"]["met"] is True
    assert main(argv) == 2  # the output exists: refused, untouched
    assert json.loads(output.read_text()) == result
