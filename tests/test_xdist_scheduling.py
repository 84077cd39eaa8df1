"""The xdist scheduling of ``make test``: engine files form one unit, tests/released another, every other file
is its own unit."""

from __future__ import annotations

import pathlib

import xdist_scheduling

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_engine_files_share_one_unit_and_other_files_keep_their_own() -> None:
    units = {xdist_scheduling.work_unit(f"{path}::test_x[a-b]") for path in xdist_scheduling.ENGINE_FILES}
    assert units == {xdist_scheduling.ENGINE_UNIT}
    assert xdist_scheduling.work_unit("tests/test_flags.py::test_x") == "tests/test_flags.py"
    assert xdist_scheduling.work_unit("tests/state_copy/test_state_copy_cast.py::test_y[1]") == \
        "tests/state_copy/test_state_copy_cast.py"


def test_released_files_share_one_unit() -> None:
    units = {xdist_scheduling.work_unit(f"tests/released/{name}::test_x") for name in
             ("test_ascend_gdn030_overlay.py", "test_ascend_gdn030_fla_baseline.py", "test_upstream_kimi_forward.py")}
    assert units == {xdist_scheduling.RELEASED_UNIT}
    assert xdist_scheduling.work_unit("tests/releases/test_support_matrix.py::test_x") == \
        "tests/releases/test_support_matrix.py"


def test_every_engine_file_exists_and_marks_an_engine_test() -> None:
    for path in xdist_scheduling.ENGINE_FILES:
        assert "pytest.mark.engine" in (ROOT / path).read_text(encoding="utf-8"), path


def test_the_scheduler_splits_by_work_unit() -> None:
    from xdist.scheduler import LoadScopeScheduling

    class Probe(LoadScopeScheduling):
        def __init__(self) -> None:  # no workers: only the unit rule is exercised
            pass

    built = xdist_scheduling.scheduler_class()
    probe = type("Probe", (built,), {"__init__": Probe.__init__})()
    assert isinstance(probe, LoadScopeScheduling)
    assert probe._split_scope("tests/regress/test_serve_ab.py::test_throughput") == "engine"
    assert probe._split_scope("tests/test_env.py::test_a") == "tests/test_env.py"
