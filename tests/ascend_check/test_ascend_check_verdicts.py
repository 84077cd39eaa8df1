"""The Ascend check's verdict rules (``run.problems``), each decided by a synthetic report.

The real report comes from ``test_ascend_compile.py``; here every rule of ``problems``' docstring has a
case where that rule alone turns a clean report into a problem.
"""

from __future__ import annotations

import copy

import pytest

from kda_patches.ascend_check.run import PROBE_MAX_ITEMS, problems, summary_lines


def compiled(stage: str = "hivm", retry: bool = False, message: str = "", sha: str | None = "abc") -> dict:
    return {"stage": stage, "message": message, "ub_retry": retry, "ub_required_bits": None,
            "ub_available_bits": None, "hivm_sha": sha if stage == "hivm" else None}


def clean_report() -> dict:
    variant = {"chip": "a2a3", "plan": "fallback", "name": "fallback/scatter/int32/float32", "cache_dtype": "bfloat16",
               "final_dtype": "float32", "nan_rule": "quiet", "family": "cast_items/float32->bfloat16", "block": 8192,
               "models": ["kimi-k3-kda"], "constexprs": {}, **compiled()}
    cast = {"chip": "a2a3", "family": "cast_items/float32->bfloat16", "declared": 8192}
    limits = [{**cast, "items": 8192, "nan_rule": "quiet", **compiled()},
              {**cast, "items": 8192, "nan_rule": "canonical", **compiled()},
              {**cast, "items": 16384, "nan_rule": "quiet", **compiled("ttadapter", message="error: ub overflow")},
              {**cast, "items": 16384, "nan_rule": "canonical", **compiled()},
              {"chip": "a2a3", "family": "bytes", "items": PROBE_MAX_ITEMS, "nan_rule": "bit copy", "declared": None,
               **compiled()}]
    hints = {"a2a3": {"evict_first": {"compared": ["fused/float32->float32"], "hivm_differs": [],
                                      "declared_honoured": False}}}
    calibration = [{"name": "batch_memcpy.py:batch_memcpy_kernel", "must_compile": True, **compiled()},
                   {"name": "canary:unsigned_compare", "must_compile": False,
                    **compiled("ttadapter", message="error: 'hivm.hir.vcast' op currently don't support")}]
    return {"toolchain": {"triton": "3.2.0", "ascendnpu_ir": "1.2.0", "python": "3.11"}, "variants": [variant],
            "limits": limits, "hints": hints, "calibration": calibration, "seconds": 1.0}


def test_the_clean_report_has_no_problems():
    report = clean_report()
    assert problems(report) == []
    assert summary_lines(report)[0].startswith("ascend-check a2a3: 1/1 variants reach the final HIVM IR")


def test_a_variant_that_stops_before_hivm_is_a_problem():
    report = clean_report()
    report["variants"][0].update(compiled("ttadapter", message="error: 'hivm.hir.vcast' op"))
    assert len(problems(report)) == 1 and "stopped at ttadapter" in problems(report)[0]
    assert "1 variants FAIL" in summary_lines(report)[0]


def test_a_variant_that_needs_the_overflow_retry_is_a_problem():
    report = clean_report()
    report["variants"][0].update(compiled(retry=True))
    assert len(problems(report)) == 1 and "UB-overflow retry" in problems(report)[0]


def test_a_declared_limit_that_does_not_fit_under_one_nan_rule_is_a_problem():
    report = clean_report()
    report["limits"][1].update(compiled("ttadapter", message="ub overflow"))
    assert problems(report) == ["a2a3 cast_items/float32->bfloat16: the declared limit 8192 items does not fit "
                                "(canonical)"]


def test_a_limit_whose_double_fits_under_every_rule_is_stale():
    report = clean_report()
    report["limits"][2].update(compiled())
    assert len(problems(report)) == 1 and "the table is stale" in problems(report)[0]


def test_an_unlimited_family_that_does_not_fit_the_probe_is_a_problem():
    report = clean_report()
    report["limits"][4].update(compiled("ttadapter", message="ub overflow"))
    assert len(problems(report)) == 1 and "declared unlimited" in problems(report)[0]


@pytest.mark.parametrize(("declared", "differs"), [(False, ["fused/float32->float32"]), (True, [])])
def test_a_hint_declaration_that_the_compiler_contradicts_is_a_problem(declared, differs):
    report = clean_report()
    report["hints"]["a2a3"]["evict_first"].update(declared_honoured=declared, hivm_differs=differs)
    assert len(problems(report)) == 1 and "evict_first" in problems(report)[0]


def test_a_shipping_kernel_that_does_not_compile_is_a_problem():
    report = clean_report()
    report["calibration"][0].update(compiled("ttir", message="error"))
    assert problems(report) == ["calibration batch_memcpy.py:batch_memcpy_kernel: did not compile (ttir: error)"]


def test_a_canary_that_compiles_is_a_problem():
    report = clean_report()
    report["calibration"][1].update(compiled())
    assert len(problems(report)) == 1 and "canary" in problems(report)[0] and "compiled" in problems(report)[0]


def test_every_problem_is_reported_not_only_the_first():
    report = copy.deepcopy(clean_report())
    report["variants"][0].update(compiled("ttir"))
    report["calibration"][1].update(compiled())
    assert len(problems(report)) == 2


def twin_entry(twin: bool = True, declared_fits: bool = True, **result: object) -> dict:
    return {"chip": "a2a3", "name": "vllm-ascend-fla@0123456789ab", "shape": "vllm-ascend-fla",
            "releases": ["0.30.0rc2"], "twin": twin, "cache_dtype": "bfloat16", "nan_rule": "quiet",
            "declared_fits": declared_fits, "constexprs": {}, **compiled(**result)}


def test_an_indexed_twin_declared_to_fit_that_overflows_is_a_problem():
    report = clean_report()
    report["indexed_twins"] = [twin_entry(), twin_entry(twin=False)]
    assert problems(report) == []
    report["indexed_twins"][0].update(compiled("ttadapter", retry=True, message="error: ub overflow"))
    found = problems(report)
    assert len(found) == 1 and "indexed twin" in found[0] and "declared to fit" in found[0]
    assert summary_lines(report)[-1].startswith("ascend-check indexed twins a2a3: 0/1 twins reach the final HIVM IR")


def test_an_indexed_twin_declared_not_to_fit_that_fits_is_a_problem():
    """The overflow table is checked both ways: a compiler that fits a declared overflow makes it stale."""
    report = clean_report()
    report["indexed_twins"] = [twin_entry(declared_fits=False, stage="ttadapter", retry=True)]
    assert problems(report) == []
    report["indexed_twins"][0].update(compiled())
    assert len(problems(report)) == 1 and "declared not to fit" in problems(report)[0]


def test_a_released_kernel_of_the_twins_that_does_not_compile_is_a_problem():
    report = clean_report()
    report["indexed_twins"] = [twin_entry(twin=False, stage="ttir", message="error")]
    assert len(problems(report)) == 1 and "indexed released kernel" in problems(report)[0]
