"""Import one released file by path, with vLLM's ``triton_utils`` answered by the installed Triton.

The forks' kernel files start with ``from vllm.triton_utils import tl, triton``: vLLM's module that
re-exports Triton (or a placeholder where it is missing). To run the release's own code without its
vLLM, that one import is answered with the installed ``triton`` / ``triton.language`` for the duration of
the import; the file itself is executed unchanged, under a private module name (registered in
``sys.modules`` because the Triton JIT reads a kernel's source through its module).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types
from typing import Any


def load_released_module(root: pathlib.Path, relative: str) -> Any:
    """Import ``root / relative`` and return the module.

    Args:
        root: a release folder of the release cache (:func:`kda_patches.releases.fetch.release_dir`).
        relative: the file, e.g. ``vllm_ascend/ops/triton/mamba/state_index.py``.
    Returns:
        The module, as ``kda_release_<path>`` in ``sys.modules``.
    Raises:
        FileNotFoundError: the release lacks the file.
    """
    import triton
    import triton.language as tl

    path = pathlib.Path(root) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not in the release folder {root}")
    name = "kda_release_" + relative.replace("/", "_").removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    saved = {module: sys.modules.get(module) for module in ("vllm", "vllm.triton_utils")}
    shim = types.ModuleType("vllm.triton_utils")
    shim.tl, shim.triton = tl, triton
    package = saved["vllm"] or types.ModuleType("vllm")
    sys.modules.update({"vllm": package, "vllm.triton_utils": shim})
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    finally:
        for module_name, module_value in saved.items():
            if module_value is None:
                sys.modules.pop(module_name, None)
            else:
                sys.modules[module_name] = module_value
    return module
