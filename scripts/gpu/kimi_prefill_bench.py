"""kimi_prefill on a GPU: A/B exactness at realistic shapes, prefill-level benchmark, wrapper host overhead.

Run by the GPU check as ``python scripts/gpu/kimi_prefill_bench.py --out DIR`` (needs torch with CUDA, triton,
fla-core, einops, wrapt; no vLLM). Writes ``DIR/kimi_prefill_bench.json`` (refuses to overwrite it) after
every phase, so a phase that fails or runs out of time still leaves the others' results:

1. ``exactness``: the reference layer (vllm-ascend ``_run_prefill`` shape, fla-core's Triton ``chunk_kda``)
   unpatched vs patched through the registry, 12 heads x head dim 128, page-gapped FP32 and BF16 caches,
   INT32 and INT64 indices, batches of 1..64 sequences with lengths 1..1024 and mixed flags: outputs and
   every byte of the cache buffers must be equal.
2. ``benchmark``: full ``_run_prefill`` time baseline vs patched for 1, 8, 64, 256 sequences of 512 tokens,
   and the state-copy part alone (fork: ``cache[idx]`` + ``clear_ssm_states`` + ``cache[idx] = final``;
   patched: the plan's flagged gather + scatter), so the share of prefill time spent copying state is
   reported before and after. Seed 000 method: same inputs and allocation boundaries for every
   implementation, one process, order shuffled each round; eager CUDA-event time, synchronized wall time
   and host enqueue time reported separately, all raw samples kept.
3. ``overhead``: host time the wrapper adds per ``_run_prefill`` call (patched fork body vs the same body
   calling the plan directly, both with a plan that copies nothing).

``--quick`` shrinks every shape (for a CPU smoke run under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
KIMI_TESTS = os.path.join(ROOT, "tests", "kimi")
sys.path[:0] = [ROOT, KIMI_TESTS]
OUTPUT_NAME = "kimi_prefill_bench.json"
_DEADLINE = [float("inf")]  # perf_counter() after which no further case starts (``--budget-s``)


def out_of_time(record: dict[str, Any], what: str) -> bool:
    """Return True (and note ``what`` as skipped) once the time budget is spent."""
    if time.perf_counter() < _DEADLINE[0]:
        return False
    record.setdefault("skipped_for_time", []).append(what)
    print(f"skipped for time: {what}", flush=True)
    return True
SOURCES = ("kda_patches/patches/kimi_prefill.py", "kda_patches/routing/alias.py", "kda_patches/routing/calls.py",
           "kda_patches/routing/proof.py", "kda_patches/routing/startup.py",
           "tests/kimi/kimi_ascend_layer.py", "tests/kimi/kimi_upstream_layer.py", "tests/kimi/kimi_kda_ops.py",
           "scripts/gpu/kimi_prefill_bench.py", "kda_patches/bench/autotune.py")


def source_hash() -> str:
    """SHA-256 over the patch, reference-layer and benchmark sources."""
    digest = hashlib.sha256()
    for relative in SOURCES:
        with open(os.path.join(ROOT, relative), "rb") as handle:
            digest.update(handle.read())
    return digest.hexdigest()


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], Any], device: Any) -> dict[str, float]:
    """Time one call: host enqueue, synchronized wall and (CUDA) event time, in microseconds."""
    import torch

    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        fn()
        end.record()
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        finished = time.perf_counter()
        event = start.elapsed_time(end) * 1e3
    else:
        began = time.perf_counter()
        fn()
        enqueued = finished = time.perf_counter()
        event = (finished - began) * 1e6
    return {"enqueue_us": (enqueued - began) * 1e6, "wall_us": (finished - began) * 1e6, "event_us": event}


def load_modules(patched: bool, name: str = "kimi_prefill_bench") -> dict[str, Any]:
    """Fresh reference modules; patched through ``register_patch`` + post-import hooks when asked."""
    import kimi_workload

    return kimi_workload.load_reference_modules(kimi_workload.reference_patch(name) if patched else None)


def new_world(modules: dict[str, Any], shape: dict[str, Any], cache_dtype: Any, device: Any) -> Any:
    """A started world (runner + one layer, page-gapped cache) for ``shape`` on ``device``."""
    import kimi_workload

    spec = modules["kimi_runner"].StateCacheSpec(shape["rows"], cache_dtype, gap=shape["gap"], offset=16)
    world = kimi_workload.build_world(modules, cache_dtype=cache_dtype, num_rows=shape["rows"], heads=shape["heads"],
                                      head_dim=shape["head_dim"], max_num_seqs=shape["max_seqs"], device=device,
                                      specs={0: spec})
    kimi_workload.start_world(world)
    return world


def check_exactness(shape: dict[str, Any], device: Any, record: dict[str, Any]) -> None:
    """Baseline vs patched on every (cache dtype, index dtype): outputs and raw cache buffers bit-equal."""
    import torch

    results = record.setdefault("cases", [])
    for cache_dtype, index_dtype in ((torch.float32, torch.int32), (torch.bfloat16, torch.int64),
                                     (torch.float32, torch.int64), (torch.bfloat16, torch.int32)):
        if not out_of_time(record, f"{cache_dtype}/{index_dtype}"):
            results.append(compare_sides(shape, device, cache_dtype, index_dtype))
    record["all_equal"] = bool(results) and all(all(c["outputs_equal"]) and c["cache_bytes_equal"] for c in results)


def compare_sides(shape: dict[str, Any], device: Any, cache_dtype: Any, index_dtype: Any) -> dict[str, Any]:
    """Run the exactness batches unpatched then patched (same inputs); return the comparison record."""
    import kimi_workload
    import torch

    started = time.perf_counter()
    batches = kimi_workload.make_batches(7, shape["rows"], shape["heads"], shape["head_dim"], index_dtype,
                                         torch.bfloat16, device, shape["exact_batches"])
    sides = {}
    for patched in (False, True):
        modules = load_modules(patched)
        world = new_world(modules, shape, cache_dtype, device)
        layer = next(iter(world.layers.values()))
        before = kimi_workload.prefill_counters()
        outputs = [kimi_workload.run_batch(world, layer, batch) for batch in batches]
        after = kimi_workload.prefill_counters()
        synchronize(device)
        grown = {key: after.get(key, 0) - before.get(key, 0) for key in after}
        if patched and grown.get("calls_routed", 0) != len(batches):
            raise RuntimeError(f"the patched side routed {grown}, expected {len(batches)} calls")
        sides[patched] = (outputs, world.runner.raw_caches[layer.prefix].clone(), grown,
                          getattr(getattr(layer, "_kda_state_copy_plan", None), "kind", None))
    (base_outputs, base_cache, _, _), (outputs, cache, grown, kind) = sides[False], sides[True]
    outputs_equal = [bool(torch.equal(kimi_workload.raw_bits(a), kimi_workload.raw_bits(b)))
                     for a, b in zip(base_outputs, outputs, strict=True)]
    same_cache = bool(torch.equal(kimi_workload.raw_bits(base_cache), kimi_workload.raw_bits(cache)))
    result = {"cache_dtype": str(cache_dtype).replace("torch.", ""),
              "index_dtype": str(index_dtype).replace("torch.", ""),
              "batches": [[len(b.cu_seqlens) - 1, b.num_tokens] for b in batches], "outputs_equal": outputs_equal,
              "cache_bytes_equal": same_cache,
              "plan_kind": kind, "patched_counters": grown, "seconds": round(time.perf_counter() - started, 2)}
    print(f"exactness {result['cache_dtype']}/{result['index_dtype']}: outputs {all(outputs_equal)} cache "
          f"{result['cache_bytes_equal']} counters {grown} ({result['seconds']} s)", flush=True)
    return result


def native_copy(state: Any, indices: Any, flags: Any, final: Any, clear: Callable[..., None]) -> None:
    """The fork's copy code: ``state[indices]`` + clear, and ``state[indices] = final.to(state.dtype)``."""
    packed = state[indices].contiguous()
    clear(packed, flags)
    state[indices] = final.to(state.dtype)


def plan_copy(plan: Any, state: Any, indices: Any, flags: Any, final: Any) -> None:
    """The patched copy: the plan's flagged gather and its scatter."""
    plan.gather(state, indices, flags)
    plan.scatter(state, final.to(state.dtype), indices)


def summarize(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(sample[key] for sample in samples), 2) for key in samples[0]}


def run_benchmark(shape: dict[str, Any], device: Any, rounds: int, record: dict[str, Any]) -> None:
    """Prefill-level timing, baseline vs patched, and the state-copy part of each, per sequence count."""
    import kimi_kda_ops
    import kimi_workload
    import torch

    rng = random.Random(2024)
    for cache_dtype in shape["bench_dtypes"]:
        base_modules, patched_modules = load_modules(False), load_modules(True)
        base_world = new_world(base_modules, shape, cache_dtype, device)
        patched_world = new_world(patched_modules, shape, cache_dtype, device)
        base_layer = next(iter(base_world.layers.values()))
        patched_layer = next(iter(patched_world.layers.values()))
        plan = patched_layer._kda_state_copy_plan
        base_state, patched_state = base_layer.kv_cache[1], patched_layer.kv_cache[1]
        for count in shape["bench_counts"]:
            if out_of_time(record, f"{cache_dtype} S={count}"):
                continue
            batch = kimi_workload.make_batches(count, shape["rows"], shape["heads"], shape["head_dim"], torch.int32,
                                               torch.bfloat16, device,
                                               ((count, shape["bench_len"], shape["bench_len"]),))[0]
            final = torch.randn(count, shape["heads"], shape["head_dim"], shape["head_dim"], device=device)
            indices, flags = batch.state_indices, batch.has_initial_state
            impls = {
                "baseline_prefill": functools.partial(kimi_workload.run_batch, base_world, base_layer, batch),
                "patched_prefill": functools.partial(kimi_workload.run_batch, patched_world, patched_layer, batch),
                "baseline_copy": functools.partial(native_copy, base_state, indices, flags, final,
                                                   kimi_kda_ops.clear_ssm_states),
                "patched_copy": functools.partial(plan_copy, plan, patched_state, indices, flags, final),
            }
            for fn in impls.values():
                for _ in range(2):
                    fn()
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in impls}
            for _ in range(rounds):
                order = list(impls)
                rng.shuffle(order)
                for name in order:
                    samples[name].append(time_call(impls[name], device))
            medians = {name: summarize(values) for name, values in samples.items()}
            entry = {"cache_dtype": str(cache_dtype).replace("torch.", ""), "sequences": count,
                     "tokens_per_sequence": shape["bench_len"], "plan_kind": plan.kind, "medians": medians,
                     "copy_share_before": round(medians["baseline_copy"]["event_us"]
                                                / medians["baseline_prefill"]["event_us"], 4),
                     "copy_share_after": round(medians["patched_copy"]["event_us"]
                                               / medians["patched_prefill"]["event_us"], 4),
                     "prefill_speedup": round(medians["baseline_prefill"]["event_us"]
                                              / medians["patched_prefill"]["event_us"], 4),
                     "samples": samples}
            record.setdefault("cases", []).append(entry)
            print(f"bench {entry['cache_dtype']} S={count}: prefill {medians['baseline_prefill']['event_us']:.1f} -> "
                  f"{medians['patched_prefill']['event_us']:.1f} us, copy {medians['baseline_copy']['event_us']:.1f}"
                  f" -> {medians['patched_copy']['event_us']:.1f} us, share {entry['copy_share_before']:.3%} -> "
                  f"{entry['copy_share_after']:.3%}", flush=True)
        del base_world, patched_world, base_state, patched_state, plan
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure_overhead(device: Any, calls: int, repeats: int, record: dict[str, Any]) -> None:
    """Host microseconds the wrapper adds per ``_run_prefill`` call (patched body vs direct plan calls)."""
    import kimi_workload
    import torch

    from kda_patches.patches import kimi_prefill
    from kda_patches.registry import register_patch, revert_patch

    sys.modules.pop("kimi_overhead_layer", None)
    patch = kimi_prefill.build_patch("kimi_prefill_overhead", ascend=("kimi_overhead_layer",
                                                                      "OverheadKimiK3DeltaAttention"))
    register_patch(patch)
    import kimi_overhead_layer as layers

    # Small tensors: the null plan never touches them, and the unpatched body's real indexing stays cheap.
    state = torch.zeros(16, 2, 8, 8, device=device)
    indices = torch.tensor([1, 5, 9, 12], dtype=torch.int32, device=device)
    flags = torch.tensor([True, False, True, True], device=device)
    packed = torch.zeros(4, 2, 8, 8, device=device)
    q = torch.zeros(1, 8, 2, 8, device=device)
    patched, direct = layers.OverheadKimiK3DeltaAttention(), layers.DirectKimiK3DeltaAttention()
    patched._kda_state_copy_plan = direct._kda_state_copy_plan = layers.NullPlan(packed)
    args = (q, q, q, q, q, state, indices, flags, None)

    def per_call(fn: Callable[..., Any]) -> list[float]:
        for _ in range(200):
            fn(*args)
        values = []
        for _ in range(repeats):
            began = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            values.append((time.perf_counter() - began) / calls * 1e6)
        return values

    before = kimi_workload.prefill_counters()
    patched_us, direct_us = [], []
    for _ in range(3):  # interleave the two to share machine noise
        patched_us += per_call(patched._run_prefill)
        direct_us += per_call(direct._run_prefill)
    routed = kimi_workload.prefill_counters().get("calls_routed", 0) - before.get("calls_routed", 0)
    revert_patch(patch)
    native_us = per_call(layers.OverheadKimiK3DeltaAttention()._run_prefill)  # fork body, real torch indexing
    record.update({"device": str(device), "calls_per_sample": calls, "patched_us": patched_us, "direct_us": direct_us,
                   "native_indexing_body_us": native_us, "routed_calls": routed,
                   "overhead_us_median": round(statistics.median(patched_us) - statistics.median(direct_us), 3),
                   "overhead_us_min": round(min(patched_us) - min(direct_us), 3)})
    print(f"overhead on {device}: {record['overhead_us_median']:.2f} us/call (median), "
          f"{record['overhead_us_min']:.2f} (min); routed {routed}", flush=True)


def write(record: dict[str, Any], path: str) -> None:
    partial = path + ".partial"
    with open(partial, "w") as handle:
        json.dump(record, handle, indent=1)
    os.replace(partial, path)


def shapes_for(quick: bool) -> dict[str, Any]:
    if quick:
        return {"heads": 2, "head_dim": 8, "rows": 80, "gap": 24, "max_seqs": 64,
                "exact_batches": ((1, 1, 1), (5, 63, 129), (16, 1, 200)), "bench_counts": (1, 8),
                "bench_len": 64, "bench_dtypes": ("float32",)}
    return {"heads": 12, "head_dim": 128, "rows": 512, "gap": 1024, "max_seqs": 256,
            "exact_batches": ((1, 1, 1), (5, 63, 129), (16, 1, 1024), (64, 1, 1024)),
            "bench_counts": (1, 8, 64, 256), "bench_len": 512, "bench_dtypes": ("float32", "bfloat16")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory (the JSON file must not exist)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--phases", default="overhead,exactness,benchmark")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new case after this many seconds (results so far are kept)")
    args = parser.parse_args(argv)
    _DEADLINE[0] = time.perf_counter() + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, OUTPUT_NAME)
    if os.path.exists(path):
        parser.error(f"{path} already exists; results are never overwritten")
    from kda_patches.bench.autotune import limit_autotune

    limit_autotune()  # fla-core's chunk kernels: the state-copy share is then a slight underestimate
    import torch

    try:  # before any plan is prepared: fla may set TRITON_* variables at import
        import fla.ops.kda
    except ImportError:
        pass

    import kda_patches  # noqa: F401  (activates the overlay: flags, ledger)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = shapes_for(args.quick)
    shape["bench_dtypes"] = tuple(getattr(torch, name) for name in shape["bench_dtypes"])
    import triton

    record: dict[str, Any] = {"meta": {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                       "torch": torch.__version__, "triton": triton.__version__,
                                       "python": platform.python_version(), "source_sha256": source_hash(),
                                       "quick": args.quick, "autotune_configs_kept": 1,
                                       "shape": {k: v for k, v in shape.items() if k != "bench_dtypes"}}}
    try:
        import fla

        record["meta"]["fla"] = getattr(fla, "__version__", "unknown")
    except ImportError as error:
        record["meta"]["fla"] = f"missing: {error}"
    write(record, path)
    phases = {"overhead": lambda r: measure_overhead(device, 2000 if args.quick else 20000, 5, r),
              "exactness": lambda r: check_exactness(shape, device, r),
              "benchmark": lambda r: run_benchmark(shape, device, args.rounds, r)}
    status = 0
    for name in args.phases.split(","):
        started = time.perf_counter()
        record[name] = {}
        try:
            phases[name](record[name])
        except Exception:  # keep the other phases' results
            record[name]["error"] = traceback.format_exc()
            print(record[name]["error"], flush=True)
            status = 1
        record[name]["phase_seconds"] = round(time.perf_counter() - started, 2)
        write(record, path)
    from kda_patches.ledger import get_ledger

    record["ledger_counters"] = get_ledger().counters("kimi_prefill")
    write(record, path)
    print(f"wrote {path}", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
