"""README.md and docs/VERIFICATION.md are kept true to the code (issue 52).

The README is the five-minute read: at most 12 KB, no line over 300 characters outside code blocks, the two set-up
commands (Makefile targets), a "what it gives" table per stack whose verdicts agree with the generated support
matrix and which names every registered patch, and one line per switch of ``kda_patches.flags.SWITCHES``.
``docs/VERIFICATION.md`` keeps each matrix cell at most 60 words. Every relative link of the README, the
verification page and the notebook (where the former README's text lives) reaches an existing file and, for a
Markdown file, an existing heading. Reads files only: no torch or vLLM import.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from kda_patches import registry
from kda_patches.flags import SWITCHES

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VERIFICATION = ROOT / "docs" / "VERIFICATION.md"
NOTEBOOK = ROOT / "docs" / "NOTEBOOK.md"
MATRIX = ROOT / "patches" / "SUPPORT_MATRIX.md"
MAKEFILE = ROOT / "Makefile"

README_MAX_BYTES = 12 * 1024
LINE_MAX_CHARS = 300
SWITCH_LINE_MAX_CHARS = 200
CELL_MAX_WORDS = 60
# the support matrix's verdict -> the README's first words for it ("inert" where a patch has no target on the stack)
VERDICT_WORDS = {"works": ("acts",), "stands down": ("stands aside",), "verifies": ("verifies",),
                 "inert": ("inert", "n/a"), "broken": ("broken",)}
# the README's stack label -> the support matrix stacks its columns cover
STACKS = {"vLLM": ("vllm", "vllm-cpu"), "vllm-ascend": ("vllm-ascend",), "vllm-plugin-FL": ()}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def split_fenced(text: str) -> tuple[list[str], list[str]]:
    """Return the lines of ``text`` outside and inside fenced code blocks (the fences themselves in neither)."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        else:
            (code if fenced else prose).append(line)
    return prose, code


def prose_lines(text: str) -> list[str]:
    """Return the lines of ``text`` outside fenced code blocks."""
    return split_fenced(text)[0]


def code_lines(text: str) -> list[str]:
    """Return the lines of ``text`` inside fenced code blocks."""
    return split_fenced(text)[1]


def section(text: str, heading: str) -> str:
    """Return the body of the ``## heading`` section of ``text`` (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def split_row(line: str) -> list[str]:
    """Return the cells of a Markdown table row (``\\|`` inside a cell is not a separator)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


def tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Return ``(label, header, rows)`` per table of ``text``; label: the last bold-led line before the table."""
    found, label, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("**"):
            label = line[2:line.index("**", 2)] if "**" in line[2:] else ""
        if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header, rows = split_row(line), []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(split_row(lines[i]))
                i += 1
            found.append((label, header, rows))
            continue
        i += 1
    return found


def github_anchors(path: pathlib.Path) -> set[str]:
    """Return the anchors GitHub gives the headings of the Markdown file ``path`` (code blocks skipped)."""
    anchors: set[str] = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        anchor, n = slug, 1
        while anchor in anchors:
            anchor, n = f"{slug}-{n}", n + 1
        anchors.add(anchor)
    return anchors


def broken_links(path: pathlib.Path) -> list[str]:
    """Return every relative link of ``path`` whose file, or heading in a Markdown file, does not exist."""
    broken = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                broken.append(f"{target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved):
                broken.append(f"{target}: no heading with anchor #{anchor}")
    return broken


def version_key(version: str) -> tuple:
    """Return a sortable key of ``0.30.0rc2`` / ``0.27`` (a final release sorts after its candidates)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)*)(?:rc(\d+))?", version)
    assert match, f"not a version: {version!r}"
    numbers = tuple(int(part) for part in match.group(1).split("."))
    return numbers, (int(match.group(2)) if match.group(2) else float("inf"))


def in_column(version: str, column: str) -> bool:
    """Return whether ``version`` lies in a README column heading: ``0.34``, ``0.27–0.33``, ``0.26.0rc1–0.29.0rc1``.

    A bound of two numbers (``0.33``) covers every release of that minor version.
    """
    low, _, high = column.partition("–")
    low, high = low.strip(), (high or low).strip()

    def compare(bound: str) -> tuple[tuple, tuple]:
        bound_numbers, bound_rc = version_key(bound)
        numbers, rc = version_key(version)
        if len(bound_numbers) < 3 and bound_rc == float("inf"):
            return numbers[:len(bound_numbers)], bound_numbers
        return (numbers, rc), (bound_numbers, bound_rc)

    low_value, low_bound = compare(low)
    high_value, high_bound = compare(high)
    return low_bound <= low_value and high_value <= high_bound


def support_matrix() -> dict[tuple[str, str], dict[str, str]]:
    """Return ``{(stack, version): {patch: verdict}}`` from the first table of patches/SUPPORT_MATRIX.md."""
    _, header, rows = tables(MATRIX.read_text(encoding="utf-8"))[0]
    patches = [cell.strip("`") for cell in header[1:]]
    matrix = {}
    for row in rows:
        stack, _, version = row[0].split(" + ")[0].partition("==")
        matrix[(stack, version)] = dict(zip(patches, row[1:], strict=True))
    return matrix


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def stack_tables() -> dict[str, tuple[list[str], list[list[str]]]]:
    """Return ``{stack label: (header, rows)}`` of the README's "What it gives" tables."""
    found = {label: (header, rows) for label, header, rows in tables(section(readme_text(), "What it gives"))}
    assert sorted(found) == sorted(STACKS), f"'What it gives' has tables for {sorted(found)}, not {sorted(STACKS)}"
    return found


def switch_rows() -> list[list[str]]:
    rows = [row for _, _, table in tables(section(readme_text(), "Switches")) for row in table]
    assert rows, "the Switches section has no table"
    return rows


def test_readme_is_at_most_12_kb() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, the limit is {README_MAX_BYTES}"


def test_no_line_over_300_characters_outside_code_blocks() -> None:
    long = [(line[:40], len(line)) for line in prose_lines(readme_text()) if len(line) > LINE_MAX_CHARS]
    assert not long, f"README.md lines over {LINE_MAX_CHARS} characters outside code blocks: {long}"


def test_the_two_commands_are_makefile_targets() -> None:
    commands = [line.split("#")[0].split() for line in code_lines(section(readme_text(), "The two commands "
                                                                               "(each sets up everything from "
                                                                               "nothing)"))]
    assert [words for words in commands if words] == [["make", "demo"], ["make", "test"]]
    targets = set(re.findall(r"^([A-Za-z0-9_-]+)\s*:", MAKEFILE.read_text(encoding="utf-8"), flags=re.MULTILINE))
    assert {"demo", "test"} <= targets, f"Makefile targets: {sorted(targets)}"


def test_every_switch_has_one_line_in_the_switch_table() -> None:
    rows = switch_rows()
    names = [row[0].strip("`") for row in rows]
    assert sorted(names) == sorted(SWITCHES), (
        f"switch table vs kda_patches.flags.SWITCHES: missing {sorted(set(SWITCHES) - set(names))}, "
        f"not a switch {sorted(set(names) - set(SWITCHES))}, listed twice "
        f"{sorted(name for name in names if names.count(name) > 1)}")
    table_lines = [line for line in section(readme_text(), "Switches").splitlines() if line.startswith("| `")]
    for line in table_lines:
        assert len(line) <= SWITCH_LINE_MAX_CHARS, f"{len(line)} characters: {line}"
        assert LINK.search(line), f"switch line links no section: {line}"


def test_what_it_gives_names_every_registered_patch_once_per_stack() -> None:
    names = sorted(registry.all_patches())
    for label, (header, rows) in stack_tables().items():
        assert header[0] == "patch", f"{label}: first column is {header[0]!r}"
        patches = sorted(row[0].strip("`") for row in rows)
        assert patches == names, f"{label} table lists {patches}, the registry {names}"


def test_what_it_gives_agrees_with_the_support_matrix() -> None:
    matrix = support_matrix()
    tables_by_label = stack_tables()
    for label, stacks in STACKS.items():
        header, rows = tables_by_label[label]
        columns = header[1:-1]
        cells = {row[0].strip("`"): dict(zip(columns, row[1:-1], strict=True)) for row in rows}
        for (stack, version), verdicts in matrix.items():
            if stack not in stacks:
                continue
            covering = [column for column in columns if in_column(version, column)]
            assert len(covering) == 1, f"{label}: {stack}=={version} is in columns {covering} of {columns}"
            for patch, verdict in verdicts.items():
                cell = cells[patch][covering[0]]
                assert cell.startswith(VERDICT_WORDS[verdict]), (
                    f"{label} {covering[0]} {patch}: README says {cell!r}, the support matrix {verdict!r} "
                    f"for {stack}=={version}")


def test_plugin_fl_table_follows_the_registry_targets() -> None:
    _, rows = stack_tables()["vllm-plugin-FL"]
    for row in rows:
        patch = registry.all_patches()[row[0].strip("`")]
        has_target = any(target.stack == "vllm-plugin-FL" for target in patch.targets)
        says_none = row[1].startswith(("n/a", "no target"))
        assert has_target != says_none, f"vllm-plugin-FL {patch.name}: README {row[1]!r}, targets there: {has_target}"


def test_readme_links_the_notebook_and_the_verification_page() -> None:
    targets = {target.partition("#")[0] for target in LINK.findall(readme_text())}
    assert {"docs/NOTEBOOK.md", "docs/VERIFICATION.md", "patches/SUPPORT_MATRIX.md"} <= targets


@pytest.mark.parametrize("path", [README, VERIFICATION, NOTEBOOK], ids=lambda path: path.name)
def test_relative_links_reach_files_and_headings(path: pathlib.Path) -> None:
    assert not broken_links(path), f"{path.name}: {broken_links(path)}"


def test_verification_cells_are_at_most_60_words() -> None:
    found = tables(VERIFICATION.read_text(encoding="utf-8"))
    assert len(found) == 1, "docs/VERIFICATION.md should hold one matrix"
    _, header, rows = found[0]
    assert header[1].startswith("CPU") and header[2].startswith("NVIDIA GPU") and header[3] == "Ascend", header
    for row in rows:
        assert len(row) == len(header), f"row with {len(row)} cells: {row[0]}"
        for column, cell in zip(header, row, strict=True):
            words = len(cell.split())
            assert words <= CELL_MAX_WORDS, f"{row[0]} / {column}: {words} words"
