"""Which launch shape closes the plan's graph-replay gap to upstream vLLM 0.34's own state-copy ops (issue 27).

An experiment, not the product. Upstream's ``_gather_initial_states_kernel`` / ``_scatter_states_kernel`` launch
1024 items per program with 8 warps and PDL; the fused plan launches 4 KiB per program with 4 warps (FP32: 1024
items, BF16: 2048, so a BF16 row gets half the programs). This probe measures, in graph replay (device time only),
the real :class:`~kda_patches.state_copy.plan.FusedStatePlan` with PDL at several ``(tile bytes, warps)`` beside
upstream's kernels, on the GDN benchmark's caches (page gaps, random INT32 rows, 75 % flags), Qwen3.6-27B TP4 and
Kimi-Linear-48B TP1 state shapes, FP32 / BF16 caches with same-dtype and BF16 <- FP32 scatters. Every
implementation is checked bit-equal to the naive twin before it is timed.

Upstream's two files are read from ``--upstream-dir`` (``gather_initial_states.py`` and ``scatter_states.py`` of the
vLLM 0.34.0 wheel, copied out of the release cache; gitignored, carried) and run unchanged with their vLLM imports
answered here: Triton for ``vllm.triton_utils``, a platform that reports PDL on SM90+, and a warm-up dispatcher that
launches ``kernel[grid]`` with the arguments upstream's own function returns. Device time does not depend on the
dispatcher (``bench peer --release vllm==0.34.0`` measures its host cost with the real one).

Usage: ``python3 scripts/gpu/launch_shape_probe.py --out DIR --upstream-dir DIR`` (CUDA only; writes
``DIR/launch_shape_probe.json``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time
import types
from typing import Any

import triton
import triton.language as tl

from kda_patches.state_copy.kernels import pdl_prologue

UPSTREAM = "upstream-0.34"


@triton.jit(do_not_specialize=["num_rows"])
def body_probe_scatter_kernel(cache_ptr, packed_ptr, index_ptr, num_rows, ROW_STRIDE: tl.constexpr,
                              PAYLOAD: tl.constexpr, BLOCK: tl.constexpr, CHECK: tl.constexpr):
    """Same-dtype scatter of one tile of one row, ``PAYLOAD % BLOCK == 0``; ``CHECK`` picks how an invalid index
    is handled: 0 not at all (upstream), 1 masked store at the clamped row (the plan before its scalar checks),
    2 masked store at the raw row, 3 a scalar branch around an unmasked store, 4 the plan's scalar check, 5 it with
    the plan's ``evict_first`` store, 6 it with the plan's explicit BF16 conversion and bitcasts (cast scatters),
    7 it with a CTA barrier after the loads, 8 it with a volatile packed load."""
    tile = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    offsets = tile * BLOCK + tl.arange(0, BLOCK)
    pdl_prologue(True)  # the plan's own wait and launch-dependents, where the plan puts them
    if CHECK == 8:
        values = tl.load(packed_ptr + row * PAYLOAD + offsets, volatile=True)
    else:
        values = tl.load(packed_ptr + row * PAYLOAD + offsets)
    if CHECK == 7:
        tl.debug_barrier()
    if CHECK == 0:
        cache_row = tl.load(index_ptr + row).to(tl.int64)
        tl.store(cache_ptr + cache_row * ROW_STRIDE + offsets, values)
    elif CHECK == 1:
        cache_row = tl.full([BLOCK], 0, tl.int64) + tl.load(index_ptr + row).to(tl.int64)
        valid = (cache_row >= 0) & (cache_row < num_rows.to(tl.int64))
        tl.store(cache_ptr + tl.where(valid, cache_row, 0) * ROW_STRIDE + offsets, values, mask=valid)
    elif CHECK == 2:
        cache_row = tl.full([BLOCK], 0, tl.int64) + tl.load(index_ptr + row).to(tl.int64)
        valid = (cache_row >= 0) & (cache_row < num_rows.to(tl.int64))
        tl.store(cache_ptr + cache_row * ROW_STRIDE + offsets, values, mask=valid)
    elif CHECK == 3:
        cache_row = tl.load(index_ptr + row).to(tl.int64)
        if (cache_row >= 0) & (cache_row < num_rows.to(tl.int64)):
            tl.store(cache_ptr + cache_row * ROW_STRIDE + offsets, values)
    else:  # the plan's scalar check (kernels.copy_rows_kernel); 5 adds its evict_first, 6 its explicit cast,
        # 7 a CTA barrier between the loads and the store, 8 a volatile packed load (both keep ptxas from sinking
        # the packed load below the early exit it makes of the masked store when a thread has one vector load)
        index = tl.load(index_ptr + row).to(tl.int64)
        valid = (index >= 0) & (index < num_rows.to(tl.int64))
        mask = offsets < tl.where(valid, PAYLOAD, 0)
        items = cache_ptr + tl.where(valid, index, 0) * ROW_STRIDE + offsets
        if CHECK == 6 and packed_ptr.dtype.element_ty != cache_ptr.dtype.element_ty:
            values = values.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
            values = values.to(cache_ptr.dtype.element_ty, bitcast=True)
        if CHECK == 5:
            tl.store(items, values, mask=mask, eviction_policy="evict_first")
        else:
            tl.store(items, values, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def body_probe_gather_kernel(cache_ptr, packed_ptr, index_ptr, flag_ptr, num_rows, ROW_STRIDE: tl.constexpr,
                             PAYLOAD: tl.constexpr, BLOCK: tl.constexpr, FORM: tl.constexpr):
    """Gather of one tile of one row with flags (false: zeros), ``PAYLOAD % BLOCK == 0``; ``FORM``: 0 upstream's body
    (no bounds check, the flag as int1 folded into the load mask, masked store), 1 the plan's (scalar checks, the flag
    as int32, the row limit as a scalar, unmasked store), 2 the plan's with the flag as int1, 3 upstream's body with
    the bounds check folded into its flag, 4 the plan's with upstream's masked store."""
    tile = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offsets = tile * BLOCK + tl.arange(0, BLOCK)
    pdl_prologue(True)  # the plan's own wait and launch-dependents, where the plan puts them
    in_payload = offsets < PAYLOAD
    if FORM == 0 or FORM == 3:
        flag = tl.load(flag_ptr + row).to(tl.int1)
        index = tl.load(index_ptr + row).to(tl.int64)
        if FORM == 3:
            flag = flag & (index >= 0) & (index < num_rows.to(tl.int64))
        index = tl.where(flag, index, 0)
        values = tl.load(cache_ptr + index * ROW_STRIDE + offsets, mask=in_payload & flag, other=0.0)
        tl.store(packed_ptr + row * PAYLOAD + offsets, values, mask=in_payload)
    else:
        index = tl.load(index_ptr + row).to(tl.int64)
        valid = (index >= 0) & (index < num_rows.to(tl.int64))
        if FORM == 2:
            valid = valid & tl.load(flag_ptr + row).to(tl.int1)
        else:
            valid = valid & (tl.load(flag_ptr + row).to(tl.int32) != 0)
        values = tl.load(cache_ptr + tl.where(valid, index, 0) * ROW_STRIDE + offsets,
                         mask=offsets < tl.where(valid, PAYLOAD, 0), other=0)
        if FORM == 4:
            tl.store(packed_ptr + row * PAYLOAD + offsets, values, mask=in_payload)
        else:
            tl.store(packed_ptr + row * PAYLOAD + offsets, values)


# label: (warps, FORM); the block is the plan's (4 KiB of the cache item)
GATHER_BODY_PROBES = {"gbody-upstream-w8": (8, 0), "gbody-upstream-w4": (4, 0), "gbody-plan-w4": (4, 1),
                      "gbody-plan-w8": (8, 1), "gbody-plan-int1-w4": (4, 2), "gbody-upstream-checked-w8": (8, 3),
                      "gbody-upstream-checked-w4": (4, 3), "gbody-plan-masked-w4": (4, 4)}


def gather_body_probe_impls(state: Any) -> dict[str, tuple[Any, Any]]:
    """``{label: (gather, None)}`` of the gather body probes (:data:`GATHER_BODY_PROBES`) for a cache like ``state``."""
    import torch

    block = 4096 // state.element_size()
    impls = {}
    for label, (warps, form) in GATHER_BODY_PROBES.items():
        def gather(cache: Any, indices: Any, flags: Any, warps: int = warps, form: int = form) -> Any:
            out = torch.empty((indices.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
            grid = (cache[0].numel() // block, indices.shape[0])
            body_probe_gather_kernel[grid](cache, out, indices, flags, cache.shape[0], ROW_STRIDE=cache.stride(0),
                                           PAYLOAD=cache[0].numel(), BLOCK=block, FORM=form, num_warps=warps,
                                           launch_pdl=True)
            return out
        impls[label] = (gather, None)
    return impls


# label: (block items, or None for a 4 KiB tile of the widest item as the plan sizes it; warps; CHECK). A cast
# scatter's body converts in ``tl.store`` (the hardware's round-to-nearest-even ``cvt``, as upstream does), not by
# the plan's bit-pattern cast: the pair of columns prices that cast.
BODY_PROBES = {"body-none": (None, 4, 0), "body-clamped": (None, 4, 1), "body-raw": (None, 4, 2),
               "body-branch": (None, 4, 3), "body-none-w8": (None, 8, 0), "body-clamped-w8": (None, 8, 1),
               "body-upstream-shape": (1024, 8, 0), "body-upstream-shape-clamped": (1024, 8, 1),
               "body-scalar-w8": (None, 8, 4), "body-scalar-evict-w8": (None, 8, 5),
               "body-scalar-bitcast-w8": (None, 8, 6), "body-scalar-barrier-w8": (None, 8, 7),
               "body-scalar-volatile-w8": (None, 8, 8), "body-scalar-barrier": (None, 4, 7),
               "body-scalar-volatile": (None, 4, 8)}


def body_probe_impls(state: Any, final: Any) -> dict[str, tuple[Any, Any]]:
    """``{label: (None, scatter)}`` of the body probes for a cache like ``state`` and finals of dtype ``final``;
    a label whose resolved ``(block, warps, CHECK)`` repeats an earlier one is left out."""
    impls, seen = {}, set()
    widest = max(state.element_size(), final.itemsize)
    for label, (items, warps, check) in BODY_PROBES.items():
        block = items or 4096 // widest
        if (block, warps, check) in seen:
            continue
        seen.add((block, warps, check))

        def scatter(cache: Any, last: Any, indices: Any, block: int = block, warps: int = warps,
                    check: int = check) -> None:
            grid = (cache[0].numel() // block, indices.shape[0])
            body_probe_scatter_kernel[grid](cache, last, indices, cache.shape[0], ROW_STRIDE=cache.stride(0),
                                            PAYLOAD=cache[0].numel(), BLOCK=block, CHECK=check, num_warps=warps,
                                            launch_pdl=True)
        impls[label] = (None, scatter)
    return impls


# (tile bytes, warps, evict_first on the scatter's cache writes)
CONFIGS = ((4096, 4, True), (4096, 4, False), (4096, 8, True), (4096, 8, False), (2048, 4, True), (2048, 8, True),
           (8192, 8, True), (1024, 4, True))


def load_upstream_ops(folder: pathlib.Path) -> tuple[Any, Any]:
    """Return upstream 0.34's ``(gather_initial_states, scatter_states)`` loaded from ``folder`` with stand-ins."""
    import torch
    import triton

    from kda_patches.releases.load import run_serving, triton_utils_shim

    def dispatcher_with_warmup(kernel: Any, warmup_inputs: Any) -> Any:
        def decorate(function: Any) -> Any:
            def launch(*args: Any) -> None:
                grid, options = function(*args)
                kernel[grid](*args, **options)
            return launch
        return decorate

    platform = types.SimpleNamespace(is_arch_support_pdl=lambda: torch.cuda.get_device_capability() >= (9, 0))
    modules = triton_utils_shim()
    modules["vllm.platforms"] = types.SimpleNamespace(current_platform=platform)
    modules["vllm.model_executor.warmup.jit_warmup"] = types.SimpleNamespace(WarmupIntRange=lambda *a: a)
    modules["vllm.model_executor.warmup.jit_warmup_triton_helper"] = types.SimpleNamespace(
        DispatchSpec=tuple, TritonWarmupTensor=lambda *a, **k: None,
        triton_kernel_dispatcher_with_warmup=dispatcher_with_warmup)
    loaded = []
    for stem in ("gather_initial_states", "scatter_states"):
        import importlib.util

        spec = importlib.util.spec_from_file_location(f"kda_probe_upstream_{stem}", folder / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        run_serving(spec.name, module, modules, lambda spec=spec, module=module: spec.loader.exec_module(module))
        loaded.append(getattr(module, stem))
    del triton
    return loaded[0], loaded[1]


def prepare_plans(state: Any, final: Any, pdl: bool = True) -> dict[str, tuple[Any, Any]]:
    """Return ``{label: (gather, scatter)}`` of one sealed plan (PDL; with ``pdl`` false the plain launch) per
    configuration on the SM90 target's facts
    (:data:`~kda_patches.state_copy.device.CUDA_PDL_TARGET`: a cast scatter from wider finals gets the smaller
    block and the compiler's own conversion), with the eviction hint on or off; ``plan default`` is the plan a
    layer gets (no block or warps given: the target's widened-scatter warps apply), and for cast scatters
    ``plan default/software-cast`` is it with the bit-pattern cast; ``.../unpinned`` columns read the packed row with
    a plain load (``TargetFacts.pinned_scatter_load`` off). Runs before 2026-12-05 17:00 UTC had no
    default column, and their plans took the bit-pattern cast (a ``plan 4096/4/hardware-cast`` column instead)."""
    import dataclasses

    from kda_patches.state_copy.device import CUDA_PDL_TARGET, PDL
    from kda_patches.state_copy.plan import FusedStatePlan

    impls = {}
    for block_bytes, warps, evict in CONFIGS:
        target = CUDA_PDL_TARGET if evict else dataclasses.replace(CUDA_PDL_TARGET, honoured_hints=(PDL,))
        plan = FusedStatePlan.prepare(state, 256, block_bytes=block_bytes, num_warps=warps, pdl=pdl,
                                      final_dtypes=(final,), target=target).seal()
        if plan.describe()["pdl"] != pdl:
            raise RuntimeError(f"plan {block_bytes}/{warps} did not compile with PDL: {plan.describe()}")
        label = f"plan {block_bytes}/{warps}" + ("" if evict else "/no-evict")
        impls[label] = (plan.gather, plan.scatter)
    unpinned = dataclasses.replace(CUDA_PDL_TARGET, pinned_scatter_load=False)
    variants = {"plan default": (CUDA_PDL_TARGET, None), "plan default/unpinned": (unpinned, None),
                "plan 4096/8/unpinned": (unpinned, 8)}
    if final != state.dtype:
        variants["plan default/software-cast"] = (dataclasses.replace(CUDA_PDL_TARGET, hardware_casts=()), None)
        # the cast scatter as it was before the hardware cast and the pin (bench peer run 1, tree f5702de)
        variants["plan 4096/4/unpinned/software-cast"] = (dataclasses.replace(unpinned, hardware_casts=()), 4)
        variants["plan 4096/8/unpinned/software-cast"] = (dataclasses.replace(unpinned, hardware_casts=()), 8)
    for label, (target, warps) in variants.items():
        plan = FusedStatePlan.prepare(state, 256, num_warps=warps, pdl=pdl, final_dtypes=(final,),
                                      target=target).seal()
        policy = plan.describe()["casts"][0]
        if final != state.dtype and (policy["nan"] == "hardware") == ("software-cast" in label):
            raise RuntimeError(f"{label}: unexpected cast policy {policy}")
        impls[label] = (plan.gather, plan.scatter)
    return impls


def check_body_probes(impls: dict[str, tuple[Any, Any]], state: Any, indices: Any, flags: Any, last: Any) -> None:
    """Refuse a body probe whose scatter is not bit-equal to torch's index_put of the finals cast to the cache, or
    whose gather is not bit-equal to the naive twin's."""
    import torch

    from kda_patches.state_copy import naive

    for name, (gather, scatter) in impls.items():
        if scatter is None:
            expected = naive.gather_states(state, indices, flags)
            if not torch.equal(gather(state, indices, flags).view(torch.uint8), expected.view(torch.uint8)):
                raise RuntimeError(f"{name} gathered wrong bytes")
        elif gather is None:
            before = state.clone()
            scatter(state, last, indices)
            expected = before.clone()
            expected[indices.long()] = last.to(state.dtype)
            if not torch.equal(state.view(torch.uint8), expected.view(torch.uint8)):
                raise RuntimeError(f"{name} wrote wrong bytes")
            state.copy_(before)


def bind_calls(impls: dict[str, tuple[Any, Any]], state: Any, index_sets: list[Any], flag_sets: list[Any],
               last: Any) -> dict[tuple[str, str], Any]:
    """Return ``{(impl, op): call(step)}``: each gather and scatter on index set ``step % n``."""
    calls = {}
    count = len(index_sets)
    for name, (gather, scatter) in impls.items():
        if scatter is None:
            calls[(name, "gather")] = lambda step, gather=gather: gather(state, index_sets[step % count],
                                                                         flag_sets[step % count])
            continue
        if gather is None:
            calls[(name, "scatter")] = lambda step, scatter=scatter: scatter(state, last, index_sets[step % count])
            continue
        calls[(name, "gather")] = lambda step, gather=gather: gather(state, index_sets[step % count],
                                                                     flag_sets[step % count])
        calls[(name, "scatter")] = lambda step, scatter=scatter: scatter(state, last, index_sets[step % count])
    return calls


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from kda_patches.bench import timing
    from kda_patches.bench.gdn_state_copy import check_correctness
    from kda_patches.bench.state_copy import build_cache, random_selections

    device = torch.device("cuda")
    gather_up, scatter_up = load_upstream_ops(pathlib.Path(args.upstream_dir))
    shuffler = random.Random(args.seed)
    records = []
    shapes = {"qwen3.6-27b-tp4": [12, 128, 128], "kimi-linear-48b-tp1": [32, 128, 128]}
    cases = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32))
    for shape, inner in shapes.items():
        for cache_dtype, final in cases:
            state = build_cache(device, cache_dtype, 1024, inner, 8192)
            impls = prepare_plans(state, final, pdl=args.launch == "pdl")
            impls[UPSTREAM] = (gather_up, scatter_up)
            if args.body:
                impls.update(body_probe_impls(state, final))
            if args.gather_body:
                impls.update(gather_body_probe_impls(state))
            for selected in args.selected:
                index_sets, flag_sets, last = random_selections(
                    state, selected, args.captured, torch.Generator().manual_seed(selected + args.index_seed), final)
                check_correctness({k: v for k, v in impls.items() if None not in v}, state, index_sets[0],
                                  flag_sets[0], last)
                check_body_probes(impls, state, index_sets[0], flag_sets[0], last)
                calls = bind_calls(impls, state, index_sets, flag_sets, last)
                samples = timing.replay_graphs(calls, args.captured, args.trials, device, shuffler,
                                               args.graph_instances)
                for (name, op), values in samples.items():
                    records.append({"shape": shape, "cache": str(cache_dtype).removeprefix("torch."),
                                    "final": str(final).removeprefix("torch."), "selected": selected, "impl": name,
                                    "op": op, "graph_us": values, "median_us": timing.median(values)})
                line = []
                for op in ("gather", "scatter"):
                    upstream = timing.median(samples[(UPSTREAM, op)])
                    best = min((timing.median(v), k[0]) for k, v in samples.items() if k[1] == op and k[0] != UPSTREAM)
                    current = timing.median(samples[("plan default", op)])
                    line.append(f"{op} up {upstream:.2f} default {current:.2f} best {best[1]} {best[0]:.2f}")
                print(f"{shape} {cache_dtype}:{final} S={selected}: " + " | ".join(line), flush=True)
            del state, impls
            torch.cuda.empty_cache()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--upstream-dir", required=True, help="folder with 0.34's two op files")
    parser.add_argument("--selected", default="1,2,4,8,64,256")
    parser.add_argument("--captured", type=int, default=20)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--graph-instances", type=int, default=5,
                        help="captures per implementation, each replayed in its own block (divides --trials)")
    parser.add_argument("--seed", type=int, default=27, help="seeds the order the implementations are replayed in")
    parser.add_argument("--index-seed", type=int, default=7,
                        help="the index and flag sets of S rows are drawn from seed S + this (7: earlier runs' sets)")
    parser.add_argument("--body", action="store_true", help="also the scatter body probes (BODY_PROBES)")
    parser.add_argument("--gather-body", action="store_true",
                        help="also the gather body probes (GATHER_BODY_PROBES)")
    parser.add_argument("--launch", choices=("pdl", "plain"), default="pdl",
                        help="how the plan columns launch (upstream's ops use PDL either way)")
    args = parser.parse_args(argv)
    args.selected = [int(x) for x in args.selected.split(",")]
    from kda_patches.bench import timing

    try:  # before any plan is compiled or graph captured
        timing.check_graph_instances(args.trials, args.graph_instances)
    except ValueError as error:
        parser.error(str(error))
    import torch

    if not torch.cuda.is_available():
        print("launch_shape_probe: no CUDA device; nothing measured")
        return 2
    started = time.time()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"argv": sys.argv[1:], "torch": torch.__version__, "triton": triton.__version__,
              "device": torch.cuda.get_device_name(), "configs": CONFIGS, "records": measure(args)}
    result["seconds"] = round(time.time() - started, 1)
    (out / "launch_shape_probe.json").write_text(json.dumps(result, indent=1))
    print(f"launch_shape_probe: {len(result['records'])} records in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
