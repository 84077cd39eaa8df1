"""Compare two sets of state-copy benchmark JSONs (before / after a kernel change), row by row.

    python scripts/compare_bench.py --before A1.json A2.json --after B1.json B2.json [--impl plan] [--metric graph]

Each file (plain ``.json``, or ``.json.xz`` as committed under docs/results) is the output of ``kda-patches
bench gdn-state-copy`` or ``bench state-copy`` (the same command line, run alternately before/after in one
session so host and device drift fall on both). Per summary row it takes the median over the files of each
side, prints after/before and flags rows more than ``--tolerance`` (default 2 %) slower. Exit status 1 when
any row is flagged.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys

# Loaded by file path: importing the kda_patches package would activate the overlay (and need wrapt).
_SPEC = importlib.util.spec_from_file_location(
    "results_io", pathlib.Path(__file__).resolve().parents[1] / "kda_patches" / "results_io.py")
results_io = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(results_io)


def row_key(row: dict) -> tuple:
    return tuple(str(row.get(name)) for name in ("shape", "dtype", "final_dtype", "selected", "op"))


def row_values(row: dict, impl: str, metric: str) -> float | None:
    if "impls" in row:  # gdn-state-copy
        return row["impls"].get(impl, {}).get(metric)
    return row.get(impl, {}).get(metric)  # state-copy: impl = fused / fallback


def collect(paths: list[str], impls: list[str], metric: str) -> dict[tuple, list[float]]:
    values: dict[tuple, list[float]] = {}
    for path in paths:
        rows = results_io.read_json(path)["summary"]["rows"]
        for row in rows:
            for impl in impls:
                value = row_values(row, impl, metric)
                if value is not None:
                    values.setdefault((*row_key(row), impl), []).append(value)
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", nargs="+", required=True)
    parser.add_argument("--after", nargs="+", required=True)
    parser.add_argument("--impl", default="plan",
                        help="implementations, comma-separated (gdn: plan; kimi: fused,fallback)")
    parser.add_argument("--metric", default="graph", help="graph, event, wall or enqueue")
    parser.add_argument("--tolerance", type=float, default=0.02)
    args = parser.parse_args(argv)
    impls = args.impl.split(",")
    before, after = collect(args.before, impls, args.metric), collect(args.after, impls, args.metric)
    flagged = 0
    print(f"{'row':70s} before  after  after/before ({args.metric}, medians of {len(args.before)}/{len(args.after)})")
    for key in sorted(set(before) & set(after)):
        old, new = statistics.median(before[key]), statistics.median(after[key])
        ratio = new / old
        mark = "  SLOWER" if ratio > 1 + args.tolerance else ""
        flagged += bool(mark)
        print(f"{' '.join(key):70s} {old:7.2f} {new:7.2f} {ratio:6.3f}{mark}")
    print(f"{flagged} of {len(set(before) & set(after))} rows more than {args.tolerance:.0%} slower")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
