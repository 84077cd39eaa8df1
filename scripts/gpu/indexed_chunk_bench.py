"""No copy on the GPU (issue 51): the chunk-state step with copies against the indexed twin, exact and timed.

Per shape (heads, key heads, head dims of a served model at its TP) x cache dtype x sequences x tokens per sequence,
three arms run the release's chunk-state step of S prefills over a cache of ``ROWS`` rows:

- ``upstream``: vLLM 0.34's ``gather_initial_states`` -> the release's ``chunk_gated_delta_rule_fwd_h`` (its own
  autotuned config) -> ``scatter_states``;
- ``plan``: the overlay's sealed plan's gather -> the same function -> the plan's scatter;
- ``indexed/<config>``: the indexed twin (:mod:`kda_patches.indexed_chunk`), once per config of the release's
  autotuner: no copy.

Each arm is captured in a CUDA graph and replayed (median of ``--replays`` after warm-up); every indexed config's
final cache is compared bit for bit with the upstream arm's (the same inputs, the same cache before). Run on the GPU
machine after staging a vLLM 0.34 carry (``gpu_harness.py stage``):
``python3 scripts/gpu/indexed_chunk_bench.py --out $OUT/ic``. Writes ``indexed_chunk.json`` and prints one line per row.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_harness  # noqa: E402  (the shared carry, stand-in and cache machinery)

sys.path.remove(str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

SHAPES = gpu_harness.GDN_SHAPES
ROWS = 1024
FLA = "vllm.third_party.flash_linear_attention.ops"
OPS = "vllm.model_executor.layers.mamba.ops"


def graph_time(run: Any, replays: int, torch: Any) -> float:
    """Capture ``run`` in a CUDA graph, replay it; return the median replay time in microseconds."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        run()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(samples)


def run_row(modules: dict[str, Any], derived: Any, shape: tuple[int, int, int, int], dtype: Any, sequences: int,
            tokens: int, replays: int, torch: Any) -> dict[str, Any]:
    from kda_patches.indexed_chunk.launch import indexed_fwd_h
    from kda_patches.state_copy.worker import initialize

    heads, key_heads, key_dim, value_dim = shape
    generator = torch.Generator(device="cuda").manual_seed(sequences * 1000 + tokens)
    total = sequences * tokens
    k = (torch.randn(1, total, key_heads, key_dim, device="cuda", generator=generator) * 0.1).bfloat16()
    w = (torch.randn(1, total, heads, key_dim, device="cuda", generator=generator) * 0.1).bfloat16()
    u = torch.randn(1, total, heads, value_dim, device="cuda", generator=generator).bfloat16()
    g = -torch.rand(1, total, heads, device="cuda", generator=generator).cumsum(1) * 0.01
    bounds = torch.arange(0, total + 1, tokens, device="cuda", dtype=torch.int32)
    chunk_indices = modules["index"].prepare_chunk_indices(bounds, 64)
    chunk_offsets = modules["index"].prepare_chunk_offsets(bounds, 64)
    rows = torch.randperm(ROWS, device="cuda", generator=generator)[:sequences].to(torch.int32)
    flags = torch.rand(sequences, device="cuda", generator=generator) > 0.2
    cache0 = torch.randn(ROWS, heads, value_dim, key_dim, device="cuda", generator=generator).to(dtype)
    call = {"k": k, "w": w, "u": u, "g": g, "cu_seqlens": bounds, "chunk_indices": chunk_indices,
            "chunk_offsets": chunk_offsets}
    host = modules["chunk_delta_h"].chunk_gated_delta_rule_fwd_h
    gather, scatter = modules["gather"].gather_initial_states, modules["scatter"].scatter_states
    caches = {name: cache0.clone() for name in ("upstream", "plan", *(f"indexed/{i}" for i in
                                                                     range(len(derived.configs))))}
    plan = initialize({"layer": caches["plan"]}, sequences)["layer"]

    def upstream() -> None:
        _, _, final = host(initial_state=gather(caches["upstream"], rows, flags), output_final_state=True, **call)
        scatter(caches["upstream"], final, rows)

    def planned() -> None:
        _, _, final = host(initial_state=plan.gather(caches["plan"], rows, flags), output_final_state=True, **call)
        plan.scatter(caches["plan"], final, rows)

    arms = {"upstream": upstream, "plan": planned}
    for index, config in enumerate(derived.configs):
        arms[f"indexed/{index}"] = (lambda c=caches[f"indexed/{index}"], cfg=config:
                                    indexed_fwd_h(derived, c, rows, flags, config=cfg, **call))
    row: dict[str, Any] = {"sequences": sequences, "tokens": tokens, "dtype": str(dtype), "arms": {}}
    for name, run in arms.items():  # exactness: one run each from the same cache
        caches[name].copy_(cache0)
        run()
    torch.cuda.synchronize()
    # compared before any arm is timed: every timed replay advances its own cache (gather, chunk, scatter again)
    reference = caches["upstream"].view(torch.int32 if dtype == torch.float32 else torch.int16).clone()
    for name in arms:
        row["arms"][name] = {"equal_to_upstream": bool(torch.equal(caches[name].view(reference.dtype), reference))}
    for name, run in arms.items():
        row["arms"][name]["us"] = graph_time(run, replays, torch)
    indexed = {name: arm["us"] for name, arm in row["arms"].items() if name.startswith("indexed/")}
    best = min(indexed, key=indexed.get)
    row["best_indexed"] = {"arm": best, "config": derived.configs[int(best.split("/")[1])],
                           "upstream_over_indexed": row["arms"]["upstream"]["us"] / indexed[best],
                           "plan_over_indexed": row["arms"]["plan"]["us"] / indexed[best]}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu_harness.add_row_grid(parser, tokens=[16, 64], dtypes=["float32", "bfloat16"])
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prepared = gpu_harness.open_site_in_process()
    import importlib

    import torch

    from kda_patches.indexed_chunk.derive import KernelDeclaration, derive_indexed_kernel

    modules = {stem: importlib.import_module(f"{FLA}.{stem}") for stem in ("chunk_delta_h", "index")}
    modules["gather"] = importlib.import_module(f"{OPS}.gather_initial_states")
    modules["scatter"] = importlib.import_module(f"{OPS}.scatter_states")
    derived = derive_indexed_kernel(modules["chunk_delta_h"], KernelDeclaration(
        module=f"{FLA}.chunk_delta_h", kernel="chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
        host="chunk_gated_delta_rule_fwd_h"))
    report: dict[str, Any] = {"vllm_version": prepared.get("vllm_version"), "device": torch.cuda.get_device_name(),
                              "configs": derived.configs, "rows": []}
    started = time.perf_counter()
    for shape in args.shapes:
        for dtype in args.dtypes:
            for sequences in args.sequences:
                for tokens in args.tokens:
                    row = run_row(modules, derived, SHAPES[shape], getattr(torch, dtype), sequences, tokens,
                                  args.replays, torch)
                    row["shape"] = shape
                    report["rows"].append(row)
                    best = row["best_indexed"]
                    exact = all(arm["equal_to_upstream"] for arm in row["arms"].values())
                    print(f"ROW {shape} {dtype} S={sequences} L={tokens}: upstream "
                          f"{row['arms']['upstream']['us']:.1f} us, plan {row['arms']['plan']['us']:.1f} us, indexed "
                          f"{row['arms'][best['arm']]['us']:.1f} us ({best['config']}); upstream/indexed "
                          f"{best['upstream_over_indexed']:.3f}, plan/indexed {best['plan_over_indexed']:.3f}; "
                          f"{'all arms bit-equal' if exact else 'NOT EQUAL'}", flush=True)
                    (out / "indexed_chunk.json").write_text(json.dumps(report, indent=1, default=str))
    report["wall_s"] = round(time.perf_counter() - started, 1)
    (out / "indexed_chunk.json").write_text(json.dumps(report, indent=1, default=str))
    return 0 if all(arm["equal_to_upstream"] for row in report["rows"] for arm in row["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
