"""Why the plan's scatter trails its byte floor (issue 8).

An experiment, not the product: it compiles its own variants of the fused scatter (same addressing and
masks as :func:`kda_patches.state_copy.kernels.copy_rows_kernel`, same-dtype rows only) that differ in
one thing each: the cache-store and packed-load cache policies, the grid order, tiles per program, a
persistent grid-stride loop. Each runs in graph replay next to the real plan and torch's contiguous
``copy_`` of the same bytes, on the benchmark's caches (page gaps, random INT32 rows), with the finals
either one tensor reused by every call (as ``bench gdn-state-copy``) or rotated over four (no L2 reuse).
Every variant's bytes are checked against torch once (selected rows equal, every other cache byte kept).

``--tiles`` sweeps the real plan's tile bytes and warps; ``--stream`` compares the real plan with and
without ``evict_first`` on the cache side. (Run 7's host part -- Triton's C entry called directly vs the
launcher -- became the plan's own launch path; ``plan_host_profile.py`` measures it now.)

Usage: ``python scripts/gpu/scatter_store_probe.py --out DIR [--quick | --tiles | --stream]`` (CUDA only;
writes ``DIR/scatter_store_probe.json``, ``scatter_tile_probe.json`` or ``scatter_stream_probe.json``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time
from typing import Any

import triton
import triton.language as tl


@triton.jit
def probe_scatter_kernel(cache_ptr, packed_ptr, index_ptr, NUM_ROWS: tl.constexpr, ROW_STRIDE: tl.constexpr,
                         PAYLOAD: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                         ROW_FIRST: tl.constexpr, LOAD_POLICY: tl.constexpr, STORE_POLICY: tl.constexpr,
                         STORE_MODIFIER: tl.constexpr):
    """Scatter ``UNROLL`` tiles of one selected row (``PAYLOAD % (BLOCK * UNROLL) == 0``)."""
    if ROW_FIRST:
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1).to(tl.int64)
    else:
        group = tl.program_id(0).to(tl.int64)
        row = tl.program_id(1).to(tl.int64)
    cache_row = tl.full([BLOCK], 0, tl.int64) + tl.load(index_ptr + row).to(tl.int64)
    valid = (cache_row >= 0) & (cache_row < NUM_ROWS)
    safe_row = tl.where(valid, cache_row, 0)
    for part in tl.static_range(UNROLL):
        offsets = (group * UNROLL + part) * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(packed_ptr + row * PAYLOAD + offsets, mask=valid, eviction_policy=LOAD_POLICY)
        tl.store(cache_ptr + safe_row * ROW_STRIDE + offsets, values, mask=valid, eviction_policy=STORE_POLICY,
                 cache_modifier=STORE_MODIFIER)


@triton.jit
def probe_persistent_kernel(cache_ptr, packed_ptr, index_ptr, work, NUM_ROWS: tl.constexpr,
                            ROW_STRIDE: tl.constexpr, PAYLOAD: tl.constexpr, BLOCK: tl.constexpr,
                            TILES: tl.constexpr, PROGRAMS: tl.constexpr):
    """Grid-stride loop over ``work = S * TILES`` (row, tile) items."""
    for item in range(tl.program_id(0), work, PROGRAMS):
        wide = tl.full([], 0, tl.int64) + item
        row = wide // TILES
        tile = wide % TILES
        offsets = tile * BLOCK + tl.arange(0, BLOCK)
        cache_row = tl.full([BLOCK], 0, tl.int64) + tl.load(index_ptr + row).to(tl.int64)
        valid = (cache_row >= 0) & (cache_row < NUM_ROWS)
        safe_row = tl.where(valid, cache_row, 0)
        values = tl.load(packed_ptr + row * PAYLOAD + offsets, mask=valid)
        tl.store(cache_ptr + safe_row * ROW_STRIDE + offsets, values, mask=valid)


# name: (block bytes, warps, unroll, row_first, load policy, store policy, store modifier)
TILED = {
    "k-base": (8192, 4, 1, False, "", "", ""),
    "store-cs": (8192, 4, 1, False, "", "", ".cs"),
    "store-evict-first": (8192, 4, 1, False, "", "evict_first", ""),
    "load-evict-last": (8192, 4, 1, False, "evict_last", "", ""),
    "load-last-store-first": (8192, 4, 1, False, "evict_last", "evict_first", ""),
    "store-wt": (8192, 4, 1, False, "", "", ".wt"),
    "row-first": (8192, 4, 1, True, "", "", ""),
    "unroll2": (8192, 4, 2, False, "", "", ""),
    "unroll4-w8": (8192, 8, 4, False, "", "", ""),
    "block16k-w8-cs": (16384, 8, 1, False, "", "", ".cs"),
    "block4k-w4": (4096, 4, 1, False, "", "", ""),
}


def tiled_call(name: str, state: Any) -> Any:
    block_bytes, warps, unroll, row_first, load_policy, store_policy, modifier = TILED[name]
    payload = state[0].numel()
    block = block_bytes // state.element_size()
    groups = payload // (block * unroll)
    constexprs = dict(NUM_ROWS=state.shape[0], ROW_STRIDE=state.stride(0), PAYLOAD=payload, BLOCK=block,
                      UNROLL=unroll, ROW_FIRST=row_first, LOAD_POLICY=load_policy, STORE_POLICY=store_policy,
                      STORE_MODIFIER=modifier)

    def call(indices: Any, finals: Any) -> None:
        grid = (indices.shape[0], groups) if row_first else (groups, indices.shape[0])
        probe_scatter_kernel[grid](state, finals, indices, num_warps=warps, **constexprs)
    return call


def persistent_call(state: Any, programs: int) -> Any:
    payload = state[0].numel()
    block = 8192 // state.element_size()
    tiles = payload // block

    def call(indices: Any, finals: Any) -> None:
        work = indices.shape[0] * tiles
        probe_persistent_kernel[(min(programs, work),)](state, finals, indices, work, NUM_ROWS=state.shape[0],
                                                         ROW_STRIDE=state.stride(0), PAYLOAD=payload, BLOCK=block,
                                                         TILES=tiles, PROGRAMS=min(programs, work), num_warps=4)
    return call


def check_bytes(torch: Any, name: str, call: Any, state: Any, indices: Any, finals: Any) -> bool:
    before = state.clone()
    call(indices, finals)
    torch.cuda.synchronize()
    expected = before.clone()
    expected[indices.long()] = finals
    same = torch.equal(state.view(torch.uint8), expected.view(torch.uint8))
    state.copy_(before)
    if not same:
        print(f"probe: {name} wrote wrong bytes", flush=True)
    return same


def graph_medians(torch: Any, timing: Any, calls: dict[str, Any], index_sets: list[Any], finals: list[Any],
                  captured: int, trials: int, shuffler: random.Random) -> dict[str, float]:
    """Graph-replay medians of ``call(indices, finals)`` per name, index sets and finals rotating per step."""
    steps = {name: (lambda step, call=call: call(index_sets[step % len(index_sets)], finals[step % len(finals)]))
             for name, call in calls.items()}
    samples = timing.replay_graphs(steps, captured, trials, index_sets[0].device, shuffler)
    return {name: round(timing.median(values), 3) for name, values in samples.items()}


def probe_bandwidth(torch: Any, args: argparse.Namespace, shuffler: random.Random) -> list[dict[str, Any]]:
    from kda_patches.bench import timing
    from kda_patches.bench.state_copy import ContiguousCopyReference, build_cache
    from kda_patches.state_copy.worker import initialize

    device = torch.device("cuda")
    ceiling = timing.measure_copy_ceiling(device)["bytes_per_s"]
    rows_out = []
    shapes = {"27b-tp4": [12, 128, 128], "397b-tp8": [8, 128, 128]}
    for shape, inner in shapes.items():
        for dtype in (torch.float32, torch.bfloat16):
            state = build_cache(device, dtype, 1024, inner, 8192)
            binding = initialize({"probe": state}, 256, final_dtypes=(dtype,))["probe"]
            reference = ContiguousCopyReference(state)
            for selected in args.selected:
                generator = torch.Generator().manual_seed(selected)
                index_sets = [torch.randperm(1024, generator=generator)[:selected].to(device=device, dtype=torch.int32)
                              for _ in range(args.captured)]
                finals = [torch.randn((selected, *inner), generator=generator).to(device=device, dtype=dtype)
                          for _ in range(4)]
                calls: dict[str, Any] = {
                    "plan": lambda indices, last, cache=state, plan=binding: plan.scatter(cache, last, indices),
                    "copy": lambda indices, last, cache=state, ref=reference: ref.scatter(cache, last, indices),
                }
                for name in TILED:
                    calls[name] = tiled_call(name, state)
                calls["persistent-1056"] = persistent_call(state, 132 * 8)
                calls["persistent-2112"] = persistent_call(state, 132 * 16)
                checked = {name: check_bytes(torch, name, call, state, index_sets[0], finals[0])
                           for name, call in calls.items() if name != "copy"}
                floor = selected * state[0].numel() * 2 * state.element_size() / ceiling * 1e6
                for reuse, finals_used in (("reused", finals[:1]), ("rotated", finals)):
                    medians = graph_medians(torch, timing, calls, index_sets, finals_used, args.captured,
                                            args.trials, shuffler)
                    record = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "selected": selected,
                              "finals": reuse, "floor_us": round(floor, 3), "graph_us": medians,
                              "over_floor": {k: round(v / floor, 3) for k, v in medians.items()},
                              "bytes_ok": checked}
                    rows_out.append(record)
                    best = min((v, k) for k, v in medians.items() if k != "copy")
                    print(f"{shape} {record['dtype']} {selected} {reuse}: floor {floor:.1f} plan "
                          f"{medians['plan']:.1f} copy {medians['copy']:.1f} best {best[1]} {best[0]:.1f}", flush=True)
            del state, binding, reference
            torch.cuda.empty_cache()
    return rows_out


# (tile bytes, warps[, stream]): stream marks the cache side evict_first (FusedStatePlan's stream option)
TILE_CONFIGS = ((2048, 2), (2048, 4), (4096, 2), (4096, 4), (4096, 8), (8192, 4), (8192, 8))
STREAM_CONFIGS = ((4096, 4), (4096, 4, True), (8192, 4), (8192, 4, True))


def time_plans(timing: Any, plans: dict[str, Any], state: Any, index_sets: list[Any], flag_sets: list[Any],
               last: Any, args: argparse.Namespace, shuffler: random.Random) -> dict[str, float]:
    """Graph-replay medians of every plan's gather and scatter on the same inputs (order shuffled per round)."""
    calls: dict[str, Any] = {}
    for label, plan in plans.items():
        calls[f"gather {label}"] = lambda step, plan=plan: plan.gather(
            state, index_sets[step % len(index_sets)], flag_sets[step % len(flag_sets)])
        calls[f"scatter {label}"] = lambda step, plan=plan: plan.scatter(
            state, last, index_sets[step % len(index_sets)])
    samples = timing.replay_graphs(calls, args.captured, args.trials, state.device, shuffler)
    return {name: round(timing.median(values), 3) for name, values in samples.items()}


def probe_tiles(torch: Any, args: argparse.Namespace, shuffler: random.Random) -> list[dict[str, Any]]:
    """The real fused plan at each (tile bytes, warps) of TILE_CONFIGS: gather and scatter, graph replay."""
    from kda_patches.bench import timing
    from kda_patches.bench.state_copy import build_cache, random_selections
    from kda_patches.state_copy.plan import FusedStatePlan

    device = torch.device("cuda")
    ceiling = timing.measure_copy_ceiling(device)["bytes_per_s"]
    records = []
    cases = ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16))
    for shape, inner in {"27b-tp4": [12, 128, 128], "397b-tp8": [8, 128, 128]}.items():
        for cache_dtype, final in cases:
            state = build_cache(device, cache_dtype, 1024, inner, 8192)
            plans = {"/".join(map(str, config)): FusedStatePlan.prepare(
                state, 256, block_bytes=config[0], num_warps=config[1], stream=len(config) > 2,
                final_dtypes=(final,)).seal() for config in args.configs}
            for selected in args.tile_rows:
                index_sets, flag_sets, last = random_selections(
                    state, selected, args.captured, torch.Generator().manual_seed(selected + 1), final)
                medians = time_plans(timing, plans, state, index_sets, flag_sets, last, args, shuffler)
                payload = state[0].numel() * selected
                floors = {"gather": payload * 2 * state.element_size() / ceiling * 1e6,
                          "scatter": payload * (state.element_size() + last.element_size()) / ceiling * 1e6}
                record = {"shape": shape, "cache": str(cache_dtype), "final": str(final), "selected": selected,
                          "floors_us": floors, "graph_us": medians,
                          "over_floor": {k: round(v / floors[k.split()[0]], 3) for k, v in medians.items()}}
                records.append(record)
                print(shape, cache_dtype, final, selected, " ".join(f"{k}={v:.3f}" for k, v in
                                                                   record["over_floor"].items()), flush=True)
            del state, plans
            torch.cuda.empty_cache()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="64 rows only, fewer trials")
    parser.add_argument("--tiles", action="store_true", help="only the real plan's tile sweep (TILE_CONFIGS)")
    parser.add_argument("--stream", action="store_true", help="only the real plan with and without stream hints")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("scatter_store_probe: no CUDA device; nothing measured")
        return 0
    args.selected = [64] if args.quick else [64, 256]
    args.captured, args.trials = (10, 5) if args.quick else (20, 12)
    shuffler = random.Random(11)
    started = time.time()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiles or args.stream:
        args.tile_rows = [1, 8, 64, 256] if args.tiles else [64, 256]
        args.configs = TILE_CONFIGS if args.tiles else STREAM_CONFIGS
        tiles = {"argv": sys.argv[1:], "torch": torch.__version__, "triton": triton.__version__,
                 "configs": args.configs, "tiles": probe_tiles(torch, args, shuffler)}
        tiles["seconds"] = round(time.time() - started, 1)
        name = "scatter_tile_probe.json" if args.tiles else "scatter_stream_probe.json"
        (out / name).write_text(json.dumps(tiles, indent=1))
        return 0
    result = {"argv": sys.argv[1:], "torch": torch.__version__, "triton": triton.__version__,
              "bandwidth": probe_bandwidth(torch, args, shuffler)}
    result["seconds"] = round(time.time() - started, 1)
    (out / "scatter_store_probe.json").write_text(json.dumps(result, indent=1))
    print(f"scatter_store_probe: {len(result['bandwidth'])} cases in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
