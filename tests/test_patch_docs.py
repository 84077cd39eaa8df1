"""The registry, the patch modules and patches/README.md list the same patches and targets."""

from __future__ import annotations

import pathlib
import pkgutil
import re

import kda_patches.patches as patch_package
from kda_patches import registry
from kda_patches.patches import PATCH_MODULES

README = pathlib.Path(__file__).resolve().parents[1] / "patches" / "README.md"


def readme_sections() -> dict[str, str]:
    """Return ``{patch name: section text}`` from the ``## `name` `` headings of patches/README.md."""
    text = README.read_text()
    parts = re.split(r"^## `([a-z0-9_]+)`\s*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_registry_modules_and_readme_agree():
    modules = sorted(info.name for info in pkgutil.iter_modules(patch_package.__path__))
    assert sorted(PATCH_MODULES) == modules
    names = list(registry.all_patches())
    assert list(readme_sections()) == names


def test_every_target_is_documented_in_its_section():
    sections = readme_sections()
    for name, patch in registry.all_patches().items():
        for target in patch.targets:
            assert target.module in sections[name], f"{target.module} missing from the {name} section"
            assert target.qualname in sections[name], f"{target.qualname} missing from the {name} section"


def test_every_section_states_switch_and_removal_condition():
    for name, text in readme_sections().items():
        for heading in ("**Why.**", "**How.**", "**Switch.**", "**Verified on.**", "**Remove when.**"):
            assert heading in text, f"{heading} missing from the {name} section"


def test_no_run_by_run_narrative_in_the_patch_sections():
    """Run-by-run figures live in the results READMEs (issue 52): a patch section names no run number."""
    for name, text in readme_sections().items():
        runs = re.findall(r"\bruns? \d+(?:[-–]\d+)?", text)
        assert not runs, f"{name} section quotes {runs}: move the narrative to its docs/results README and link it"
