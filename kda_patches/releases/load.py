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
    path = pathlib.Path(root) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not in the release folder {root}")
    name = "kda_release_" + relative.replace("/", "_").removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    run_serving(name, module, triton_utils_shim(), lambda: spec.loader.exec_module(module))
    return module


def run_serving(name: str, module: Any, modules: dict[str, Any], execute: Any) -> None:
    """Register ``module`` as ``name`` and run ``execute()`` with ``modules`` in ``sys.modules`` meanwhile.

    ``module`` stays registered (the Triton JIT reads a kernel's source through its module) unless ``execute``
    raises; whatever ``sys.modules`` held under the served names is put back either way.
    """
    saved = {module_name: sys.modules.get(module_name) for module_name in modules}
    sys.modules.update(modules)
    try:
        sys.modules[name] = module
        try:
            execute()
        except BaseException:
            sys.modules.pop(name, None)
            raise
    finally:
        for module_name, module_value in saved.items():
            if module_value is None:
                sys.modules.pop(module_name, None)
            else:
                sys.modules[module_name] = module_value


def triton_utils_shim() -> dict[str, Any]:
    """``{"vllm": ..., "vllm.triton_utils": ...}`` answering ``from vllm.triton_utils import tl, triton`` with the
    installed Triton (an installed ``vllm`` package stays itself; only its ``triton_utils`` is answered)."""
    import triton
    import triton.language as tl

    shim = types.ModuleType("vllm.triton_utils")
    shim.tl, shim.triton = tl, triton
    return {"vllm": sys.modules.get("vllm") or types.ModuleType("vllm"), "vllm.triton_utils": shim}


class PortMismatch(RuntimeError):
    """A declared port replacement does not occur in the release file (the release changed)."""


def load_ported_module(root: pathlib.Path, relative: str, replacements: tuple[tuple[str, str, str], ...],
                       modules: dict[str, Any]) -> tuple[Any, list[str]]:
    """Import ``root / relative`` with declared text replacements, serving ``modules`` to its imports.

    For a fork file that names its device namespace (``torch.npu``) or needs a launch argument another
    backend counts: each replacement is ``(old, new, why)``; every ``old`` must occur in the file (else
    :class:`PortMismatch`), and nothing else is changed. The code is compiled with the release path as its
    file name. ``modules`` (stand-ins, other released files) and :func:`triton_utils_shim` answer its imports
    for the duration of the import only; whatever ``sys.modules`` held under those names is put back.

    Args:
        root: a release folder of the release cache.
        relative: the file, e.g. ``vllm_ascend/ops/kda_state_copy_plan.py``.
        replacements: ``(old, new, why)`` per change.
        modules: ``{module name: module}`` served during the import.
    Returns:
        ``(module, applied)``: the module (``kda_release_<path>`` in ``sys.modules``) and one line per
        replacement, ``"<old> -> <new> (<count>x): <why>"``.
    Raises:
        FileNotFoundError: the release lacks the file.
        PortMismatch: a replacement's ``old`` text is not in the file.
    """
    path = pathlib.Path(root) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not in the release folder {root}")
    text = path.read_text(encoding="utf-8")
    applied = []
    for old, new, why in replacements:
        count = text.count(old)
        if not count:
            raise PortMismatch(f"{relative}: the port expects {old!r}, which this release does not contain")
        text = text.replace(old, new)
        applied.append(f"{old} -> {new} ({count}x): {why}")
    name = "kda_release_ported_" + relative.replace("/", "_").removesuffix(".py")
    module = types.ModuleType(name)
    module.__file__ = str(path)
    code = compile(text, str(path), "exec")  # the release's own code, ported
    run_serving(name, module, {**triton_utils_shim(), **modules}, lambda: exec(code, module.__dict__))
    return module, applied
