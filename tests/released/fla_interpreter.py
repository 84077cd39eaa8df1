"""Interpreter fixes for vLLM's vendored FLA kernels (``vllm/third_party/flash_linear_attention/ops``), on the CPU.

Declared, applied to the loaded release modules only; compiled kernels need none:

- ``range`` yields Triton int32 scalars: the interpreter's loop index is a Python int, and the kernels call ``.to``
  on it (``i_t.to(tl.int64)``);
- ``exp`` / ``exp2`` / ``log`` / ``log2`` / ``gather`` call ``tl``'s at run time: ``op.py`` binds the builtins at
  import, before the interpreter patches them for a launch (every module that imported them is fixed);
- every autotuner keeps one config (the interpreter cannot time configs): the first of the release's own, or the
  one given (the indexed twin's, so both sides run the same launch).
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import triton
import triton.language as tl


def interpreter_range(*bounds: Any) -> Any:
    """``range`` over Triton int32 scalars (bounds may be interpreter tensors)."""
    from triton.runtime.interpreter import TensorHandle

    values = [int(b.handle.data.item()) if hasattr(b, "handle") else int(b) for b in bounds]
    for index in range(*values):
        yield tl.core.tensor(TensorHandle(np.array([index], dtype=np.int32), tl.int32), tl.int32)


LATE_BOUND = ("exp", "exp2", "log", "log2", "gather")


def _late_bound(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(tl, name)(*args, **kwargs)

    return call


def _autotuner_of(value: Any) -> Any:
    for _ in range(4):
        if value is None or isinstance(value, (types.ModuleType, type)):
            return None
        if isinstance(getattr(value, "configs", None), list):
            return value
        value = getattr(value, "fn", None)
    return None


def fix_for_interpreter(module: types.ModuleType, config: dict[str, Any] | None = None) -> list[str]:
    """Apply the fixes to one loaded FLA module; return the names of the autotuners narrowed.

    Args:
        module: the module.
        config: ``{"kwargs": ..., "num_warps": ..., "num_stages": ...}`` every autotuner keeps, or None (each keeps
            its own first config).
    """
    module.__dict__["range"] = interpreter_range
    for name in LATE_BOUND:  # op.py's aliases of Triton builtins, wherever a module imported them
        if name in vars(module):
            module.__dict__[name] = _late_bound(name)
    narrowed = []
    for name, value in list(vars(module).items()):
        autotuner = _autotuner_of(value)
        if autotuner is None:
            continue
        chosen = autotuner.configs[0] if config is None else triton.Config(
            dict(config["kwargs"]), num_warps=config["num_warps"], num_stages=config["num_stages"])
        autotuner.configs = [chosen]
        narrowed.append(name)
    return narrowed
