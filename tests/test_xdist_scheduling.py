"""The xdist scheduling of ``make test``: engine files form one unit, tests/released another, every other file
is its own unit."""

from __future__ import annotations

import pathlib

import xdist_scheduling

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_engine_files_keep_to_their_unit_and_other_files_keep_their_own() -> None:
    for unit, files in xdist_scheduling.ENGINE_UNITS.items():
        assert {xdist_scheduling.work_unit(f"{path}::test_x[a-b]") for path in files} == {unit}
    kv_layout = xdist_scheduling.work_unit("tests/kv_layout/test_kv_engine_ab.py::test_engine_ab[DS]")
    assert kv_layout == xdist_scheduling.work_unit("tests/kv_layout/test_kv_activation_paths.py::test_x")  # one session
    assert kv_layout != xdist_scheduling.work_unit("tests/regress/test_serve_ab.py::test_x")
    assert xdist_scheduling.work_unit("tests/test_flags.py::test_x") == "tests/test_flags.py"
    assert xdist_scheduling.work_unit("tests/state_copy/test_state_copy_cast.py::test_y[1]") == \
        "tests/state_copy/test_state_copy_cast.py"


def test_released_files_share_one_unit() -> None:
    units = {xdist_scheduling.work_unit(f"tests/released/{name}::test_x") for name in
             ("test_ascend_gdn030_overlay.py", "test_ascend_gdn030_fla_baseline.py", "test_upstream_kimi_forward.py")}
    assert units == {xdist_scheduling.RELEASED_UNIT}
    assert xdist_scheduling.work_unit("tests/releases/test_support_matrix.py::test_x") == \
        "tests/releases/test_support_matrix.py"
    # a file elsewhere sharing a released batch (vLLM 0.34's no-copy cases: the 0.34 layer batch) joins the unit
    assert xdist_scheduling.work_unit("tests/indexed_chunk/test_indexed_034_layers.py::test_x[a]") == \
        xdist_scheduling.RELEASED_UNIT
    assert xdist_scheduling.work_unit("tests/indexed_chunk/test_indexed_route.py::test_x") == \
        "tests/indexed_chunk/test_indexed_route.py"


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
    assert probe._split_scope("tests/regress/test_serve_ab.py::test_throughput") == "engine-regress"
    assert probe._split_scope("tests/test_env.py::test_a") == "tests/test_env.py"


def test_the_engine_units_come_first_in_their_declared_order() -> None:
    nodeids = ["tests/test_env.py::test_a", "tests/regress/test_serve_ab.py::test_b",
               "tests/released/test_upstream_kimi_forward.py::test_c", "tests/kv_layout/test_kv_engine_ab.py::test_d"]
    ordered = sorted(nodeids, key=xdist_scheduling.queue_position)
    assert ordered[:2] == ["tests/kv_layout/test_kv_engine_ab.py::test_d", "tests/regress/test_serve_ab.py::test_b"]
    assert ordered[2:] == ["tests/test_env.py::test_a", "tests/released/test_upstream_kimi_forward.py::test_c"]


def test_each_worker_binds_its_engines_to_its_own_core() -> None:
    assert xdist_scheduling.engine_core_binding("gw0", 2) == "0"
    assert xdist_scheduling.engine_core_binding("gw1", 2) == "1"
    assert xdist_scheduling.engine_core_binding("gw3", 2) == "1"  # more workers than cores: they share, in turn
    assert xdist_scheduling.engine_core_binding(None, 2) is None  # not under xdist: vLLM's own default
    assert xdist_scheduling.engine_core_binding("gw0", None) is None
