"""Per-step cost of attention code calling ``.contiguous()`` on hybrid K/V caches (seed 004 §6).

vLLM 0.13's ``_update_hybrid_attention_mamba_layout`` re-strides each hybrid attention cache from
``(2, num_blocks, ...)`` to a per-block K/V interleave, so ``kv_cache[0]`` / ``kv_cache[1]`` are not
contiguous; vllm-plugin-FL's attention then copies each of them every call (``[i.contiguous() for i in
kv_cache]``). With the contiguous layout the same call is a no-op. This script measures, per decode step of
``--layers`` full-attention layers, the time of those copies against the no-op, and the bytes copied.

Self-contained (torch only; no vLLM). Usage: ``python scripts/gpu/kv_layout_copy_cost.py --out DIR``; writes
``DIR/kv_layout_copy_cost-<time>.json`` (never overwrites) with every raw sample.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from typing import Any

import torch


def build_caches(layers: int, num_blocks: int, block_size: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: str, restrided: bool) -> list[torch.Tensor]:
    """Return one ``(2, num_blocks, block_size, heads, head_dim)`` cache per layer, re-strided or contiguous.

    The re-strided view has strides ``(hidden, 2 * hidden, ...)`` over the same bytes, as vLLM 0.13's hybrid
    layout produces.
    """
    caches = []
    hidden = block_size * heads * head_dim
    for _ in range(layers):
        cache = torch.zeros((2, num_blocks, block_size, heads, head_dim), dtype=dtype, device=device)
        if restrided:
            cache = cache.as_strided(cache.shape, (hidden, 2 * hidden, heads * head_dim, head_dim, 1))
        caches.append(cache)
    return caches


def run_step(caches: list[torch.Tensor]) -> int:
    """One decode step of the attention code: ``[i.contiguous() for i in kv_cache]`` per layer.

    Returns:
        Bytes newly materialized by ``.contiguous()`` this step (0 when every call was a no-op).
    """
    copied = 0
    for cache in caches:
        parts = [cache[0], cache[1]]
        results = [part.contiguous() for part in parts]
        pairs = zip(parts, results, strict=True)
        copied += sum(r.numel() * r.element_size() for p, r in pairs if r.data_ptr() != p.data_ptr())
    return copied


def time_steps(caches: list[torch.Tensor], steps: int, warmup: int, device: str) -> tuple[list[float], int]:
    """Return per-step times in microseconds (CUDA events on a GPU, wall clock otherwise) and bytes per step."""
    copied = 0
    for _ in range(warmup):
        copied = run_step(caches)
    samples = []
    for _ in range(steps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copied = run_step(caches)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            began = time.perf_counter()
            copied = run_step(caches)
            samples.append((time.perf_counter() - began) * 1e6)
    return samples, copied


def main() -> None:
    """Parse arguments, measure both layouts in one process (order alternated per round), write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSON result")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=5188, help="5188 x 128 tokens x 1 head x 256 bf16 = 340 MB")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype = torch.bfloat16
    shape = dict(layers=args.layers, num_blocks=args.num_blocks, block_size=args.block_size, heads=args.heads,
                 head_dim=args.head_dim, dtype=dtype, device=args.device)
    per_part = args.num_blocks * args.block_size * args.heads * args.head_dim * dtype.itemsize
    samples: dict[str, list[float]] = {"restrided": [], "contiguous": []}
    copied: dict[str, int] = {}
    for round_index in range(args.rounds):
        order = ["restrided", "contiguous"] if round_index % 2 == 0 else ["contiguous", "restrided"]
        for name in order:
            caches = build_caches(restrided=name == "restrided", **shape)
            times, copied[name] = time_steps(caches, args.steps, warmup=2, device=args.device)
            samples[name].extend(times)
            del caches
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    with open(__file__, "rb") as handle:
        source_hash = hashlib.sha256(handle.read()).hexdigest()
    result: dict[str, Any] = {
        "what": "per-step .contiguous() on K and V of every full-attention layer (vllm-plugin-FL attention)",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__, "source_sha256": source_hash, "config": {**vars(args), "dtype": str(dtype)},
        "bytes_per_k_or_v_cache": per_part,
        "bytes_copied_per_step": copied,
        "median_step_us": medians,
        "time_avoided_per_step_us": medians["restrided"] - medians["contiguous"],
        "copy_bandwidth_read_plus_write_GBps": (2 * copied["restrided"] / (medians["restrided"] * 1e-6) / 1e9
                                                if medians["restrided"] else None),
        "samples_us": samples,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"kv_layout_copy_cost-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "x") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps({key: value for key, value in result.items() if key != "samples_us"}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
