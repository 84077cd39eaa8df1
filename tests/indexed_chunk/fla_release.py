"""Load a vLLM release's vendored FLA ops (``vllm/third_party/flash_linear_attention/ops``) in this process.

Each file is compiled from its release path (so Triton and ``inspect`` read the release's source) under a private
package name per release, so two releases load side by side and nothing shadows the installed vLLM. Imports
resolve as on a device with Triton: relative ones to the same release's files, ``vllm.triton_utils`` to the real
``triton`` (vLLM's CPU build disables it), everything else to what is installed.

The interpreter fixes are :mod:`fla_interpreter`'s (tests/released), applied by the tests to the modules they run.
"""

from __future__ import annotations

import builtins
import importlib.util
import pathlib
import sys
import types
from typing import Any

import triton
import triton.language as tl

from kda_patches.releases.fetch import release_dir

OPS = "vllm/third_party/flash_linear_attention/ops"
_loaded: dict[str, dict[str, types.ModuleType]] = {}


def _triton_utils() -> types.ModuleType:
    module = types.ModuleType("vllm.triton_utils")
    libdevice = getattr(getattr(tl, "extra", None), "libdevice", None)
    module.__dict__.update(HAS_TRITON=True, triton=triton, tl=tl, tldevice=libdevice)
    return module


def load_fla_module(version: str, stem: str) -> types.ModuleType:
    """Return the release's ``ops/<stem>.py`` executed under ``kda_release_fla_<version>.<stem>``."""
    modules = _loaded.setdefault(version, {})
    if stem in modules:
        return modules[stem]
    folder = pathlib.Path(release_dir("vllm", version)) / OPS
    package = "kda_release_fla_" + version.replace(".", "_")
    if package not in sys.modules:
        holder = types.ModuleType(package)
        holder.__path__ = [str(folder)]
        sys.modules[package] = holder
    name = f"{package}.{stem}"
    spec = importlib.util.spec_from_file_location(name, folder / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)

    def release_import(target: str, globals_: Any = None, locals_: Any = None, fromlist: Any = (), level: int = 0
                       ) -> Any:
        if level == 1:
            for item in fromlist or ():
                if (folder / f"{target}.py").exists() and target:
                    load_fla_module(version, target)
                elif not target and (folder / f"{item}.py").exists():
                    load_fla_module(version, item)
            return sys.modules[f"{package}.{target}"] if target else sys.modules[package]
        if target == "vllm.triton_utils":
            return _triton_utils()
        return builtins.__import__(target, globals_, locals_, fromlist, level)

    module.__builtins__ = {**builtins.__dict__, "__import__": release_import}
    sys.modules[name] = module
    modules[stem] = module
    spec.loader.exec_module(module)
    return module
