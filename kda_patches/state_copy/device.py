"""Device facts and capability routing: which plan (fused or fallback) a cache gets.

The one module that knows about device kinds:

- ``cuda``: compiled Triton (mainline); the fused plan takes FP32/BF16 caches.
- ``npu``: compiled triton-ascend; the fused plan only on the Ascend 950 (A5) class, the masked
  byte-copy fallback elsewhere (A2/A3/310P), as seed 000 prescribes.
- ``cpu-interpreter``: CPU tensors under ``TRITON_INTERPRET=1`` (tests); routes like CUDA.

Each route carries the :class:`TargetFacts` of its compiler target (``cuda``, ``cpu-interpreter``,
``ascend-a2a3``, ``ascend-a5``): which memory hints that compiler keeps, and on Ascend the largest block
each kernel family fits into the chip's unified buffer, so a plan never picks a block its compiler
rejects. The Ascend facts are measured by ``make ascend-check`` (``patches/ASCEND_COMPILE.md``).

Other dtypes (e.g. FP16) take the fallback plan everywhere. Layouts that neither plan takes (non-dense
inner ``[H, V, K]``, overlapping pages) are refused by :mod:`~kda_patches.state_copy.layout`.
Neither plan is a native custom op, so ``KDA_PATCHES_FORCE_TRITON=1`` changes no choice here; the
route records that no native op was considered.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kda_patches.state_copy.errors import LayoutError, refuse

PLAN_FUSED = "fused"
PLAN_FALLBACK = "fallback"
FUSED_DTYPES = (torch.float32, torch.bfloat16)
ASCEND_A5_RUNTIME_SOC = 260  # torch_npu.npu.get_soc_version() of the 950 class (vllm-ascend's rule)


EVICT_FIRST = "evict_first"
# programmatic dependent launch: the kernel may start while the previous one on the stream finishes and waits
# (griddepcontrol.wait) before it reads; NVIDIA SM90+ only
PDL = "pdl"
PDL_MIN_CAPABILITY = (9, 0)
# a plan's ``pdl`` argument that asks for PDL only where the target and the plan kind have it: nothing is recorded
# as dropped elsewhere (``True`` asks for it and records every place that cannot honour it)
PDL_WHERE_AVAILABLE = "auto"


@dataclass(frozen=True)
class BulkScatter:
    """A second compiled launch shape for fused same-dtype scatters of many rows, chosen per call by the row count.

    Attributes:
        min_rows: the scatter of at least this many selected rows launches the bulk variant.
        num_warps: its warps per program (the tile is the plan's).
        evict_first: whether its cache writes carry ``evict_first``.
        cache_dtypes: the cache dtypes (``"float32"`` ...) whose same-dtype scatters get it.
    """

    min_rows: int
    num_warps: int
    evict_first: bool
    cache_dtypes: tuple[str, ...]


@dataclass(frozen=True)
class TargetFacts:
    """What the compiler of one target does with the state-copy kernels.

    Attributes:
        name: ``"cuda"``, ``"cpu-interpreter"``, ``"ascend-a2a3"`` or ``"ascend-a5"``.
        honoured_hints: the memory hints the compiler keeps (others are dropped, so a plan never
            claims them there).
        ub_bytes: the unified buffer one program may use (Ascend; None where there is none).
        block_limits: kernel family -> the largest block, in items, that fits the unified buffer
            with the backend's own buffer options (no overflow retry); families not listed have no
            limit below the plan defaults. Families: ``bytes`` (the byte copy, items are bytes),
            ``fused/SRC->DST`` and ``cast_items/SRC->DST`` (typed kernels; ``SRC == DST`` for the
            fused copies without a cast).
        tile_by_widest_item: a fused variant's tile holds the block's bytes of the widest dtype it reads or
            writes, not of the cache dtype: a scatter of FP32 final states into a 16-bit cache then moves half
            the cache items per program (``scripts/gpu/launch_shape_probe.py``, ``docs/results/launch-shape/``: the
            narrower tile closes most of the cast scatter's gap to vLLM 0.34's kernels at few rows and is no slower
            at many). Set where it was measured (SM90+); elsewhere every variant of a plan shares the cache
            dtype's tile.
        hardware_casts: ``"SRC->DST"`` pairs (e.g. ``"float32->bfloat16"``) whose folded cast a scatter may do with
            the compiler's own round-to-nearest-even conversion (:data:`~kda_patches.state_copy.casts.CAST_HARDWARE`)
            instead of the bit-pattern cast; the plan still proves it equal to torch at prepare and keeps the
            bit-pattern cast where it is not. Declared on SM90+ CUDA (:data:`SM90_HARDWARE_CASTS`).
        widened_scatter_warps: warps per program of a fused scatter whose tile was narrowed by
            ``tile_by_widest_item`` (finals wider than the cache), unless the plan was given ``num_warps``; None
            keeps the plan's warps. Measured on SM90 (``scripts/gpu/launch_shape_probe.py``,
            ``docs/results/launch-shape/``; rule: the warp count that matches vLLM 0.34's kernels at 64-256 rows):
            BF16 <- FP32 scatters with 8 warps match them where 4 warps trail. On a target that honours PDL it
            applies only to plans launched with PDL, as measured: launched plainly, 4 warps lead at 64-256 rows
            (``docs/results/bench-peer/``, ``launch_shape_probe.py --launch plain``) and trail at 1-8 rows, where the
            layer's lead comes from host time (``docs/results/h200-vllm-layers/``).
        pinned_scatter_load: fused scatters read the packed row with a volatile load, so the compiler cannot sink
            it below the early exit it makes of the index-guarded store (``PIN_LOAD`` of
            :func:`~kda_patches.state_copy.kernels.copy_rows_kernel`). Declared on SM90+ CUDA, whose ptxas does that.
        bulk_scatter: the launch shape of many-row same-dtype scatters (:class:`BulkScatter`), unless the plan was
            given ``num_warps``; None: one shape for every row count. Measured on SM90 (H200 and H100,
            ``scripts/gpu/launch_shape_probe.py``, ``docs/results/launch-shape/``; rule: the shape that matches vLLM
            0.34's kernels at 64-256 rows): an FP32 scatter of 64-256 rows with 8 warps, plain stores and the pinned
            load matches them, where 4 warps with ``evict_first`` (the better shape up to 8 rows) trail.
        gather_warps: cache dtype name (``"float32"`` ...) -> warps per program of the fused gathers of plans that
            launch as measured (with PDL on a target that honours it), unless the plan was given ``num_warps``;
            dtypes not listed keep the plan's warps. Measured on SM90 with five captures per implementation
            (``docs/results/launch-shape/``; rule: the warp count at or above upstream's kernels at every row count):
            FP32 gathers with 8 warps (vLLM 0.34's own shape, one 16-byte vector per thread) meet it at 1-256 rows
            where 4 warps trail on the H100 (the H200 read both at parity with one capture each). BF16 gathers keep 4
            warps: ahead of upstream at 8-256 rows with either, 4 warps at most marginally behind 8.
    """

    name: str
    honoured_hints: tuple[str, ...] = ()
    ub_bytes: int | None = None
    block_limits: Mapping[str, int] = field(default_factory=dict)
    tile_by_widest_item: bool = False
    hardware_casts: tuple[str, ...] = ()
    widened_scatter_warps: int | None = None
    pinned_scatter_load: bool = False
    bulk_scatter: BulkScatter | None = None
    gather_warps: Mapping[str, int] = field(default_factory=dict)

    def honours(self, hint: str) -> bool:
        """Return whether the compiler keeps ``hint`` (e.g. :data:`EVICT_FIRST`)."""
        return hint in self.honoured_hints

    def block_limit(self, family: str) -> int | None:
        """Return the largest block (items) of kernel ``family`` that fits, or None (no limit)."""
        return self.block_limits.get(family)


CUDA_TARGET = TargetFacts("cuda", honoured_hints=(EVICT_FIRST,))
# the FP32 -> BF16 conversion SM90 does as cvt.rn.bf16x2.f32: equal to torch's on all 2**32 FP32 patterns
# (`pytest --run-gpu tests/state_copy`, H100) and at 1-2 rows up to 8 % faster than the bit-pattern cast
# (scripts/gpu/launch_shape_probe.py); each plan proves it again at prepare
SM90_HARDWARE_CASTS = ("float32->bfloat16",)
SM90_BULK_SCATTER = BulkScatter(min_rows=64, num_warps=8, evict_first=False, cache_dtypes=("float32",))
CUDA_PDL_TARGET = TargetFacts("cuda", honoured_hints=(EVICT_FIRST, PDL), tile_by_widest_item=True,
                              hardware_casts=SM90_HARDWARE_CASTS, widened_scatter_warps=8,
                              pinned_scatter_load=True, bulk_scatter=SM90_BULK_SCATTER,
                              gather_warps={"float32": 8})  # SM90+
INTERPRETER_TARGET = TargetFacts("cpu-interpreter")  # the interpreter has no caches: hints are no-ops
# Measured with triton-ascend 3.2.0 + bishengir 1.2.0 (`make ascend-check`, probe in patches/ASCEND_COMPILE.md):
# the largest power-of-two block, in items, up to 65536, that reaches the final HIVM IR with the backend's
# own buffer options under every NaN rule (the next size up overflows the unified buffer under at least
# one; the quiet and preserve rules need more buffer than the canonical one); families that fit 65536 items are not
# listed. The check compiles each limit and twice it, so a table that drifts from the compiler fails the suite.
# ub_bytes is the buffer bishengir reports available. Neither class keeps evict_first (see the check).
ASCEND_A2A3_TARGET = TargetFacts("ascend-a2a3", ub_bytes=196608, block_limits={
    "cast_items/float32->bfloat16": 8192, "cast_items/float32->float16": 4096,
    "cast_items/bfloat16->float32": 8192, "cast_items/bfloat16->float16": 4096,
    "cast_items/float16->float32": 8192, "cast_items/float16->bfloat16": 4096,
    "fused/float32->float32": 32768, "fused/bfloat16->float32": 8192, "fused/float16->float32": 8192,
    "fused/float32->bfloat16": 8192, "fused/float16->bfloat16": 4096})
ASCEND_A5_TARGET = TargetFacts("ascend-a5", ub_bytes=253952, block_limits={
    "cast_items/float32->bfloat16": 32768, "cast_items/float32->float16": 32768,
    "cast_items/bfloat16->float32": 32768, "cast_items/float16->float32": 32768,
    "fused/float32->float32": 32768, "fused/bfloat16->float32": 32768, "fused/float16->float32": 32768,
    "fused/float32->bfloat16": 32768})
TARGETS = {facts.name: facts for facts in (CUDA_TARGET, INTERPRETER_TARGET, ASCEND_A2A3_TARGET, ASCEND_A5_TARGET)}


class Route:
    """A routing decision.

    Attributes:
        kind: ``"fused"`` or ``"fallback"``.
        device_kind: ``"cuda"``, ``"npu"`` or ``"cpu-interpreter"``.
        reason: why this plan kind was chosen (recorded in the ledger).
        target: the compiler target's :class:`TargetFacts` (the plan takes its block limits and hints).
        native: always False: no native custom op is ever selected by this overlay.
    """

    __slots__ = ("device_kind", "kind", "native", "reason", "target")

    def __init__(self, kind: str, device_kind: str, reason: str, target: TargetFacts = CUDA_TARGET) -> None:
        self.kind = kind
        self.device_kind = device_kind
        self.reason = reason
        self.target = target
        self.native = False

    def as_dict(self) -> dict[str, Any]:
        """Return the decision as a JSON-serialisable dict."""
        return {"kind": self.kind, "device_kind": self.device_kind, "reason": self.reason,
                "target": self.target.name, "native": self.native}


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


def target_facts(device: torch.device, soc: int | str | None = None) -> TargetFacts:
    """Return the compiler target of a cache on ``device``.

    Args:
        device: the cache's device.
        soc: Ascend SoC version for NPU caches (probed from torch_npu when None); ignored elsewhere.
    Returns:
        :data:`ASCEND_A5_TARGET` or :data:`ASCEND_A2A3_TARGET` on an NPU (every non-950 class compiles
        for the A2/A3 buffer), :data:`INTERPRETER_TARGET` on the CPU, :data:`CUDA_PDL_TARGET` on an SM90+ GPU,
        :data:`CUDA_TARGET` on an older one.
    """
    if device.type == "npu":
        return ASCEND_A5_TARGET if is_ascend_a5(probe_ascend_soc() if soc is None else soc) else ASCEND_A2A3_TARGET
    if device.type == "cpu":
        return INTERPRETER_TARGET
    if not torch.cuda.is_available():  # a CUDA device named where CUDA cannot run: nothing compiles for it here
        return CUDA_TARGET
    index = getattr(device, "index", None)
    capability = torch.cuda.get_device_capability(torch.cuda.current_device() if index is None else index)
    return CUDA_PDL_TARGET if capability >= PDL_MIN_CAPABILITY else CUDA_TARGET


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
    if kind == "npu" and soc is None:
        soc = probe_ascend_soc()
    target = target_facts(device, soc)
    if dtype not in FUSED_DTYPES:
        return Route(PLAN_FALLBACK, kind, f"dtype {dtype} is not fused (FP32/BF16 only): masked byte copy", target)
    if kind == "npu":
        if not is_ascend_a5(soc):
            return Route(PLAN_FALLBACK, kind, f"Ascend SoC {soc!r} is not of the 950/A5 class: masked byte copy",
                         target)
        return Route(PLAN_FUSED, kind, f"Ascend 950/A5 SoC {soc!r}, {dtype}, dense inner layout", target)
    return Route(PLAN_FUSED, kind, f"{kind}, {dtype}, dense inner layout", target)


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]
