"""Device facts and capability routing: which plan (fused or fallback) a cache gets.

The one module that knows about device kinds:

- ``cuda``: compiled Triton (mainline); the fused plan takes FP32/BF16 caches.
- ``npu``: compiled triton-ascend; the fused plan only on the Ascend 950 (A5) class, the masked
  byte-copy fallback elsewhere (A2/A3/310P), as seed 000 prescribes.
- ``cpu-interpreter``: CPU tensors under ``TRITON_INTERPRET=1`` (tests); routes like CUDA.

Other dtypes (e.g. FP16) take the fallback plan everywhere. Layouts that neither plan takes (non-dense
inner ``[H, V, K]``, overlapping pages) are refused by :mod:`~kda_patches.state_copy.layout`.
Neither plan is a native custom op, so ``KDA_PATCHES_FORCE_TRITON=1`` changes no choice here; the
route records that no native op was considered.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from kda_patches.state_copy.errors import LayoutError, refuse

PLAN_FUSED = "fused"
PLAN_FALLBACK = "fallback"
FUSED_DTYPES = (torch.float32, torch.bfloat16)
ASCEND_A5_RUNTIME_SOC = 260  # torch_npu.npu.get_soc_version() of the 950 class (vllm-ascend's rule)


class Route:
    """A routing decision.

    Attributes:
        kind: ``"fused"`` or ``"fallback"``.
        device_kind: ``"cuda"``, ``"npu"`` or ``"cpu-interpreter"``.
        reason: why this plan kind was chosen (recorded in the ledger).
        native: always False: no native custom op is ever selected by this overlay.
    """

    __slots__ = ("device_kind", "kind", "native", "reason")

    def __init__(self, kind: str, device_kind: str, reason: str) -> None:
        self.kind = kind
        self.device_kind = device_kind
        self.reason = reason
        self.native = False

    def as_dict(self) -> dict[str, Any]:
        """Return the decision as a JSON-serialisable dict."""
        return {"kind": self.kind, "device_kind": self.device_kind, "reason": self.reason, "native": self.native}


def interpreter_active() -> bool:
    """Return True when the state-copy kernels were defined under ``TRITON_INTERPRET=1``."""
    from triton.runtime.interpreter import InterpretedFunction

    from kda_patches.state_copy.kernels import copy_rows_kernel

    return isinstance(copy_rows_kernel, InterpretedFunction)


def device_kind(device: torch.device) -> str:
    """Classify a device: ``cuda``, ``npu``, ``cpu-interpreter``, or ``cpu``/other (unsupported)."""
    if device.type == "cpu":
        return "cpu-interpreter" if interpreter_active() else "cpu"
    return device.type


def is_ascend_a5(soc: int | str | None) -> bool:
    """Return whether an Ascend SoC is of the 950 (A5) class.

    Args:
        soc: the runtime SoC version (``torch_npu.npu.get_soc_version()``, an int; 260 is A5) or a
            build-time SOC name (``"Ascend950PR_xxxx"``; any name containing ``ascend950``).
    Returns:
        True for the 950/A5 class, False for anything else (including None).
    """
    if isinstance(soc, bool) or soc is None:
        return False
    if isinstance(soc, int):
        return soc == ASCEND_A5_RUNTIME_SOC
    return "ascend950" in str(soc).strip().lower()


def probe_ascend_soc() -> int | str | None:
    """Ask torch_npu (already imported by the serving stack) for the runtime SoC version.

    Returns:
        The SoC version, or None when torch_npu is not loaded in this process.
    """
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        return None
    return torch_npu.npu.get_soc_version()


def route_plan(device: torch.device, dtype: torch.dtype, soc: int | str | None = None,
               layer: str | None = None) -> Route:
    """Choose the plan kind for a cache on ``device`` with ``dtype``.

    Args:
        device: the cache's device.
        dtype: the cache's dtype.
        soc: Ascend SoC version for NPU caches (probed when None); ignored elsewhere.
        layer: layer name for error messages.
    Returns:
        The :class:`Route`.
    Raises:
        LayoutError: the device cannot run Triton kernels (e.g. CPU without ``TRITON_INTERPRET=1``).
    """
    kind = device_kind(device)
    if kind not in ("cuda", "npu", "cpu-interpreter"):
        hint = " (set TRITON_INTERPRET=1 before kda_patches.state_copy is imported)" if kind == "cpu" else ""
        refuse("device", f"no Triton backend for a cache on {device}{hint}", layer, LayoutError)
    if dtype not in FUSED_DTYPES:
        return Route(PLAN_FALLBACK, kind, f"dtype {dtype} is not fused (FP32/BF16 only): masked byte copy")
    if kind == "npu":
        soc = probe_ascend_soc() if soc is None else soc
        if not is_ascend_a5(soc):
            return Route(PLAN_FALLBACK, kind, f"Ascend SoC {soc!r} is not of the 950/A5 class: masked byte copy")
        return Route(PLAN_FUSED, kind, f"Ascend 950/A5 SoC {soc!r}, {dtype}, dense inner layout")
    return Route(PLAN_FUSED, kind, f"{kind}, {dtype}, dense inner layout")


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]
