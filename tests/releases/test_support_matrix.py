"""``patches/SUPPORT_MATRIX.md`` equals a fresh conformance run over the default matrix, and that run is clean.

Acceptance of the release-conformance issue: no patch is *broken* on any listed stack, and every *inert* or
*stands down* verdict carries its reason. When a patch record changes, regenerate the file with
``kda-patches conformance --write-matrix`` and commit it.
"""

from __future__ import annotations

import difflib
import pathlib

import pytest

from kda_patches.releases.matrix import MATRIX_PATH, default_stacks, render_matrix, run_matrix

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_matrix()


def test_committed_matrix_matches_a_fresh_run(reports: list[dict]) -> None:
    committed = (ROOT / MATRIX_PATH).read_text(encoding="utf-8")
    fresh = render_matrix(reports)
    diff = "".join(list(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True), "committed",
                                             "fresh run", n=0))[:40])
    assert committed == fresh, (f"{MATRIX_PATH} is stale: run `kda-patches conformance --write-matrix` and commit "
                                f"it; the differences:\n{diff}")


def test_every_listed_stack_is_read_and_no_patch_is_broken(reports: list[dict]) -> None:
    assert [report["stack"].split(" + ")[0] for report in reports] == default_stacks()
    broken = [f"{report['stack']} {name}: {entry['reason']}" for report in reports
              for name, entry in report["patches"].items() if entry["verdict"] == "broken"]
    assert broken == []
    for report in reports:
        for name, entry in report["patches"].items():
            assert entry["verdict"] in ("works", "stands down", "verifies", "inert"), (report["stack"], name)
            if entry["verdict"] != "works":
                assert len(entry["reason"]) > 20, (report["stack"], name, entry["reason"])


def test_readme_links_the_matrix() -> None:
    assert "SUPPORT_MATRIX.md" in (ROOT / "patches" / "README.md").read_text(encoding="utf-8")


def test_every_wrapped_state_copy_seam_of_the_matrix_rewrites(reports: list[dict]) -> None:
    """Each released seam the overlay wraps has exactly the declared copy lines (read as the wrapper reads them)."""
    seen, refused = 0, []
    for report in reports:
        for entry in report["patches"].values():
            for target in entry["targets"]:
                if "routing" in target:
                    seen += 1
                    if target["routing"]["mechanism"] != "rewrite":
                        refused.append(f"{report['stack']} {target['key']}: {target['routing']['reason']}")
    assert seen >= 40 and refused == []
