"""Cross-compile fused scatter variants for an SM90 GPU on this machine and report the loads each issues after its
first early exit (run without ``TRITON_INTERPRET``: the JIT functions must be compilable).

argv[1]: ``declared`` (the SM90 target as declared) or ``unpinned`` (it with ``pinned_scatter_load`` off);
argv[2]: the warps (``default`` for the plan's own). Prints one JSON line: ``"CACHE <- FINAL[ bulk] warps W"`` ->
the loads after the exit. argv[1] ``gathers`` reports the gathers instead: ``"CACHE warps W block B"`` (B: the
tile in bytes) -> their whole memory order (:func:`~kda_patches.state_copy.sass.memory_order`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator

import torch

from kda_patches.state_copy import casts, sass
from kda_patches.state_copy.device import CUDA_PDL_TARGET, TargetFacts
from kda_patches.state_copy.plan import FusedStatePlan

QWEN_TP4_STATE = (12, 128, 128)


def compiled_int32_variants(target: TargetFacts, warps: int | None,
                            op: str) -> Iterator[tuple[torch.dtype, dict, list[str]]]:
    """Yield ``(cache dtype, variant spec, memory order)`` of every INT32 ``op`` (gather or scatter) variant the plan
    compiles with PDL for FP32 and BF16 caches (FP32 and BF16 finals) on ``target``, cross-compiled for SM90."""
    for cache_dtype in (torch.float32, torch.bfloat16):
        state = torch.empty((8, *QWEN_TP4_STATE), dtype=cache_dtype, device="meta")
        policies = {final: casts.CastPolicy(final, cache_dtype, casts.NAN_QUIET)
                    for final in (torch.float32, torch.bfloat16)}
        for spec in FusedStatePlan.variant_specs(state, 256, target, policies, num_warps=warps, pdl=True):
            if f"/{op}/int32" in spec["name"]:
                yield cache_dtype, spec, sass.memory_order(sass.cross_compile(spec).asm["cubin"])


def main() -> None:
    warps = None if sys.argv[2] == "default" else int(sys.argv[2])
    found = {}
    if sys.argv[1] == "gathers":
        for cache_dtype, spec, order in compiled_int32_variants(CUDA_PDL_TARGET, warps, "gather"):
            tile = spec["constexprs"]["BLOCK"] * cache_dtype.itemsize
            found[f"{casts.dtype_name(cache_dtype)} warps {spec['num_warps']} block {tile}"] = order
    else:
        target = CUDA_PDL_TARGET if sys.argv[1] == "declared" else dataclasses.replace(CUDA_PDL_TARGET,
                                                                                       pinned_scatter_load=False)
        for cache_dtype, spec, order in compiled_int32_variants(target, warps, "scatter"):
            final = casts.dtype_name(spec["final"]) + (" bulk" if spec["name"].endswith("/bulk") else "")
            found[f"{casts.dtype_name(cache_dtype)} <- {final} warps {spec['num_warps']}"] = \
                sass.loads_after_early_exit(order)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
