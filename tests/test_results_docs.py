"""Every results README opens with a short summary before its run log (issue 52, deliverable 3).

A reader who lands on ``docs/results/<campaign>/README.md`` gets, right under the title, a ``## Summary`` of at most
15 lines: what the campaign measures, the newest verdict with the card it ran on (H100, H200, or the CPU) and its
date, and the command that reproduces it, in backticks. The run log below it stays as it was written. Reads files
only: no torch or vLLM import.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
SUMMARY_HEADING = "## Summary"
SUMMARY_MAX_LINES = 15
CARD = re.compile(r"\b(H100|H200|CPU)\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# a command: a backticked span that starts with something one runs
COMMAND = re.compile(r"`(?:[A-Z_]+=\S+ )*(?:python3?|\.venv/bin/|make|kda-patches|bash|timeout|git|pytest|scripts/)"
                     r"[^`]*`")

READMES = sorted(RESULTS.glob("*/README.md"))


def summary_lines(path: pathlib.Path) -> list[str]:
    """Return the body lines of the ``## Summary`` section that follows ``path``'s title line.

    The summary ends at the next heading.

    Raises:
        AssertionError: the file does not open with ``# title``, blank lines and ``## Summary``.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines and lines[0].startswith("# "), f"{path}: the first line is not a '# ' title"
    rest = lines[1:]
    while rest and not rest[0].strip():
        rest.pop(0)
    assert rest and rest[0].strip() == SUMMARY_HEADING, (
        f"{path}: the first heading after the title is {rest[0] if rest else None!r}, "
        f"not {SUMMARY_HEADING!r}")
    body = []
    for line in rest[1:]:
        if line.startswith("#"):
            break
        body.append(line)
    while body and not body[0].strip():
        body.pop(0)
    while body and not body[-1].strip():
        body.pop()
    return body


def test_every_results_folder_with_a_readme_is_found() -> None:
    assert len(READMES) >= 8, [str(path) for path in READMES]


@pytest.mark.parametrize("path", READMES, ids=lambda path: path.parent.name)
def test_results_readme_opens_with_a_short_summary(path: pathlib.Path) -> None:
    body = summary_lines(path)
    name = path.relative_to(ROOT)
    assert body, f"{name}: empty summary"
    assert len(body) <= SUMMARY_MAX_LINES, f"{name}: summary of {len(body)} lines, at most {SUMMARY_MAX_LINES}"
    text = "\n".join(body)
    assert CARD.search(text), f"{name}: the summary names no card (H100, H200 or CPU)"
    assert DATE.search(text), f"{name}: the summary gives no date (YYYY-MM-DD) for its newest verdict"
    assert re.search(r"verdict", text, flags=re.IGNORECASE), f"{name}: the summary states no newest verdict"
    assert COMMAND.search(text), f"{name}: the summary quotes no command in backticks"


def test_summary_reader_rejects_a_readme_without_one(tmp_path: pathlib.Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# A campaign\n\nWhat ran: ...\n\n## Run 1\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="not '## Summary'"):
        summary_lines(readme)
