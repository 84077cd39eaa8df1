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

import torch

from kda_patches.state_copy import casts, sass
from kda_patches.state_copy.device import CUDA_PDL_TARGET
from kda_patches.state_copy.plan import FusedStatePlan

QWEN_TP4_STATE = (12, 128, 128)


def main() -> None:
    if sys.argv[1] == "gathers":
        print(json.dumps(gather_orders(None if sys.argv[2] == "default" else int(sys.argv[2]))))
        return
    target = CUDA_PDL_TARGET if sys.argv[1] == "declared" else dataclasses.replace(CUDA_PDL_TARGET,
                                                                                   pinned_scatter_load=False)
    warps = None if sys.argv[2] == "default" else int(sys.argv[2])
    found = {}
    for cache_dtype in (torch.float32, torch.bfloat16):
        state = torch.empty((8, *QWEN_TP4_STATE), dtype=cache_dtype, device="meta")
        policies = {final: casts.CastPolicy(final, cache_dtype, casts.NAN_QUIET)
                    for final in (torch.float32, torch.bfloat16)}
        for spec in FusedStatePlan.variant_specs(state, 256, target, policies, num_warps=warps, pdl=True):
            if "/scatter/int32/" not in spec["name"]:
                continue
            order = sass.memory_order(sass.cross_compile(spec).asm["cubin"])
            final = casts.dtype_name(spec["final"]) + (" bulk" if spec["name"].endswith("/bulk") else "")
            key = f"{casts.dtype_name(cache_dtype)} <- {final} warps {spec['num_warps']}"
            found[key] = sass.loads_after_early_exit(order)
    print(json.dumps(found))


def gather_orders(warps: int | None) -> dict[str, list[str]]:
    """Return ``{"CACHE warps W block B": memory order}`` of the SM90 target's INT32 gathers, FP32 and BF16 caches."""
    found = {}
    for cache_dtype in (torch.float32, torch.bfloat16):
        state = torch.empty((8, *QWEN_TP4_STATE), dtype=cache_dtype, device="meta")
        policies = {cache_dtype: casts.CastPolicy(cache_dtype, cache_dtype, casts.NAN_QUIET)}
        for spec in FusedStatePlan.variant_specs(state, 256, CUDA_PDL_TARGET, policies, num_warps=warps, pdl=True):
            if "/gather/int32" in spec["name"]:
                order = sass.memory_order(sass.cross_compile(spec).asm["cubin"])
                tile = spec["constexprs"]["BLOCK"] * cache_dtype.itemsize
                found[f"{casts.dtype_name(cache_dtype)} warps {spec['num_warps']} block {tile}"] = order
    return found


if __name__ == "__main__":
    main()
