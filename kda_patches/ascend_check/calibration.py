"""Calibration of the Ascend compile check: kernels that ship, and kernels the compiler must reject.

A check is only worth its verdicts if it accepts code known to run and rejects code known not to.

- **Shipping kernels**: vllm-ascend 0.30's own Triton kernels that run in production on A2/A3
  (``batch_memcpy_kernel``, ``_clear_ssm_states_kernel``, ``_gather_ssm_states_kernel``,
  ``_scatter_ssm_states_kernel``), loaded from the release cache
  (:mod:`kda_patches.releases.fetch`) by path. Their module-level ``from vllm.triton_utils import tl,
  triton`` is answered with the installed triton-ascend (what vLLM's ``triton_utils`` re-exports on an
  NPU); the kernels' code is the release's, untouched. The signatures and constexprs are those of
  the fork's own launch sites (read from the same release: ``gather_ssm_states`` launches with
  ``STATE_IO_BLOCK_SIZE`` 1024, ``clear_ssm_states`` with 4096, the mamba copy with 8192), on a
  BF16 GDN state row of Qwen3.6-27B at TP4 (12 x 128 x 128).
- **A canary that must fail**: the shape of the bug this check found, one unsigned 32-bit vector
  comparison (``bits > 0x7F800000`` on ``uint32``), which bishengir rejects on A2/A3.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

RELEASE = ("vllm-ascend", "0.30.0rc2")
ROW = 12 * 128 * 128


@dataclass(frozen=True)
class CalibrationKernel:
    """One calibration compile.

    Attributes:
        name: ``file:function`` (release kernels) or ``canary:...``.
        path: the release file, relative to the release root (None for the canary).
        function: the kernel's name in that file.
        signature, constexprs: as ``triton.compile`` takes them.
        must_compile: True for shipping kernels (must reach the final HIVM IR), False for the canary.
    """

    name: str
    path: str | None
    function: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    must_compile: bool = True


def _sig(pointers: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    return {**pointers, **{name: "constexpr" for name in constexprs}}


_STATE_INDEX = "vllm_ascend/ops/triton/mamba/state_index.py"
SHIPPING: tuple[CalibrationKernel, ...] = (
    CalibrationKernel("batch_memcpy.py:batch_memcpy_kernel", "vllm_ascend/ops/triton/batch_memcpy.py",
                      "batch_memcpy_kernel", _sig({"src_ptrs": "*i64", "dst_ptrs": "*i64", "sizes": "*i64"},
                                                  {"BLOCK_SIZE": 8192}), {"BLOCK_SIZE": 8192}),
    CalibrationKernel("fla/utils.py:_clear_ssm_states_kernel", "vllm_ascend/ops/triton/fla/utils.py",
                      "_clear_ssm_states_kernel",
                      _sig({"states_ptr": "*bf16", "has_initial_state_ptr": "*i1", "inner_size": "i32",
                            "row_stride": "i32"}, {"BLOCK_SIZE": 4096}), {"BLOCK_SIZE": 4096}),
    CalibrationKernel("mamba/state_index.py:_gather_ssm_states_kernel", _STATE_INDEX, "_gather_ssm_states_kernel",
                      _sig({"state_ptr": "*bf16", "indices_ptr": "*i32", "has_initial_state_ptr": "*i1",
                            "output_ptr": "*bf16", "stride_state_batch": "i64", "stride_indices": "i32",
                            "stride_has_initial_state": "i32"}, {"row_size": ROW, "BLOCK_SIZE": 1024}),
                      {"row_size": ROW, "BLOCK_SIZE": 1024}),
    CalibrationKernel("mamba/state_index.py:_scatter_ssm_states_kernel", _STATE_INDEX, "_scatter_ssm_states_kernel",
                      _sig({"state_ptr": "*bf16", "indices_ptr": "*i32", "source_ptr": "*bf16",
                            "stride_state_batch": "i64", "stride_indices": "i32", "stride_source_batch": "i64"},
                           {"row_size": ROW, "BLOCK_SIZE": 1024}), {"row_size": ROW, "BLOCK_SIZE": 1024}),
)


@triton.jit
def unsigned_compare_canary(source_ptr, target_ptr, BLOCK: tl.constexpr):
    """One uint32 vector comparison: what the folded cast did before it was made signed."""
    offsets = tl.arange(0, BLOCK)
    bits = tl.load(source_ptr + offsets).to(tl.uint32, bitcast=True)
    tl.store(target_ptr + offsets, tl.where(bits > 0x7F800000, 1, 0).to(tl.int32))


CANARY = CalibrationKernel("canary:unsigned_compare", None, "unsigned_compare_canary",
                           _sig({"source_ptr": "*fp32", "target_ptr": "*i32"}, {"BLOCK": 1024}), {"BLOCK": 1024},
                           must_compile=False)


def load_release_kernel(root: pathlib.Path, relative: str, function: str) -> Any:
    """Import one released file by path (:func:`kda_patches.releases.load.load_released_module`) and return
    its ``function`` (a JIT function).

    Raises:
        FileNotFoundError: the release cache lacks the file.
    """
    from kda_patches.releases.load import load_released_module

    return getattr(load_released_module(root, relative), function)


def calibration_kernels(root: pathlib.Path) -> list[tuple[CalibrationKernel, Any]]:
    """Return ``(declaration, JIT function)`` for every shipping kernel and the canary."""
    found = [(kernel, load_release_kernel(root, kernel.path, kernel.function)) for kernel in SHIPPING]
    return [*found, (CANARY, unsigned_compare_canary)]


def release_root() -> pathlib.Path:
    """Return the cached release folder (fetched on first use)."""
    from kda_patches.releases.fetch import release_dir

    return pathlib.Path(release_dir(*RELEASE))
