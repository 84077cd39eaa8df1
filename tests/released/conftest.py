"""tests/released: at the end of the session, list every released function executed and what was stood in."""

from __future__ import annotations

import pytest
import released_ab


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not released_ab.EXECUTED:
        return
    terminalreporter.section("released code executed under the overlay (stood-in names per run)")
    for title, standins in sorted(released_ab.EXECUTED.items()):
        terminalreporter.write_line(title)
        terminalreporter.write_line(standins)
