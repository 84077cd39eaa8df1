"""Where the fused plan's compiled scatters issue their packed load relative to the first early exit (issue 27).

An experiment, not the product. Prepares real :class:`~kda_patches.state_copy.plan.FusedStatePlan` s with PDL on
this GPU (Qwen3.6-27B TP4 state, FP32 and BF16 caches, FP32 and BF16 finals), disassembles every compiled variant's
cubin with the ``cuobjdump`` Triton ships, and prints the memory instructions and exits in order, so one can see
whether ptxas sank the packed row's load below the exit it made of the index-guarded store.

Usage: ``python3 scripts/gpu/sass_order.py`` (CUDA only).
"""

from __future__ import annotations

import pathlib
import subprocess
import tempfile

import torch
import triton

from kda_patches.state_copy.plan import FusedStatePlan

KEEP = ("LDG", "STG", "EXIT", "BAR", "griddep", "ACQBULK", "PREEXIT")


def sass_of(cubin: bytes) -> list[str]:
    """Return the instructions of ``cubin`` that load, store, exit or synchronize, in order."""
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([str(tool), "-sass", handle.name], capture_output=True, text=True, check=True).stdout
    ops = [line.split("*/", 1)[1].split(";")[0].strip() for line in text.splitlines() if "/*0" in line and "*/" in line]
    return [op for op in ops if any(word in op for word in KEEP)]


def main() -> None:
    for cache_dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros((64, 12, 128, 128), dtype=cache_dtype, device="cuda")
        plan = FusedStatePlan.prepare(cache, 256, pdl=True, final_dtypes=(torch.float32, torch.bfloat16))
        for variant in sorted(plan._variants.values(), key=lambda variant: variant.name):
            if "int32" not in variant.name:
                continue
            print(f"{cache_dtype} {variant.name} warps={variant._compiled.metadata.num_warps}: "
                  + " | ".join(sass_of(variant._compiled.asm["cubin"])))


if __name__ == "__main__":
    main()
