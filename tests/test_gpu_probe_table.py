"""probe_table: per-capture medians, the capture count of old and new probe results, and the spread of identical
gather kernels (synthetic results, so each rule alone decides)."""

from __future__ import annotations

import json
import lzma

import pytest
from script_loader import load_script


@pytest.fixture
def table():
    return load_script("gpu/probe_table.py", "probe_table_under_test")


def record(impl, samples, cache="float32", final="float32", selected=1, op="gather"):
    return {"shape": "qwen", "cache": cache, "final": final, "selected": selected, "impl": impl, "op": op,
            "graph_us": samples}


def test_a_result_without_the_option_had_one_capture_and_one_with_it_has_that_many(table):
    assert table.graph_instances({"argv": ["--trials", "30"]}) == 1
    assert table.graph_instances({"argv": ["--graph-instances", "3", "--trials", "30"]}) == 3


def test_capture_medians_take_each_block_of_rounds_apart(table):
    assert table.capture_medians([1.0, 1.5, 5.0, 5.5, 3.0, 3.5], 3) == [1.25, 5.25, 3.25]
    assert table.capture_medians([1.0, 1.5, 5.0, 5.5], 1) == [3.25]


def test_only_labels_that_compile_the_same_gather_count_as_twins(table):
    row = {"plan default": {"median": 1.00}, "plan 4096/4": {"median": 1.035},
           "plan 8192/8": {"median": 9.0},  # another tile: not a twin of anything, however far off
           "plan 4096/8": {"median": 2.0}}  # alone in its family: no spread
    assert table.twin_spreads(row) == {"4 warps": (1.00, 1.035)}


def test_the_twin_view_reads_same_dtype_gathers_only(table, tmp_path):
    records = [record("upstream-0.34", [1.0, 1.0]), record("plan default", [1.0, 1.0]),
               record("plan 4096/4", [1.1, 1.1]),
               record("upstream-0.34", [1.0, 1.0], cache="bfloat16"), record("plan default", [1.0, 1.0], "bfloat16"),
               record("plan 4096/4", [1.2, 1.2], cache="bfloat16")]
    path = tmp_path / "probe.json.xz"
    with lzma.open(path, "wt") as handle:
        json.dump({"argv": ["--graph-instances", "2"], "device": "H", "triton": "3.6", "records": records}, handle)
    lines = table.format_rows(table.load_result(path), "gather", None, twins=True)
    assert lines[0] == "H triton 3.6, 2 capture(s) each"
    twin_lines = [line for line in lines if "twins" in line]
    assert twin_lines == ["   twins 4 warps: upstream/x 0.909-1.000 (spread 10.0 %)"]  # the BF16 <- FP32 row: none
