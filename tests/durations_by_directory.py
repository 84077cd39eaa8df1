"""Test time per directory of ``tests/``: the closing summary of every ``make test`` (issue 28's per-directory
report). Sums each test's setup, call and teardown durations under the folder of its file, so a directory's cost
stays visible in every CI log; under xdist the sums are test-seconds across both workers, not wall time."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any


def directory_of(nodeid: str) -> str:
    """``tests/kimi/test_x.py::test_y[a]`` -> ``tests/kimi``; a file directly under ``tests`` -> ``tests``."""
    path = nodeid.split("::", 1)[0]
    return path.rsplit("/", 1)[0] if "/" in path else "."


def directory_totals(reports: Iterable[Any]) -> list[tuple[str, float, int]]:
    """Return ``(directory, seconds, tests)`` per directory, the costliest first.

    Args:
        reports: pytest's test reports (``nodeid``, ``when``, ``duration``), any phases; a test counts once
            (its call phase, or its setup where it never got to run).
    """
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set[str]] = defaultdict(set)
    for report in reports:
        directory = directory_of(report.nodeid)
        seconds[directory] += float(getattr(report, "duration", 0.0) or 0.0)
        tests[directory].add(report.nodeid)
    return sorted(((name, seconds[name], len(tests[name])) for name in seconds), key=lambda row: (-row[1], row[0]))


def format_totals(rows: list[tuple[str, float, int]]) -> list[str]:
    """One line per directory: ``  612.3 s   187 tests  tests/released``, then the sum."""
    lines = [f"{seconds:8.1f} s {count:5d} tests  {name}" for name, seconds, count in rows]
    total = sum(seconds for _, seconds, _ in rows)
    return [*lines, f"{total:8.1f} s {sum(count for _, _, count in rows):5d} tests  (all; test-seconds, not wall)"]
