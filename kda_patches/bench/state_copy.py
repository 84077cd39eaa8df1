"""State-copy benchmark (seed 000 method): fused plan, fallback plan, torch-native indexing.

Every implementation gets the same cache (``[rows, H, V, K]`` with a page gap), the same index and
flag sets and the same packed inputs, and allocates its own output inside the timed region (what a
production call does). In each round the order of the implementations is shuffled. Modes: eager
event, synchronized wall, host enqueue, and graph replay (``--graph-calls`` captured calls with
rotating index sets). The floor is ``2 * S * payload bytes`` over a device-to-device copy ceiling
measured in the same run. All raw samples, the source hash, versions and the Triton compiler
entries seen after seal are written to a JSON file that must not exist yet.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch

from kda_patches.bench import timing
from kda_patches.bench.entries import CompilerEntryCounter
from kda_patches.bench.host import measure_host_breakdown
from kda_patches.bench.report import print_table, summarize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPS = ("gather", "scatter")


def source_hash() -> str:
    """Return the sha256 of the state-copy and benchmark sources (sorted by path)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted([*root.joinpath("state_copy").glob("*.py"), *root.joinpath("bench").glob("*.py")]):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build_cache(device: torch.device, dtype: torch.dtype, rows: int, inner: list[int], gap: int) -> torch.Tensor:
    """Return a random cache ``[rows, H, V, K]`` whose rows are ``gap`` items apart (page gaps)."""
    payload = inner[0] * inner[1] * inner[2]
    backing = torch.empty(rows * (payload + gap), dtype=dtype, device=device)
    backing.view(torch.uint8).random_(0, 127)  # finite, varied bit patterns
    return backing.as_strided((rows, *inner), (payload + gap, inner[1] * inner[2], inner[2], 1))


def random_selections(state: torch.Tensor, selected: int, sets: int, generator: torch.Generator,
                      final: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Return ``sets`` random INT32 row selections of ``selected`` distinct rows of ``state``, as many flag vectors
    (75 % true) and one ``[selected, ...]`` tensor of random final states in ``final``, all on ``state``'s
    device, drawn from ``generator`` in that order (so a seed reproduces a run)."""
    device = state.device
    index_sets = [torch.randperm(state.shape[0], generator=generator)[:selected].to(device=device, dtype=torch.int32)
                  for _ in range(sets)]
    flag_sets = [(torch.rand(selected, generator=generator) < 0.75).to(device) for _ in range(sets)]
    last = torch.randn((selected, *state.shape[1:]), generator=generator).to(device=device, dtype=final)
    return index_sets, flag_sets, last


def native_gather(state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """What the forks do today: index, then clear the rows without an initial state (no sync)."""
    packed = state[indices]
    return packed.masked_fill_(~flags.view(-1, 1, 1, 1), 0)


def native_scatter(state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
    """What the forks do today: ``state[indices] = final.to(state.dtype)`` (index_put)."""
    state[indices] = packed.to(state.dtype)


def prepare_implementations(state: torch.Tensor, max_selected: int, args: argparse.Namespace
                            ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Prepare and seal the plans; return ``{impl: {op: callable}}`` and their descriptions."""
    from kda_patches.state_copy.plan import FallbackStatePlan, FusedStatePlan

    plans = {"fused": FusedStatePlan.prepare(state, max_selected),
             "fallback": FallbackStatePlan.prepare(state, max_selected)}
    for name, plan_class, variants in (("fused", FusedStatePlan, args.fused_variants),
                                       ("fallback", FallbackStatePlan, args.fallback_variants)):
        for block, warps, stream in variants:
            label = f"{name}-{block}" + (f"w{warps}" if warps else "") + ("-stream" if stream else "")
            plans[label] = plan_class.prepare(state, max_selected, block_bytes=block, num_warps=warps,
                                              stream=stream)
    impls: dict[str, dict[str, Any]] = {}
    for name, plan in plans.items():
        plan.seal()
        impls[name] = {"gather": plan.gather, "scatter": plan.scatter}
    impls["torch-native"] = {"gather": native_gather, "scatter": native_scatter}
    if not args.no_reference:
        reference = ContiguousCopyReference(state)
        impls[REFERENCE] = {"gather": reference.gather, "scatter": reference.scatter}
    return impls, {name: plan.describe() for name, plan in plans.items()}


REFERENCE = "reference-contiguous-copy"


class ContiguousCopyReference:
    """Not a state copy: the same bytes moved by ``Tensor.copy_`` between contiguous buffers.

    Gather allocates ``[S, H, V, K]`` and copies a contiguous window of a separate slab into it;
    scatter copies the packed states into a window. Windows rotate call by call (like the index
    sets), so this is what a plain contiguous copy of the same size achieves under the same
    allocation and L2 conditions: a practical floor next to the bandwidth floor.
    """

    def __init__(self, state: torch.Tensor) -> None:
        self.inner = tuple(state.shape[1:])
        self.payload = state[0].numel()
        self.rows = state.shape[0]
        self.slab = torch.empty(self.rows * self.payload, dtype=state.dtype, device=state.device).random_(0, 7)
        self.calls = 0

    def window(self, count: int) -> torch.Tensor:
        """Return the next ``[count, H, V, K]`` window of the slab (rotating)."""
        windows = max(self.rows // max(count, 1), 1)
        start = (self.calls % windows) * count * self.payload
        self.calls += 1
        return self.slab[start:start + count * self.payload].view(count, *self.inner)

    def gather(self, state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        count = indices.shape[0]
        return torch.empty((count, *self.inner), dtype=state.dtype, device=state.device).copy_(self.window(count))

    def scatter(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
        self.window(indices.shape[0]).copy_(packed)


def make_calls(impl: dict[str, Any], state: torch.Tensor, index_sets: list[torch.Tensor],
               flag_sets: list[torch.Tensor], packed: torch.Tensor) -> dict[str, timing.Call]:
    """Bind one implementation to the shared inputs: ``call(step)`` uses index set ``step % len``."""
    count = len(index_sets)

    def gather(step: int) -> torch.Tensor:
        return impl["gather"](state, index_sets[step % count], flag_sets[step % count])

    def scatter(step: int) -> None:
        impl["scatter"](state, packed, index_sets[step % count])

    return {"gather": gather, "scatter": scatter}


def check_correctness(impls: dict[str, dict[str, Any]], state: torch.Tensor, indices: torch.Tensor,
                      flags: torch.Tensor, packed: torch.Tensor) -> None:
    """Refuse to time an implementation whose gather or scatter disagrees with the naive twin."""
    from kda_patches.state_copy import naive

    expected = naive.gather_states(state, indices, flags)
    saved = state[indices].clone()
    for name, impl in impls.items():
        if name == REFERENCE:
            continue
        if not torch.equal(impl["gather"](state, indices, flags), expected):
            raise RuntimeError(f"{name} gather disagrees with the naive twin")
        impl["scatter"](state, packed, indices)
        if not torch.equal(state[indices], packed.to(state.dtype)):
            raise RuntimeError(f"{name} scatter disagrees with the naive twin")
        state[indices] = saved


def measure_case(impls: dict[str, dict[str, Any]], state: torch.Tensor, selected: int, args: argparse.Namespace,
                 generator: torch.Generator, shuffler: random.Random) -> list[dict[str, Any]]:
    """Measure every implementation and op for one (dtype, selected) case; return raw sample records."""
    device = state.device
    index_sets, flag_sets, packed = random_selections(state, selected, max(args.graph_calls, 1), generator,
                                                      state.dtype)
    check_correctness(impls, state, index_sets[0], flag_sets[0], packed)
    calls = {(name, op): call for name, impl in impls.items()
             for op, call in make_calls(impl, state, index_sets, flag_sets, packed).items()}
    samples = timing.measure_rounds(calls, args.trials, args.graph_calls, device, shuffler, args.graph_instances)
    return [{"dtype": str(state.dtype).removeprefix("torch."), "selected": selected, "impl": impl, "op": op,
             "mode": mode, "samples_us": values, "median_us": timing.median(values)}
            for (impl, op, mode), values in samples.items()]


def collect_versions(device: torch.device) -> dict[str, Any]:
    """Return torch/triton/CUDA versions and the device name."""
    import platform

    import triton

    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        versions["device_name"] = torch.cuda.get_device_name(device)
    return versions


def resolve_run_target(args: argparse.Namespace) -> tuple[Path, torch.device] | None:
    """Return the new output file and the benchmark device of ``args``, or None (reason printed) when refused.

    A run never overwrites an earlier result file; a CUDA device is pinned as current for the whole run.
    """
    output = Path(args.output)
    if output.exists():
        print(f"kda-patches bench: {output} already exists; every run writes a new file", flush=True)
        return None
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("kda-patches bench: no CUDA device (use --device cpu with TRITON_INTERPRET=1 for a smoke run)")
        return None
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    return output, device


class BenchRun:
    """What every benchmark run shares: its output file, device, seeded generator and shuffler, the copy
    ceiling measured first, and the Triton compiler-entry counter (entered around the measured cases)."""

    def __init__(self, args: argparse.Namespace, output: Path, device: torch.device) -> None:
        self.args = args
        self.output = output
        self.device = device
        self.generator = torch.Generator().manual_seed(args.seed)
        self.shuffler = random.Random(args.seed)
        self.ceiling = timing.measure_copy_ceiling(device) if device.type == "cuda" else None
        self.counter = CompilerEntryCounter(tuple(getattr(args, "foreign_kernels", ())))

    @classmethod
    def begin(cls, args: argparse.Namespace) -> BenchRun | None:
        """Return the run of ``args``, or None (reason printed) when the output exists or the device refuses."""
        target = resolve_run_target(args)
        return None if target is None else cls(args, *target)

    def release(self) -> None:
        """Give the measured case's memory back before the next one (CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def finish(self, benchmark: str, plans: dict[str, Any], records: list[dict[str, Any]], summarize: Any,
               plot: Any, show: Any, **extra: Any) -> int:
        """Write the result (raw records, argv, source hash, versions, ceiling, compiler entries, summary, plot).

        Args:
            benchmark: the result's ``benchmark`` name.
            plans, records: the prepared plans' descriptions and the raw sample records.
            summarize, plot, show: ``result -> summary``, ``(result, path) -> path | None``, ``result -> None``.
            extra: more top-level result fields.
        Returns:
            0 (the JSON file is created exclusively, the table printed).
        """
        result = {"benchmark": benchmark, **extra, "argv": dict(vars(self.args)), "source_sha256": source_hash(),
                  "versions": collect_versions(self.device), "copy_ceiling": self.ceiling,
                  "compiler_entries_after_seal": self.counter.counts, "plans": plans, "records": records}
        if self.counter.foreign:
            result["peer_jit_entries"] = dict(self.counter.foreign)
        result["summary"] = summarize(result)
        plot_path = Path(self.args.plot) if self.args.plot else self.output.with_suffix(".png")
        result["summary"]["plot"] = plot(result, plot_path)
        with self.output.open("x") as handle:
            json.dump(result, handle, indent=1, default=str)
        show(result)
        return 0


def run_benchmark(args: argparse.Namespace) -> int:
    """Run the state-copy benchmark described by ``args`` (see ``kda_patches.bench.cli``).

    Returns:
        0 on success, 2 when the output exists or the device cannot run it.
    """
    from kda_patches.bench.plot import plot_results

    run = BenchRun.begin(args)
    if run is None:
        return 2
    records: list[dict[str, Any]] = []
    plans: dict[str, Any] = {}
    for dtype_name in args.dtypes.split(","):
        state = build_cache(run.device, DTYPES[dtype_name], args.rows, args.inner, args.gap_items)
        impls, plans[dtype_name] = prepare_implementations(state, max(args.selected), args)
        with run.counter:
            for selected in args.selected:
                records.extend(measure_case(impls, state, selected, args, run.generator, run.shuffler))
        del impls, state
        run.release()
    host = measure_host_breakdown(run.device, args) if run.device.type == "cuda" else None
    return run.finish("state-copy", plans, records, summarize, plot_results, print_table, host_breakdown=host)
