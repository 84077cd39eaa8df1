"""Benchmarks of the overlay (``kda-patches bench ...``); only ``state-copy`` for now.

``main(argv)`` is the entry point ``kda_patches.cli`` delegates to; importing this package imports
neither torch nor triton (the benchmark modules do, when a benchmark runs).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run ``kda-patches bench SUBCOMMAND ...``; see :func:`kda_patches.bench.cli.main`."""
    from kda_patches.bench.cli import main as cli_main

    return cli_main(argv)
