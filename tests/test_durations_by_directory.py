"""The per-directory test-time summary (``durations_by_directory``)."""

from __future__ import annotations

from types import SimpleNamespace

from durations_by_directory import directory_of, directory_totals, format_totals


def report(nodeid: str, duration: float, when: str = "call") -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, duration=duration, when=when)


def test_a_test_is_filed_under_the_folder_of_its_file():
    assert directory_of("tests/kimi/test_a.py::test_b[x-y]") == "tests/kimi"
    assert directory_of("tests/test_cli.py::test_c") == "tests"
    assert directory_of("test_top.py::t") == "."


def test_phases_add_up_per_directory_and_each_test_counts_once():
    rows = directory_totals([
        report("tests/kimi/test_a.py::t1", 2.0), report("tests/kimi/test_a.py::t1", 0.5, "setup"),
        report("tests/kimi/test_b.py::t2", 1.0), report("tests/test_cli.py::t3", 4.0),
        report("tests/released/test_c.py::t4", 0.25)])
    assert rows == [("tests", 4.0, 1), ("tests/kimi", 3.5, 2), ("tests/released", 0.25, 1)]


def test_the_summary_ends_with_the_sum_over_every_directory():
    lines = format_totals([("tests/kimi", 3.5, 2), ("tests", 1.0, 1)])
    assert lines[0].split() == ["3.5", "s", "2", "tests", "tests/kimi"]
    assert lines[-1].split()[:4] == ["4.5", "s", "3", "tests"]
