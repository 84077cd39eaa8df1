"""Where the fused plan's compiled scatters issue their packed load relative to the first early exit (issue 27).

An experiment, not the product. Prepares real :class:`~kda_patches.state_copy.plan.FusedStatePlan` s with PDL on
this GPU (Qwen3.6-27B TP4 state, FP32 and BF16 caches, FP32 and BF16 finals), disassembles every compiled INT32
variant's cubin (:func:`kda_patches.state_copy.sass.memory_order`) and prints its loads, stores, exits and barriers
in order: whether ptxas sank the packed row's load below the exit it made of the index-guarded store. The CPU
test ``tests/state_copy/test_state_copy_sass.py`` reads the same from a cross-compile; this reads what the GPU ran.

Usage: ``python3 scripts/gpu/sass_order.py`` (CUDA only).
"""

from __future__ import annotations

import torch

from kda_patches.state_copy.plan import FusedStatePlan
from kda_patches.state_copy.sass import loads_after_early_exit, memory_order


def main() -> None:
    for cache_dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros((64, 12, 128, 128), dtype=cache_dtype, device="cuda")
        plan = FusedStatePlan.prepare(cache, 256, pdl=True, final_dtypes=(torch.float32, torch.bfloat16))
        for variant in sorted(plan._variants.values(), key=lambda variant: variant.name):
            if "int32" not in variant.name:
                continue
            order = memory_order(variant._compiled.asm["cubin"])
            print(f"{cache_dtype} {variant.name} warps={variant._compiled.metadata.num_warps}: {' | '.join(order)}"
                  f"; loads after the early exit: {loads_after_early_exit(order) or 'none'}")


if __name__ == "__main__":
    main()
