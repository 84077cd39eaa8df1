"""Read a launch-shape probe result on any machine: per row, upstream 0.34's median beside each implementation's,
with the range of its per-capture medians, and how far apart identical gather kernels read.

The probe (``scripts/gpu/launch_shape_probe.py``) captures every implementation ``--graph-instances`` times, one
block of replay rounds per capture; results written before that option had one capture. Several plan labels
compile the same gather (their configurations differ only in how they scatter): those twins measure what one
capture's own offset is, with no kernel difference at all.

Usage: ``python3 scripts/gpu/probe_table.py RESULT.json[.xz] [--op gather] [--selected 1,8] [--twins]``.
"""

from __future__ import annotations

import argparse
import json
import lzma
import pathlib
import statistics
from collections import defaultdict
from typing import Any

from kda_patches.bench.stats import capture_medians

UPSTREAM = "upstream-0.34"
# labels whose gather kernels compile identically (4 KiB tile; warps 4 or 8; the rest only changes the scatter)
GATHER_TWINS = {"4 warps": ("plan 4096/4", "plan 4096/4/no-evict", "plan default", "plan default/unpinned"),
                "8 warps": ("plan 4096/8", "plan 4096/8/no-evict", "plan 4096/8/unpinned")}


def load_result(path: pathlib.Path) -> dict[str, Any]:
    """Return the probe result in ``path`` (``.xz``-compressed or plain JSON)."""
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def graph_instances(result: dict[str, Any]) -> int:
    """Captures per implementation of ``result``: its ``--graph-instances``, else 1 (runs before the option)."""
    argv = result.get("argv", [])
    return int(argv[argv.index("--graph-instances") + 1]) if "--graph-instances" in argv else 1


def rows_of(result: dict[str, Any], op: str) -> dict[tuple, dict[str, dict[str, Any]]]:
    """Return ``{(shape, cache, final, selected): {impl: {"median", "captures"}}}`` of ``op``'s records."""
    instances = graph_instances(result)
    rows: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for record in result["records"]:
        if record["op"] == op:
            key = (record["shape"], record["cache"], record["final"], record["selected"])
            rows[key][record["impl"]] = {"median": statistics.median(record["graph_us"]),
                                         "captures": capture_medians(record["graph_us"], instances)}
    return rows


def twin_spreads(row: dict[str, dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Return ``{family: (fastest, slowest median)}`` of the :data:`GATHER_TWINS` families with two or more
    members in ``row`` (a gather row of a same-dtype case: a cast case's labels are not twins)."""
    spreads = {}
    for family, labels in GATHER_TWINS.items():
        medians = [row[label]["median"] for label in labels if label in row]
        if len(medians) > 1:
            spreads[family] = (min(medians), max(medians))
    return spreads


def format_rows(result: dict[str, Any], op: str, selected: set[int] | None, twins: bool) -> list[str]:
    """Return the table's lines (upstream / implementation > 1: the implementation is faster)."""
    lines = [f"{result.get('device')} triton {result.get('triton')}, {graph_instances(result)} capture(s) each"]
    for key, row in sorted(rows_of(result, op).items()):
        if selected and key[3] not in selected:
            continue
        upstream = row[UPSTREAM]["median"]
        lines.append(f"{key[0]} {key[1]} <- {key[2]}, {key[3]} rows: upstream {upstream:.3f} us, captures "
                     + " ".join(f"{value:.3f}" for value in row[UPSTREAM]["captures"]))
        if twins:
            if op == "gather" and key[1] == key[2]:
                for family, (fast, slow) in twin_spreads(row).items():
                    lines.append(f"   twins {family}: upstream/x {upstream / slow:.3f}-{upstream / fast:.3f} "
                                 f"(spread {100 * (slow / fast - 1):.1f} %)")
            continue
        for impl, values in sorted(row.items(), key=lambda item: item[1]["median"]):
            captures = values["captures"]
            lines.append(f"   {impl:<36} {values['median']:.3f}  upstream/x {upstream / values['median']:.3f}  "
                         f"captures {min(captures):.3f}-{max(captures):.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=pathlib.Path)
    parser.add_argument("--op", choices=("gather", "scatter"), default="gather")
    parser.add_argument("--selected", default="", help="row counts to show (default all)")
    parser.add_argument("--twins", action="store_true", help="only the spread of identical gather kernels")
    args = parser.parse_args(argv)
    selected = {int(part) for part in args.selected.split(",") if part}
    print("\n".join(format_rows(load_result(args.result), args.op, selected or None, args.twins)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
