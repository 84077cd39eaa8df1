"""Every state-copy variant the plans can prepare compiles for Ascend A2/A3 and A5 (``make ascend-check``).

Runs the check once, in the Ascend environment ``.venv-ascend`` (``make setup-ascend``; ``make test``
builds it; ``KDA_ASCEND_PYTHON`` names another interpreter), with triton-ascend and bishengir up to the
final HIVM IR, and reads its JSON report. A missing environment is a failure, not a skip: CI builds it.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest

from kda_patches.ascend_check.matrix import MATRIX_PATH, REGENERATE, render_matrix
from kda_patches.ascend_check.run import problems, summary_lines

ROOT = pathlib.Path(__file__).resolve().parents[2]
DTYPES = ("float32", "bfloat16", "float16")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = pathlib.Path(os.environ.get("KDA_ASCEND_PYTHON") or ROOT / ".venv-ascend" / "bin" / "python")
    if not python.exists():
        pytest.fail(f"no Ascend check environment at {python}: run `make setup-ascend` (make test does)")
    from kda_patches.ascend_check.calibration import release_root

    release_root()  # fetched with this interpreter's pip (the Ascend environment has no sdist build tools)
    output = tmp_path_factory.mktemp("ascend-check") / "report.json"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([str(python), "-m", "kda_patches.ascend_check", "--json", str(output)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3600)
    sys.stdout.write(done.stdout)
    if not output.exists():
        pytest.fail(f"the Ascend check wrote no report (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(output.read_text(encoding="utf-8"))


def test_every_variant_reaches_the_final_hivm_ir_on_both_chip_classes(report: dict) -> None:
    assert {entry["chip"] for entry in report["variants"]} == {"a2a3", "a5"}
    assert problems(report) == []
    lines = summary_lines(report)
    assert [line.split(":")[0] for line in lines] == ["ascend-check a2a3", "ascend-check a5",
                                                      "ascend-check calibration (a2a3)"]
    assert all("all variants reach the final HIVM IR" in line for line in lines[:2])


@pytest.mark.parametrize("chip", ["a2a3", "a5"])
def test_the_enumeration_covers_every_dtype_pair_index_and_nan_rule(report: dict, chip: str) -> None:
    from kda_patches.ascend_check.plan_variants import MODEL_SHAPES

    entries = [entry for entry in report["variants"] if entry["chip"] == chip]
    scatters = {(entry["cache_dtype"], entry["final_dtype"], entry["name"].split("/")[2], entry["nan_rule"])
                for entry in entries if "/scatter/" in entry["name"]}
    expected = {(cache, final, index, "bit copy" if cache == final else rule)
                for cache, final, index, rule in itertools.product(DTYPES, DTYPES, ("int32", "int64"),
                                                                   ("canonical", "quiet", "preserve"))}
    assert scatters == expected
    gathers = {(entry["cache_dtype"], entry["name"].split("/")[2]) for entry in entries if "/gather/" in entry["name"]}
    assert gathers == set(itertools.product(DTYPES, ("int32", "int64")))
    for cache in DTYPES:
        served = {model for entry in entries if entry["cache_dtype"] == cache for model in entry["models"]}
        assert served == set(MODEL_SHAPES), (chip, cache)


def test_each_chip_class_compiles_the_plan_its_policy_routes_to(report: dict) -> None:
    plans = {(entry["chip"], entry["cache_dtype"]): entry["plan"] for entry in report["variants"]}
    assert plans == {("a2a3", "float32"): "fallback", ("a2a3", "bfloat16"): "fallback",
                     ("a2a3", "float16"): "fallback", ("a5", "float32"): "fused", ("a5", "bfloat16"): "fused",
                     ("a5", "float16"): "fallback"}


def test_the_calibration_accepts_shipping_kernels_and_rejects_the_canary(report: dict) -> None:
    shipping = {entry["name"].split(":")[1]: entry["stage"] for entry in report["calibration"] if entry["must_compile"]}
    assert shipping == {"batch_memcpy_kernel": "hivm", "_clear_ssm_states_kernel": "hivm",
                        "_gather_ssm_states_kernel": "hivm", "_scatter_ssm_states_kernel": "hivm"}
    canary = [entry for entry in report["calibration"] if not entry["must_compile"]]
    assert len(canary) == 1 and canary[0]["stage"] != "hivm" and "vcast" in canary[0]["message"]


def test_evict_first_is_dropped_and_the_targets_say_so(report: dict) -> None:
    for chip, facts in report["hints"].items():
        assert facts["evict_first"]["compared"], chip
        assert facts["evict_first"]["hivm_differs"] == [] and facts["evict_first"]["declared_honoured"] is False


def test_the_committed_matrix_matches_a_fresh_check(report: dict) -> None:
    committed = (ROOT / MATRIX_PATH).read_text(encoding="utf-8")
    assert committed == render_matrix(report), f"{MATRIX_PATH} is stale: run `{REGENERATE}` and commit it"
