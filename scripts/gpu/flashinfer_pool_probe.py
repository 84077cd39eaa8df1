"""FlashInfer's state-pool GDN prefill against vLLM 0.34's copying FlashInfer branch (issues 50 and 51), on the GPU.

vLLM 0.34's Qwen GDN prefill on SM90 runs FlashInfer (``_forward_flashinfer_prefill``): ``gather_initial_states``
of the cache rows, ``fi_chunk_gated_delta_rule`` with the gathered states widened to FP32, then the seam's
``scatter_states`` of the FP32 final states into the cache (a cast where the cache is 16-bit). FlashInfer 0.7.4
can read and write the cache itself: ``initial_state`` and ``output_state`` the pool, ``state_indices`` the rows it
reads (-1: a zero state), ``output_state_indices`` the rows it writes. Whether that is exact -- the pool's dtype is
then the kernel's state dtype, and a 16-bit pool is rounded inside the kernel -- and whether it is faster decides if
the overlay may route the FlashInfer branch to it or must stand aside there.

Per shape x cache dtype x sequences x tokens two arms run over the same cache of ``ROWS`` rows:

- ``upstream``: vLLM's own ``gather_initial_states`` -> vLLM's ``fi_chunk_gated_delta_rule`` -> ``scatter_states``;
- ``pool``: ``flashinfer.gdn_prefill.chunk_gated_delta_rule`` on the cache as the pool, no copy.

Each arm runs once from the same cache (outputs and every cache byte compared), then ``--repeats`` times timed with
CUDA events around the whole arm (device time) and the host's wall clock. Run on the GPU machine after staging the
0.34 carry with ``--with-flashinfer``: ``python3 scripts/gpu/flashinfer_pool_probe.py --out $OUT/fi``.
Writes ``flashinfer_pool.json`` after every row and prints one ``ROW`` line per row.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import traceback
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_harness  # noqa: E402  (the shared carry, stand-in and cache machinery)

sys.path.remove(str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

SHAPES = gpu_harness.GDN_SHAPES
ROWS = 512
OPS = "vllm.model_executor.layers.mamba.ops"
SEAM = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"


def draw_inputs(shape: tuple[int, int, int, int], sequences: int, tokens: int, torch: Any,
                device: str = "cuda") -> dict[str, Any]:
    """Seeded prefill inputs as vLLM's FlashInfer branch receives them (q, k L2-normalised; g the gate's exp), on
    ``device``; ``cache`` is an FP32 cache of :data:`ROWS` rows, ``rows`` distinct, ``flags`` about 80 % set."""
    heads, key_heads, key_dim, value_dim = shape
    generator = torch.Generator(device=device).manual_seed(sequences * 1000 + tokens)
    total = sequences * tokens

    def normal(*size: int) -> Any:
        return torch.randn(*size, device=device, generator=generator)

    q = torch.nn.functional.normalize(normal(1, total, key_heads, key_dim), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(normal(1, total, key_heads, key_dim), dim=-1).bfloat16()
    v = normal(1, total, heads, value_dim).bfloat16()
    g = torch.exp(-torch.rand(1, total, heads, device=device, generator=generator) * 0.1)
    beta = torch.sigmoid(normal(1, total, heads))
    bounds = torch.arange(0, total + 1, tokens, device=device, dtype=torch.int32)
    rows = torch.randperm(ROWS, device=device, generator=generator)[:sequences].to(torch.int32)
    flags = torch.rand(sequences, device=device, generator=generator) > 0.2
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "bounds": bounds, "rows": rows, "flags": flags,
            "cache": normal(ROWS, heads, value_dim, key_dim)}


def arms_of(modules: dict[str, Any], inputs: dict[str, Any], torch: Any) -> dict[str, Any]:
    """The two arms, each ``run(cache) -> output``: vLLM's copying branch and FlashInfer's pool call."""
    q, k, v, g, beta = (inputs[name] for name in ("q", "k", "v", "g", "beta"))
    bounds, rows, flags = inputs["bounds"], inputs["rows"], inputs["flags"]
    read_rows = torch.where(flags, rows, torch.full_like(rows, -1))

    def upstream(cache: Any) -> Any:
        initial = modules["gather"].gather_initial_states(cache, rows, flags)
        output, final = modules["seam"].fi_chunk_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, initial_state=initial, output_final_state=True, cu_seqlens=bounds,
            use_qk_l2norm_in_kernel=False)
        modules["scatter"].scatter_states(cache, final, rows)
        return output

    def pool(cache: Any) -> Any:
        output, _ = modules["flashinfer"].chunk_gated_delta_rule(
            q=q.squeeze(0), k=k.squeeze(0), v=v.squeeze(0), g=g.squeeze(0), beta=beta.squeeze(0),
            initial_state=cache, output_state=cache, output_final_state=True, cu_seqlens=bounds,
            state_indices=read_rows, output_state_indices=rows, use_qk_l2norm_in_kernel=False, backend="flashinfer")
        return output.unsqueeze(0)

    return {"upstream": upstream, "pool": pool}


def bits(tensor: Any, torch: Any) -> Any:
    """The tensor's bit patterns (NaN compares equal to itself)."""
    return tensor.contiguous().view(torch.int32 if tensor.element_size() == 4 else torch.int16)


def compare_arms(arms: dict[str, Any], cache0: Any, rows: Any, torch: Any) -> dict[str, Any]:
    """Run each arm once on its own copy of ``cache0`` and compare them bit for bit.

    Returns:
        ``{"arms": {name: {"error": ...}} for an arm that raised}``, and where both ran: ``outputs_equal``,
        ``cache_equal`` (every byte of the cache), ``other_rows_untouched`` (the pool arm left every row but
        ``rows`` as it was), and where the caches differ ``cache_rows_differing`` (of ``rows``) and
        ``cache_items_differing``.
    """
    row: dict[str, Any] = {"arms": {}}
    results = {}
    for name, run in arms.items():
        cache = cache0.clone()
        try:
            output = run(cache)
            if cache.is_cuda:
                torch.cuda.synchronize()
            results[name] = (bits(output, torch), bits(cache, torch))
        except Exception as error:  # a refused call is this row's finding, not the probe's end
            row["arms"][name] = {"error": f"{type(error).__name__}: {error}"[:600]}
    if len(results) == 2:
        row["outputs_equal"] = bool(torch.equal(results["upstream"][0], results["pool"][0]))
        row["cache_equal"] = bool(torch.equal(results["upstream"][1], results["pool"][1]))
        untouched = torch.ones(cache0.shape[0], dtype=torch.bool, device=cache0.device)
        untouched[rows.long()] = False
        row["other_rows_untouched"] = bool(torch.equal(results["pool"][1][untouched], bits(cache0, torch)[untouched]))
        if not row["cache_equal"]:
            written = rows.long()
            row["cache_rows_differing"] = int((results["upstream"][1][written] != results["pool"][1][written])
                                              .flatten(1).any(1).sum())
            row["cache_items_differing"] = int((results["upstream"][1] != results["pool"][1]).sum())
    return row


def run_row(modules: dict[str, Any], shape: tuple[int, int, int, int], dtype: Any, sequences: int, tokens: int,
            repeats: int, torch: Any) -> dict[str, Any]:
    """Exactness (:func:`compare_arms`) then timing of both arms for one row."""
    inputs = draw_inputs(shape, sequences, tokens, torch)
    cache0 = inputs["cache"].to(dtype)
    arms = arms_of(modules, inputs, torch)
    row: dict[str, Any] = {"sequences": sequences, "tokens": tokens, "dtype": str(dtype),
                           **compare_arms(arms, cache0, inputs["rows"], torch)}
    for name, run in arms.items():
        if "error" in row["arms"].get(name, {}):
            continue
        cache = cache0.clone()
        for _ in range(3):
            run(cache)
        torch.cuda.synchronize()
        device_us, wall_us = [], []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began = time.perf_counter()
            start.record()
            run(cache)
            end.record()
            wall_us.append((time.perf_counter() - began) * 1e6)
            end.synchronize()
            device_us.append(start.elapsed_time(end) * 1000.0)
        row["arms"][name] = {"device_us": statistics.median(device_us), "host_us": statistics.median(wall_us),
                             "device_samples_us": device_us}
    if all("device_us" in arm for arm in row["arms"].values()) and len(row["arms"]) == 2:
        row["upstream_over_pool"] = row["arms"]["upstream"]["device_us"] / row["arms"]["pool"]["device_us"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu_harness.add_row_grid(parser, tokens=[64, 512], dtypes=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prepared = gpu_harness.open_site_in_process()
    import importlib

    import torch

    report: dict[str, Any] = {"vllm_version": prepared.get("vllm_version"), "device": torch.cuda.get_device_name(),
                              "rows": []}
    try:
        modules = {"gather": importlib.import_module(f"{OPS}.gather_initial_states"),
                   "scatter": importlib.import_module(f"{OPS}.scatter_states"),
                   "seam": importlib.import_module(SEAM),
                   "flashinfer": importlib.import_module("flashinfer.gdn_prefill")}
        report["flashinfer"] = importlib.import_module("flashinfer").__version__
    except Exception as error:
        traceback.print_exc()
        report["error"] = f"{type(error).__name__}: {error}"
        (out / "flashinfer_pool.json").write_text(json.dumps(report, indent=1, default=str))
        return 1
    started = time.perf_counter()
    for shape in args.shapes:
        for dtype in args.dtypes:
            for sequences in args.sequences:
                for tokens in args.tokens:
                    began = time.perf_counter()
                    row = run_row(modules, SHAPES[shape], getattr(torch, dtype), sequences, tokens, args.repeats,
                                  torch)
                    row.update(shape=shape, wall_s=round(time.perf_counter() - began, 1))
                    report["rows"].append(row)
                    arms = row["arms"]
                    timing = "; ".join(f"{name} {arm['device_us']:.1f} us (host {arm['host_us']:.1f})"
                                       if "device_us" in arm else f"{name} {arm['error']}"
                                       for name, arm in arms.items())
                    print(f"ROW {shape} {dtype} S={sequences} L={tokens}: {timing}; upstream/pool "
                          f"{row.get('upstream_over_pool', float('nan')):.3f}; outputs "
                          f"{row.get('outputs_equal')}, cache {row.get('cache_equal')}, other rows untouched "
                          f"{row.get('other_rows_untouched')} ({row['wall_s']} s)", flush=True)
                    (out / "flashinfer_pool.json").write_text(json.dumps(report, indent=1, default=str))
    report["wall_s"] = round(time.perf_counter() - started, 1)
    (out / "flashinfer_pool.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
