"""GDN prefill state-copy benchmark (seed 000 method): upstream's native pattern vs the sealed plans.

What every GDN layer's prefill does around its chunk rule, upstream and in the forks::

    initial = ssm_state[indices]                 # gather
    initial[~has_initial_state, ...] = 0         # clear (boolean-mask index_put -> masked_fill)
    ssm_state[indices] = last.to(ssm_state.dtype)  # scatter of the final states

against the plan's flagged gather and its scatter with the cast folded in (final states read in their
own dtype). Also ``plan+torch-cast`` (the plan's scatter after a separate ``last.to(cache dtype)``,
what the plan did before the fold) where the dtypes differ. Ops: ``gather``, ``scatter`` and ``pair``
(gather then scatter in one call: the acceptance number). Shapes are the per-rank GDN states of the
models (``--shapes``), cases are ``cache:final`` dtype pairs (``--cases``).

Method as :mod:`kda_patches.bench.state_copy`: one process, the same cache, index and flag sets and
final states for every implementation, each allocating its own outputs inside the timed region,
order shuffled per round, eager event / synchronized wall / host enqueue / graph replay reported
separately, all raw samples, the source hash and the Triton entries after seal, into a JSON file
that must not exist. Floors come from the device-to-device copy ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch

from kda_patches.bench import timing
from kda_patches.bench.state_copy import DTYPES, BenchRun, ContiguousCopyReference, build_cache, random_selections

NATIVE, PLAN, PLAN_TORCH_CAST, PLAN_PDL = "native", "plan", "plan+torch-cast", "plan+pdl"
COPY = "copy"  # scatter only: the same bytes moved by torch into a contiguous buffer (no index): a size-matched floor


def parse_shapes(text: str) -> list[tuple[str, list[int]]]:
    """Parse ``"name=12,128,128;other=8,128,128"`` into ``[(name, [H, V, K]), ...]``."""
    shapes = []
    for part in text.split(";"):
        if part.strip():
            name, _, dims = part.partition("=")
            shapes.append((name.strip(), [int(d) for d in dims.split(",")]))
    return shapes


def parse_cases(text: str) -> list[tuple[str, str]]:
    """Parse ``"float32:float32,bfloat16:float32"`` into ``[(cache dtype, final dtype), ...]``."""
    cases = []
    for part in text.split(","):
        if part.strip():
            cache, _, final = part.strip().partition(":")
            cases.append((cache, final or cache))
    return cases


def native_gather(state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """Upstream's gather and clear, as written in the GDN layers."""
    initial = state[indices]
    initial[~flags, ...] = 0
    return initial


def native_scatter(state: torch.Tensor, last: torch.Tensor, indices: torch.Tensor) -> None:
    """Upstream's scatter: ``ssm_state[indices] = last.to(ssm_state.dtype)``."""
    state[indices] = last.to(state.dtype)


def build_impls(state: torch.Tensor, final: torch.dtype, max_selected: int,
                pdl: bool = False) -> tuple[dict[str, Any], Any]:
    """Return ``{impl: (gather, scatter)}`` and the sealed binding (prepared for the one final dtype); with ``pdl``
    also the plan compiled with programmatic dependent launch (``plan+pdl``) where the target honours it."""
    from kda_patches.state_copy.worker import initialize

    binding = initialize({"bench.gdn": state}, max_selected, final_dtypes=(final,))["bench.gdn"]
    impls: dict[str, Any] = {NATIVE: (native_gather, native_scatter), PLAN: (binding.gather, binding.scatter)}
    if final != state.dtype:
        cast_binding = initialize({"bench.gdn.cast": state}, max_selected)["bench.gdn.cast"]

        def scatter_after_cast(cache: torch.Tensor, last: torch.Tensor, indices: torch.Tensor) -> None:
            cast_binding.scatter(cache, last.to(cache.dtype), indices)

        impls[PLAN_TORCH_CAST] = (cast_binding.gather, scatter_after_cast)
    if pdl:
        pdl_binding = initialize({"bench.gdn.pdl": state}, max_selected, final_dtypes=(final,), pdl=True)
        described = pdl_binding["bench.gdn.pdl"].plan.describe()
        if described["pdl"]:
            impls[PLAN_PDL] = (pdl_binding["bench.gdn.pdl"].gather, pdl_binding["bench.gdn.pdl"].scatter)
        else:
            print(f"kda-patches bench: {PLAN_PDL} is not measured: {described['memory_hints']['dropped']}")
    return impls, binding


def make_calls(impls: dict[str, Any], state: torch.Tensor, index_sets: list[torch.Tensor],
               flag_sets: list[torch.Tensor], last: torch.Tensor) -> dict[tuple[str, str], timing.Call]:
    """Bind each implementation's gather, scatter and pair to the shared inputs (index set ``step % n``)."""
    count = len(index_sets)
    calls: dict[tuple[str, str], timing.Call] = {}
    for name, (gather, scatter) in impls.items():
        def gather_call(step: int, gather: Any = gather) -> torch.Tensor:
            return gather(state, index_sets[step % count], flag_sets[step % count])

        def scatter_call(step: int, scatter: Any = scatter) -> None:
            scatter(state, last, index_sets[step % count])

        def pair_call(step: int, gather: Any = gather, scatter: Any = scatter) -> torch.Tensor:
            initial = gather(state, index_sets[step % count], flag_sets[step % count])
            scatter(state, last, index_sets[step % count])
            return initial

        calls.update({(name, "gather"): gather_call, (name, "scatter"): scatter_call, (name, "pair"): pair_call})
    return calls


def check_correctness(impls: dict[str, Any], state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor,
                      last: torch.Tensor) -> None:
    """Refuse to time an implementation whose gather or scatter is not bit-equal to the naive twin."""
    from kda_patches.state_copy import naive

    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[state.dtype]
    expected = naive.gather_states(state, indices, flags).view(bits)
    saved = state[indices].clone()
    for name, (gather, scatter) in impls.items():
        if not torch.equal(gather(state, indices, flags).view(bits), expected):
            raise RuntimeError(f"{name} gather disagrees with the naive twin")
        scatter(state, last, indices)
        if not torch.equal(state[indices].view(bits), last.to(state.dtype).view(bits)):
            raise RuntimeError(f"{name} scatter disagrees with the naive twin (torch's .to() cast)")
        state[indices] = saved


def measure_case(impls: dict[str, Any], state: torch.Tensor, final: torch.dtype, selected: int,
                 args: argparse.Namespace, generator: torch.Generator, shuffler: random.Random
                 ) -> dict[tuple[str, ...], list[float]]:
    """Measure every implementation and op for one (shape, cache dtype, final dtype, selected) case."""
    device = state.device
    sets = max(args.graph_calls, 1)
    index_sets, flag_sets, last = random_selections(state, selected, sets, generator, final)
    check_correctness(impls, state, index_sets[0], flag_sets[0], last)
    calls = make_calls(impls, state, index_sets, flag_sets, last)
    # what moving these bytes costs at this size without any indexing: the state-copy benchmark's contiguous
    # reference (read the finals in their dtype, write the cache dtype into a rotating window of a contiguous
    # slab: torch's copy_, a memcpy when the dtypes match, else its cast)
    reference = ContiguousCopyReference(state)
    calls[(COPY, "scatter")] = lambda step: reference.scatter(state, last, index_sets[step % sets])
    return timing.measure_rounds(calls, args.trials, args.graph_calls, device, shuffler, args.graph_instances)


def run_gdn_benchmark(args: argparse.Namespace, extra_impls: dict[str, Any] | None = None,
                      extra_fields: dict[str, Any] | None = None) -> int:
    """Run the GDN state-copy benchmark described by ``args`` (see ``kda_patches.bench.cli``).

    Args:
        args: the parsed options.
        extra_impls: more ``{name: (gather, scatter)}`` measured beside native and plan (``bench peer``), with
            the same correctness check first.
        extra_fields: more top-level fields of the result JSON.
    Returns:
        0 on success, 2 when the output exists or the device cannot run it.
    """
    from kda_patches.bench.gdn_report import plot_gdn, print_gdn_table, summarize_gdn

    run = BenchRun.begin(args)
    if run is None:
        return 2
    records: list[dict[str, Any]] = []
    plans: dict[str, Any] = {}
    for shape_name, inner in parse_shapes(args.shapes):
        for cache_name, final_name in parse_cases(args.cases):
            state = build_cache(run.device, DTYPES[cache_name], args.rows, inner, args.gap_items)
            impls, binding = build_impls(state, DTYPES[final_name], max(args.selected), getattr(args, "pdl", False))
            impls.update(extra_impls or {})
            plans[f"{shape_name}/{cache_name}:{final_name}"] = binding.plan.describe()
            with run.counter:
                for selected in args.selected:
                    samples = measure_case(impls, state, DTYPES[final_name], selected, args, run.generator,
                                           run.shuffler)
                    records.extend({"shape": shape_name, "inner": inner, "dtype": cache_name, "final_dtype": final_name,
                                    "selected": selected, "impl": impl, "op": op, "mode": mode,
                                    "samples_us": values, "median_us": timing.median(values)}
                                   for (impl, op, mode), values in samples.items())
            del impls, binding, state
            run.release()
    return run.finish("gdn-state-copy", plans, records, summarize_gdn, plot_gdn, print_gdn_table,
                      **(extra_fields or {}))
