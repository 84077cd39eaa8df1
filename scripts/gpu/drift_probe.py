#!/usr/bin/env python3
"""Does the machine itself drift? Fixed GPU work and fixed host work timed again and again, GPU clocks beside.

Run 6 of issue 26 (docs/results/h200-vllm-engine) saw the same engine pass take 5.0-9.1 s and the same captured
decode graphs 1.97-2.97 ms per step minutes apart. This probe removes vLLM and the overlay from the question: each
round replays one CUDA graph of fixed matrix products (device time, on ``--device cuda``) and runs one fixed
pure-Python loop (host time), and :mod:`kda_patches.bench.gpu_clocks` records the GPU's SM clock, power,
temperature and clock-event reasons for every round's window. A steady machine gives flat rounds. Each round
also records the core its host segment ended on; ``--cpus`` pins the probe to cores (run 7: the host segment took
19-42 ms unpinned while the GPU's stayed within 1 %; the spread by core says whether pinning is the cure).

    python3 scripts/gpu/drift_probe.py --out probe.json [--seconds 120] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kda_patches.bench import gpu_clocks
from kda_patches.bench.cpu_pin import check_available, current_cpu, parse_cpus

HOST_LOOP = 300_000  # iterations of the host segment (~10-20 ms of one core)


def device_work(device: str, size: int, products: int) -> Callable[[], None]:
    """Return a callable that runs ``products`` chained BF16 ``size x size`` products and waits for them (a CUDA
    graph replay on CUDA, plain calls elsewhere)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    left = torch.randn(size, size, device=device, dtype=dtype) / size ** 0.5
    right = torch.randn(size, size, device=device, dtype=dtype)

    def chain() -> None:
        value = right
        for _ in range(products):
            value = left @ value
        right.copy_(value)

    if device != "cuda":
        return chain
    torch.cuda.synchronize()
    chain()  # warm cuBLAS before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()

    def replay() -> None:
        graph.replay()
        torch.cuda.synchronize()
    return replay


def host_work() -> int:
    """Fixed pure-Python work: the same instructions every round."""
    total = 0
    for number in range(HOST_LOOP):
        total += number * number % 7
    return total


def spread(values: list[float]) -> dict[str, float]:
    """Return min / median / max and max over min of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "max_over_min": max(values) / min(values)}


def run_probe(seconds: float, device: str, size: int, products: int, clock_path: str) -> dict:
    """Time rounds of :func:`device_work` and :func:`host_work` for ``seconds``; return rounds and spreads."""
    work = device_work(device, size, products)
    sampler, note = gpu_clocks.start_sampler(clock_path)
    rounds = []
    try:
        finish = time.monotonic() + seconds
        while time.monotonic() < finish:
            start = time.time()
            begin = time.perf_counter()
            work()
            device_s = time.perf_counter() - begin
            begin = time.perf_counter()
            host_work()
            host_s = time.perf_counter() - begin
            rounds.append({"start": start, "end": time.time(), "device_ms": device_s * 1e3, "host_ms": host_s * 1e3,
                           "cpu": current_cpu()})
    finally:
        gpu_clocks.stop_sampler(sampler)
    samples, skipped = gpu_clocks.read_samples(clock_path)
    for record in rounds:
        record["gpu"] = gpu_clocks.summarize_window(samples, record["start"], record["end"])
    clocks = [record["gpu"]["sm_mhz_median"] for record in rounds if record["gpu"].get("sm_mhz_median")]
    by_core: dict[int, list[float]] = {}
    for record in rounds:
        by_core.setdefault(record["cpu"], []).append(record["host_ms"])
    return {"device": device, "size": size, "products": products, "seconds": seconds, "rounds": rounds,
            "host_ms_by_core": {str(core): spread(values) | {"rounds": len(values)}
                                for core, values in sorted(by_core.items(), key=lambda item: str(item[0]))},
            "gpu_clocks": {"note": note, "samples": len(samples), "skipped_lines": skipped},
            "spread": {"device_ms": spread([record["device_ms"] for record in rounds]),
                       "host_ms": spread([record["host_ms"] for record in rounds]),
                       **({"sm_mhz": spread(clocks)} if clocks else {})}}


def main(argv: list[str] | None = None) -> int:
    """Run the probe and write its JSON; print the spreads."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--products", type=int, default=64)
    parser.add_argument("--cpus", help="pin the probe to these cores first, e.g. 3 or 2-5")
    args = parser.parse_args(argv)
    if args.cpus:
        cores = parse_cpus(args.cpus)
        check_available(cores)
        os.sched_setaffinity(0, cores)
    with tempfile.TemporaryDirectory() as scratch:
        result = run_probe(args.seconds, args.device, args.size, args.products, os.path.join(scratch, "clocks.csv"))
    result["cpus"] = args.cpus
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{len(result['rounds'])} rounds; GPU clock record: {result['gpu_clocks']['note']}")
    for name, row in result["spread"].items():
        print(f"  {name:<10} min {row['min']:.2f}  median {row['median']:.2f}  max {row['max']:.2f}  "
              f"max/min {row['max_over_min']:.3f}")
    for core, row in result["host_ms_by_core"].items():
        print(f"  host on core {core:<4} {row['rounds']:>5} rounds  median {row['median']:.2f}  min {row['min']:.2f}  "
              f"max {row['max']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
