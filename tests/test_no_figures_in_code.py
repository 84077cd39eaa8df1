"""No measured figure in the code's strings or docstrings (issue 52, deliverable 5).

A figure written into a string -- a speed-up ratio, a time, a percentage from a measurement, a run number -- goes
stale the day the next run lands. Stand-aside reasons, switch help texts and docstrings name the result folder and
the rule instead; the figures live in ``kda_patches/measured.json`` (checked against the results by
``tests/test_measured.py``) and in the results READMEs. This test visits every string constant of
``kda_patches/**/*.py`` with ``ast`` (docstrings, messages, help texts, the literal parts of f-strings; comments are
not strings and may keep their figures) and fails naming ``file:line`` and the figure. Reads files only.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kda_patches"

# what a measured figure looks like in prose
PATTERNS = {
    # 1.07x, 0.998-0.999x, 1.37–1.75×, 4-8x; not a shape or a product (12 x 128, 2 × 340)
    "ratio": re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?\s?[x×](?![\w])(?!\s*\d)"),
    # 12 µs, 20 us, ~0.5 us, 40-60 ms
    "time": re.compile(r"(?<![\w.])~?\d+(?:\.\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?\s?(?:µs|us|ms|ns)\b"),
    # seconds and minutes only when they read as measured: a decimal, a range or "~" (a bare "30 s" is a limit)
    "duration": re.compile(r"(?<![\w.])(?:~\d+(?:\.\d+)?|\d+\.\d+|\d+(?:\.\d+)?\s*[-–]\s*\d+(?:\.\d+)?)\s?(?:s|min)\b"),
    # 1.6 %, 5-23 %, 50%, and argparse's escaped 10.7 %% (a format spec such as {:.0%} is not a number)
    "percent": re.compile(r"(?<![\w.%])\d+(?:\.\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?\s?%"),
    # run 9, runs 3-5, runs 2 and 3
    "run number": re.compile(r"\bruns?\s+\d+"),
    # a bare measured ratio with three or four decimals: 0.985, 1.000-1.016, 1.070 / 1.058
    "bare ratio": re.compile(r"(?<![\w.])[01]\.\d{3,4}(?![\w.])"),
}
# not figures, whatever they look like: vLLM's release-series notation ("the 0.3x adapter", "vllm-0.3x")
NOT_FIGURES = re.compile(r"\b0\.\dx\b")
# figures that are algorithm constants, not measured results: (file, the figure as matched) -> why it may stay
EXCLUSIONS = {
    ("kda_patches/bench/state_copy.py", "75 %"):
        "the benchmark's input distribution (each flag true with probability 0.75, the seed-000 method that "
        "random_selections draws from), a constant of the benchmark, not a result",
}


def string_constants(path: pathlib.Path) -> list[tuple[int, str]]:
    """Return ``(line, text)`` for every line of every string constant of the Python file ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.extend((node.lineno + offset, line) for offset, line in enumerate(node.value.splitlines()))
    return found


def figures_in(text: str) -> list[tuple[str, str]]:
    """Return ``(kind, figure)`` for every measured-looking figure of ``text``."""
    text = NOT_FIGURES.sub("", text)
    return [(kind, match.group(0).strip()) for kind, pattern in PATTERNS.items() for match in pattern.finditer(text)]


def figures_in_package() -> list[str]:
    """Return ``file:line: kind 'figure' in: text`` for every figure in the package's strings, exclusions aside."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for line, text in string_constants(path):
            for kind, figure in figures_in(text):
                if (name, figure) not in EXCLUSIONS:
                    found.append(f"{name}:{line}: {kind} {figure!r} in: {text.strip()[:120]}")
    return found


def test_no_measured_figure_in_the_package_strings() -> None:
    found = figures_in_package()
    assert not found, ("measured figures in code strings; name the result folder and the rule instead, and put the "
                       "figure in kda_patches/measured.json or the results README:\n" + "\n".join(found))


def test_every_exclusion_still_matches_something() -> None:
    """An exclusion whose figure left the code is stale: remove it."""
    seen = {(path.relative_to(ROOT).as_posix(), figure) for path in sorted(PACKAGE.rglob("*.py"))
            for _, text in string_constants(path) for _, figure in figures_in(text)}
    assert not set(EXCLUSIONS) - seen, f"stale exclusions: {sorted(set(EXCLUSIONS) - seen)}"


@pytest.mark.parametrize("text", [
    "unpatched/patched per engine step 1.06-1.09x at 1-8 sequences", "0.998-0.999x at 64-256",
    "a one-program-per-row loop is 4-8x slower", "1.37–1.75×", "~20 µs of host time", "about 45 ms",
    "12 us per call", "~0.5 us", "took 5.0-9.1 s per pass", "~60 s starting", "0-1.6 % faster", "50% longer",
    "up to 3.5-10.7 %% apart", "H200 run 16", "runs 18-19", "runs 2 and 3", "read 0.985-0.999",
    "(1.000)", "1.070 / 1.058"])
def test_a_figure_is_found(text: str) -> None:
    assert figures_in(text), text


@pytest.mark.parametrize("text", [
    "the 0.3x adapter", "vLLM 0.3x-era", "BF16 state row (12 x 128 x 128)", "16 layers × 2 × 340 MB",
    "throttled {fraction:.0%}", "timeout 600 s", "30 s expires", ">= 1.00 at 1, 8, 64 and 256 sequences",
    "vllm>=0.34,<0.35", "version 0.32.0", "sm_90", "SM90+", "%5.1f%%", "tens of milliseconds", "run {n}",
    "a rerun"])
def test_a_non_figure_is_not_found(text: str) -> None:
    assert not figures_in(text), (text, figures_in(text))
