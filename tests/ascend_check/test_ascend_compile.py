"""Every state-copy variant the plans can prepare compiles for Ascend A2/A3 and A5 (``make ascend-check``); so do the
indexed twins of vllm-ascend's chunk-state kernels, where their declaration says they fit.

Runs the check once, in the Ascend environment ``.venv-ascend`` (``make setup-ascend``; ``make test``
builds it; ``KDA_ASCEND_PYTHON`` names another interpreter), with triton-ascend and bishengir up to the
final HIVM IR, and reads its JSON report. A missing environment is a failure, not a skip: CI builds it.
Two more processes (``ascend_child.py``, one per chip class, side by side) compile a few of the report's
tasks again, to check what the check's per-process reuse and its stand-ins promise.

The suite compiles the twins of FP32 and BF16 caches (:data:`SUITE_TWIN_DTYPES`: vLLM's GDN/KDA state caches);
``make ascend-check`` compiles the FP16 cache's twins too (each twin compile takes seconds of bishengir, and the
suite must stay within its time on a two-core machine).
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
SUITE_TWIN_DTYPES = ("float32", "bfloat16")


def ascend_python() -> pathlib.Path:
    python = pathlib.Path(os.environ.get("KDA_ASCEND_PYTHON") or ROOT / ".venv-ascend" / "bin" / "python")
    if not python.exists():
        pytest.fail(f"no Ascend check environment at {python}: run `make setup-ascend` (make test does)")
    return python


def ascend_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = ascend_python()
    from kda_patches.ascend_check.calibration import release_root

    release_root()  # fetched with this interpreter's pip (the Ascend environment has no sdist build tools)
    output = tmp_path_factory.mktemp("ascend-check") / "report.json"
    done = subprocess.run([str(python), "-m", "kda_patches.ascend_check", "--json", str(output),
                           "--twin-cache-dtypes", ",".join(SUITE_TWIN_DTYPES)], cwd=ROOT,
                          env=ascend_env(), capture_output=True, text=True, timeout=3600)
    sys.stdout.write(done.stdout)
    if not output.exists():
        pytest.fail(f"the Ascend check wrote no report (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(output.read_text(encoding="utf-8"))


def test_every_variant_reaches_the_final_hivm_ir_on_both_chip_classes(report: dict) -> None:
    assert {entry["chip"] for entry in report["variants"]} == {"a2a3", "a5"}
    assert problems(report) == []
    lines = summary_lines(report)
    assert [line.split(":")[0] for line in lines] == [
        "ascend-check a2a3", "ascend-check a5", "ascend-check calibration (a2a3)", "ascend-check indexed twins a2a3",
        "ascend-check indexed twins a5"]
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


@pytest.mark.parametrize("chip", ["a2a3", "a5"])
def test_the_indexed_twins_of_every_vllm_ascend_release_are_compiled(report: dict, chip: str) -> None:
    """Per chip class: each kernel shape's released kernel and its twin under every suite cache dtype and NaN rule,
    for every release of ``indexed_twins.RELEASES`` (one kernel source each, all releases listed on it)."""
    from kda_patches.ascend_check.indexed_twins import A2A3_OVERFLOWS, KERNEL_FILES, RELEASES

    entries = [entry for entry in report["indexed_twins"] if entry["chip"] == chip]
    assert {entry["shape"] for entry in entries} == set(KERNEL_FILES)
    for shape in KERNEL_FILES:
        twins = {(entry["cache_dtype"], entry["nan_rule"]) for entry in entries if entry["shape"] == shape
                 and entry["twin"]}
        assert twins == {("float32", "bit copy"), *itertools.product(SUITE_TWIN_DTYPES[1:],
                                                                     ("canonical", "quiet", "preserve"))}
        released = [entry for entry in entries if entry["shape"] == shape and not entry["twin"]]
        assert len(released) == 1 and released[0]["releases"] == list(RELEASES)
        assert released[0]["stage"] == "hivm" and not released[0]["ub_retry"]  # the release's own kernel fits
    fitting = [entry for entry in entries if entry["twin"] and entry["stage"] == "hivm" and not entry["ub_retry"]]
    if chip == "a5":
        assert len(fitting) == 2 * 4  # every twin reaches the final HIVM IR (2 shapes x FP32 + BF16's 3 rules)
    else:
        overflowing = {(entry["shape"], entry["cache_dtype"], entry["nan_rule"]) for entry in entries
                       if entry["twin"] and entry not in fitting}
        assert overflowing == {(shape, *case) for shape, cases in A2A3_OVERFLOWS.items() for case in cases
                               if case[0] in SUITE_TWIN_DTYPES}
        assert all(entry["ub_required_bits"] and entry["ub_required_bits"] > entry["ub_available_bits"]
                   for entry in entries if entry["twin"] and entry not in fitting)


def test_evict_first_is_dropped_and_the_targets_say_so(report: dict) -> None:
    for chip, facts in report["hints"].items():
        assert facts["evict_first"]["compared"], chip
        assert facts["evict_first"]["hivm_differs"] == [] and facts["evict_first"]["declared_honoured"] is False


def test_the_committed_matrix_matches_a_fresh_check(report: dict) -> None:
    committed = (ROOT / MATRIX_PATH).read_text(encoding="utf-8")
    assert committed == render_matrix(report), f"{MATRIX_PATH} is stale: run `{REGENERATE}` and commit it"


RESULT_FIELDS = ("stage", "message", "ub_retry", "ub_required_bits", "ub_available_bits", "hivm_sha")


def result_of(entry: dict) -> dict:
    return {name: entry[name] for name in RESULT_FIELDS}


def recompiled(report: dict, chip: str) -> dict:
    """The chip class's last variant (X; late in its pool process), the last one before it of the same kernel
    parameters with other HIVM IR (Z), and for A5 a block-limit probe that overflows the unified buffer (P)."""
    from kda_patches.state_copy import casts

    entries = [entry for entry in report["variants"] if entry["chip"] == chip]  # in enumeration order
    last = len(entries) - 1
    other = max(index for index, entry in enumerate(entries[:last])
                if entry["hivm_sha"] not in (None, entries[last]["hivm_sha"])
                and set(entry["constexprs"]) == set(entries[last]["constexprs"]))
    picked = {"X": (("variant", [chip, last]), entries[last]), "Z": (("variant", [chip, other]), entries[other])}
    if chip == "a5":
        rules = {name: rule for rule, name in casts.NAN_RULES.items()}
        probe = next(entry for entry in report["limits"] if entry["chip"] == chip and entry["ub_required_bits"])
        picked["P"] = (("probe", [chip, probe["family"], probe["items"], "default", rules.get(probe["nan_rule"])]),
                       probe)
    return picked


@pytest.fixture(scope="module")
def children(report: dict) -> dict:
    """Per chip class: the picked report entries and one fresh process's compiles of them (``ascend_child.py``).

    A2/A3: X (the process's first compile), Z, X again. A5: the same, then P, then X and P by a toolchain
    without the hivmc-a5 stand-in."""
    plans = {}
    for chip in ("a2a3", "a5"):
        picked = recompiled(report, chip)
        order = ["X", "Z", "X"] + (["P", "X-", "P-"] if chip == "a5" else [])
        tasks = [{"task": picked[name.rstrip("-")][0], "stand_in_hivmc": not name.endswith("-")} for name in order]
        plans[chip] = (picked, order, tasks)
    env = {**ascend_env(), "PYTHONPATH": str(ROOT)}
    started = {chip: subprocess.Popen([str(ascend_python()), str(ROOT / "tests" / "ascend_check" / "ascend_child.py"),
                                       json.dumps(tasks)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
               for chip, (_, _, tasks) in plans.items()}
    found = {}
    for chip, process in started.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, f"{chip} child failed:\n{err[-4000:]}"
        picked, order, _ = plans[chip]
        output = json.loads(out)
        found[chip] = {"picked": {name: entry for name, (_, entry) in picked.items()},
                       "compiles": list(zip(order, output["compiles"], strict=True)), "answers": output["answers"]}
    return found


@pytest.mark.parametrize("chip", ["a2a3", "a5"])
def test_a_fresh_process_compiles_what_the_pooled_run_reported(children: dict, chip: str) -> None:
    """Per-process reuse: X, compiled late in a pool process, equals X as a fresh process's first compile."""
    first_name, first = children[chip]["compiles"][0]
    assert first_name == "X"
    assert first["result"] == result_of(children[chip]["picked"]["X"])
    assert first["result"]["stage"] == "hivm"


@pytest.mark.parametrize("chip", ["a2a3", "a5"])
def test_compiles_in_one_process_do_not_leak_into_each_other(children: dict, chip: str) -> None:
    """Z (other constexprs of the same kernel) after X, then X again, in one process: each its own result."""
    picked = children[chip]["picked"]
    assert picked["X"]["hivm_sha"] != picked["Z"]["hivm_sha"]  # the comparison can tell them apart
    for name, compiled in children[chip]["compiles"]:
        if not name.endswith("-"):
            assert compiled["result"] == result_of(picked[name]), name


@pytest.mark.parametrize("chip", ["a2a3", "a5"])
def test_bishengir_help_is_asked_once_per_process_and_binary(children: dict, chip: str) -> None:
    answers = children[chip]["answers"]
    kept = sum(len(facts["kept"]) for facts in answers.values())
    asked = [run for _, compiled in children[chip]["compiles"] for run in compiled["runs"] if run["help"]]
    compiles = [run for _, compiled in children[chip]["compiles"] for run in compiled["runs"]
                if run["program"] == "bishengir-compile" and not run["help"]]
    assert kept and len(asked) == kept < len(compiles)
    for name, facts in answers.items():
        assert facts["kept"] == facts["fresh"], name
    # A2/A3's stage asks two questions of its one binary; A5's asks one, of the two toolchains' links
    assert {name: len(facts["kept"]) for name, facts in answers.items() if facts["kept"]} == \
        ({"_check_bishengir_api_change": 1, "_check_bishengir_is_regbased": 1} if chip == "a2a3"
         else {"_check_bishengir_api_change": 2})


def test_the_hivmc_a5_stand_in_stops_bishengir_after_the_final_ir_and_changes_no_result(children: dict) -> None:
    """Without the stand-in bishengir-compile-a5 runs its pipeline five times (hivmc-a5 missing each time);
    with it once; the results are the same, an unified-buffer overflow before hivmc included."""
    compiles = dict(children["a5"]["compiles"])
    missing = {name: [run["hivmc_missing"] for run in compiled["runs"]
                      if run["program"] == "bishengir-compile" and not run["help"]]
               for name, compiled in children["a5"]["compiles"]}
    assert missing["X-"] == [5] and missing["X"] == [0]
    assert compiles["X-"]["result"] == compiles["X"]["result"]
    assert compiles["P"]["result"]["stage"] != "hivm" and compiles["P"]["result"]["ub_required_bits"]
    assert compiles["P-"]["result"] == compiles["P"]["result"]
    assert all(count == 0 for name, counts in missing.items() if not name.endswith("-") for count in counts)


def test_the_a2a3_bishengir_runs_its_pipeline_once_without_a_stand_in(children: dict) -> None:
    """bishengir-compile (A2/A3) looks for hivmc twice (its ``--version``, then the one run) and stops."""
    counts = [run["hivmc_missing"] for _, compiled in children["a2a3"]["compiles"] for run in compiled["runs"]
              if run["program"] == "bishengir-compile" and not run["help"]]
    assert counts and all(count == 2 for count in counts)
