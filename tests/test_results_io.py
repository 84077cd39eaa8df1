"""Result JSON, plain or ``.json.xz``: round trip, byte-exact compression, clear refusals."""

from __future__ import annotations

import json
import lzma
import pathlib
import subprocess
import sys

import pytest

from kda_patches.results_io import compress, main, read_json, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = {"summary": {"rows": [{"shape": [4, 128], "graph": 1.25}]}, "argv": ["--seed", "41"], "note": "µs"}


def test_write_json_round_trips_through_xz(tmp_path):
    path = write_json(tmp_path / "run.json", DATA)
    assert path.endswith("run.json.xz")
    assert read_json(path) == DATA
    with lzma.open(path, "rt", encoding="utf-8") as handle:
        assert json.load(handle) == DATA
    with pytest.raises(FileExistsError):
        write_json(path, DATA)


def test_read_json_reads_plain_json_too(tmp_path):
    (tmp_path / "plain.json").write_text(json.dumps(DATA), encoding="utf-8")
    assert read_json(tmp_path / "plain.json") == DATA


def test_read_json_refuses_a_missing_file_and_names_its_compressed_twin(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no result file .*absent\.json'$"):
        read_json(tmp_path / "absent.json")
    write_json(tmp_path / "moved.json", DATA)
    with pytest.raises(FileNotFoundError, match=r"committed results are compressed: try .*moved\.json\.xz"):
        read_json(tmp_path / "moved.json")


def test_compress_keeps_the_exact_bytes_and_removes_the_original(tmp_path):
    raw = json.dumps(DATA, indent=1).encode() + b"\n"
    (tmp_path / "a.json").write_bytes(raw)
    assert main([str(tmp_path / "a.json")]) == 0
    assert not (tmp_path / "a.json").exists()
    assert lzma.decompress((tmp_path / "a.json.xz").read_bytes()) == raw


def test_compress_refuses_a_file_that_is_not_json(tmp_path):
    (tmp_path / "b.json").write_text("{truncated", encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        compress(tmp_path / "b.json")
    assert (tmp_path / "b.json").exists() and not (tmp_path / "b.json.xz").exists()


def test_committed_results_are_compressed_and_readable():
    try:
        tracked = subprocess.run(["git", "ls-files", "docs/results"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        tracked = []
    if not tracked:
        pytest.skip("not a git checkout (the tracked files are what is checked)")
    assert [name for name in tracked if name.endswith(".json")] == []
    compressed = [name for name in tracked if name.endswith(".json.xz")]
    assert compressed
    for name in compressed:
        assert isinstance(read_json(ROOT / name), dict), name


def test_compare_bench_reads_the_committed_compressed_runs():
    runs = ROOT / "docs" / "results" / "ascend-compile" / "h200-ab-run2"
    if not (runs / "gdn_before_1.json.xz").is_file():
        pytest.skip("the committed A/B runs are not in this tree")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_bench.py"), "--before",
                           str(runs / "gdn_before_1.json.xz"), "--after", str(runs / "gdn_after_1.json.xz"),
                           str(runs / "gdn_after_2.json.xz")], capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    assert done.stdout.splitlines()[-1].endswith("of 72 rows more than 2% slower")
