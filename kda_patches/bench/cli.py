"""Command line of the benchmarks: ``kda-patches bench state-copy|gdn-state-copy --output FILE --seed N ...``."""

from __future__ import annotations

import argparse
import sys


def parse_ints(text: str) -> list[int]:
    """Parse ``"1,8,64"`` into ``[1, 8, 64]``."""
    return [int(part) for part in text.split(",") if part.strip()]


def parse_variants(text: str) -> list[tuple[int, int | None, bool]]:
    """Parse ``"16384/4,65536,8192/4/stream"`` into ``[(16384, 4, False), (65536, None, False), (8192, 4, True)]``.

    Each item is tile bytes, warps (optional) and ``stream`` (optional: evict_first hints, fused only).
    """
    variants = []
    for part in text.split(","):
        if part.strip():
            fields = part.strip().split("/")
            warps = int(fields[1]) if len(fields) > 1 and fields[1] else None
            variants.append((int(fields[0]), warps, len(fields) > 2 and fields[2] == "stream"))
    return variants


def build_parser() -> argparse.ArgumentParser:
    """Return the ``kda-patches bench`` argument parser."""
    parser = argparse.ArgumentParser(prog="kda-patches bench", description="benchmarks of the overlay")
    commands = parser.add_subparsers(dest="benchmark", required=True)
    state = commands.add_parser("state-copy", help="fused/fallback state-copy plans vs torch-native indexing "
                                "(seed 000 method: shuffled rounds, eager/wall/enqueue/graph, copy floor)")
    state.add_argument("--output", required=True, help="JSON file to write (must not exist)")
    state.add_argument("--seed", type=int, default=0, help="RNG seed of indices, flags and data")
    state.add_argument("--trials", type=int, default=30, help="rounds per case (each round shuffles the order)")
    state.add_argument("--plot", default=None, help="PNG plot path (default: OUTPUT with .png)")
    state.add_argument("--device", default="cuda", help="cuda (default) or cpu (TRITON_INTERPRET=1 smoke run)")
    state.add_argument("--rows", type=int, default=2048, help="cache rows N")
    state.add_argument("--inner", type=parse_ints, default=[12, 128, 128], help="H,V,K")
    state.add_argument("--gap-items", type=int, default=8192, help="page gap between rows, in items")
    state.add_argument("--selected", type=parse_ints, default=[1, 8, 64, 256], help="selected counts")
    state.add_argument("--dtypes", default="float32,bfloat16", help="cache dtypes")
    state.add_argument("--graph-calls", type=int, default=100, help="calls captured per CUDA graph")
    add_graph_instances(state)
    state.add_argument("--no-reference", action="store_true",
                       help="skip the contiguous torch copy of the same bytes (a reference, not a state copy)")
    state.add_argument("--fused-variants", type=parse_variants, default=[],
                       help="extra fused configurations, BYTES[/WARPS[/stream]][,...], e.g. 16384/4,8192/4/stream")
    state.add_argument("--fallback-variants", type=parse_variants, default=[],
                       help="extra fallback configurations to measure, BYTES[/WARPS][,...]")
    add_gdn_parser(commands)
    peer = add_gdn_parser(commands, "peer", "the fork's released GDN state-copy kernels (vllm-ascend 0.30 "
                          "gather_ssm_states / scatter_ssm_states_, from the release cache) beside native and plan")
    from kda_patches.bench.peer import DEFAULT_RELEASE

    peer.add_argument("--release", default=DEFAULT_RELEASE,
                      help=f"the fork release (default {DEFAULT_RELEASE}), or vllm==VERSION: upstream's own "
                           "gather_initial_states / scatter_states from the vLLM this process imports")
    commands.add_parser("serve-ab", help="vLLM's own `vllm bench throughput|latency`, KDA_PATCHES=0 vs =1, shuffled "
                        "rounds, patched/baseline ratios (own options: `kda-patches bench serve-ab --help`)")
    return parser


def add_graph_instances(parser: argparse.ArgumentParser) -> None:
    """Add ``--graph-instances`` (:func:`~kda_patches.bench.timing.replay_graphs`' ``instances``) to ``parser``."""
    parser.add_argument("--graph-instances", type=int, default=5,
                        help="captures of each call as a CUDA graph, each replayed in its own block of rounds "
                             "(divides --trials; default 5): one capture's own offset (identical kernels read apart "
                             "by several per cent at 1-8 rows, docs/results/launch-shape) is spread over every "
                             "implementation")


def add_gdn_parser(commands: argparse._SubParsersAction, name: str = "gdn-state-copy",
                   description: str = "GDN prefill state copy: upstream's native gather/clear/scatter vs the "
                                      "plan's flagged gather + cast-folded scatter (seed 000 method)"
                   ) -> argparse.ArgumentParser:
    """Add ``gdn-state-copy`` (or ``name`` with the same options: ``peer``) and return its parser
    (:mod:`kda_patches.bench.gdn_state_copy`; defaults are its GDN shapes/cases)."""
    gdn = commands.add_parser(name, help=description)
    gdn.add_argument("--output", required=True, help="JSON file to write (must not exist)")
    gdn.add_argument("--seed", type=int, default=0, help="RNG seed of indices, flags and data")
    gdn.add_argument("--trials", type=int, default=30, help="rounds per case (each round shuffles the order)")
    gdn.add_argument("--plot", default=None, help="PNG plot path (default: OUTPUT with .png)")
    gdn.add_argument("--device", default="cuda", help="cuda (default) or cpu (TRITON_INTERPRET=1 smoke run)")
    gdn.add_argument("--rows", type=int, default=1024, help="cache rows N")
    gdn.add_argument("--shapes", default="qwen3.6-27b-tp4=12,128,128;qwen3.5-397b-tp8=8,128,128",
                     help="NAME=H,V,K[;...] per-rank GDN recurrent-state shapes")
    gdn.add_argument("--cases", default="float32:float32,bfloat16:float32,bfloat16:bfloat16",
                     help="CACHE:FINAL[,...] cache and final-state dtype pairs")
    gdn.add_argument("--gap-items", type=int, default=8192, help="page gap between rows, in items")
    gdn.add_argument("--selected", type=parse_ints, default=[1, 8, 64, 256], help="selected counts")
    gdn.add_argument("--graph-calls", type=int, default=50, help="calls captured per CUDA graph")
    add_graph_instances(gdn)
    gdn.add_argument("--pdl", action="store_true", help="also measure the plan compiled with programmatic dependent "
                     "launch (plan+pdl; NVIDIA SM90+, left out where the target has none)")
    return gdn


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen benchmark.

    Args:
        argv: arguments after ``bench`` (default ``sys.argv[1:]``).
    Returns:
        The exit status (0 on success, 2 for a refused output path or device).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-ab"]:  # parses its own options; everything after `--` goes to `vllm bench`
        from kda_patches.bench.serve_ab import main as serve_ab_main

        return serve_ab_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.benchmark in ("state-copy", "gdn-state-copy", "peer"):  # every parser above takes --graph-instances
        from kda_patches.bench.stats import check_graph_instances  # no torch before the refusal

        try:
            check_graph_instances(args.trials, args.graph_instances)
        except ValueError as error:
            parser.error(f"--graph-instances / --trials: {error}")
    if args.benchmark == "state-copy":
        from kda_patches.bench.state_copy import run_benchmark

        return run_benchmark(args)
    if args.benchmark == "gdn-state-copy":
        from kda_patches.bench.gdn_state_copy import run_gdn_benchmark

        return run_gdn_benchmark(args)
    if args.benchmark == "peer":
        from kda_patches.bench.peer import run_peer_benchmark

        return run_peer_benchmark(args)
    return 2
