"""Summary, target checks, table and plot of a GDN state-copy benchmark result (``bench gdn-state-copy``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kda_patches.bench.plot import load_pyplot
from kda_patches.bench.report import close_summary, target_check
from kda_patches.bench.stats import capture_medians

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GDN_TARGETS = {
    "pair_speedup_vs_native_min": 2.0,  # >= 64 rows, FP32 cache + FP32 finals and BF16 cache + FP32 finals
    "scatter_graph_over_floor_max": 1.10,  # graph replay, >= 64 rows
}
SPEEDUP_CASES = (("float32", "float32"), ("bfloat16", "float32"))
MODES = ("graph", "event", "wall", "enqueue")
OWN_IMPLS = ("native", "plan", "plan+torch-cast", "plan+pdl", "copy")  # any other impl is a peer (``bench peer``)
PEER_LEAD = 1.10  # the plan ahead of a peer by this much somewhere is what would justify an overlay plan there
# what a peer is compared with: the plan as ``KDA_PATCHES_PDL=auto`` builds it where the run measured that
# (``--pdl``: launched with PDL on SM90+, plain elsewhere), else the plain plan
PEER_REFERENCES = ("plan+pdl", "plan")


def peer_reference(impls: set[str]) -> str:
    """Return the first of :data:`PEER_REFERENCES` among the measured ``impls`` (``"plan"`` if neither is)."""
    return next((name for name in PEER_REFERENCES if name in impls), "plan")


def graph_instances_of(result: dict[str, Any]) -> int:
    """Captures per implementation of ``result``: its ``argv``'s ``graph_instances``, else 1 (older results)."""
    argv = result.get("argv")
    return int(argv.get("graph_instances") or 1) if isinstance(argv, dict) else 1


def floor_us(result: dict[str, Any], inner: list[int], cache: str, final: str, selected: int, op: str
             ) -> float | None:
    """Return the bytes / copy-ceiling floor of one op in microseconds (None without a ceiling).

    The scatter reads the finals in their dtype and writes the cache dtype; the gather reads and writes
    the cache dtype; the pair is both.
    """
    ceiling = result.get("copy_ceiling")
    if not ceiling:
        return None
    items = selected * inner[0] * inner[1] * inner[2]
    scatter = items * (ELEMENT_BYTES[final] + ELEMENT_BYTES[cache])
    gather = items * 2 * ELEMENT_BYTES[cache]
    moved = {"scatter": scatter, "gather": gather, "pair": scatter + gather}[op]
    return moved / ceiling["bytes_per_s"] * 1e6


def summarize_gdn(result: dict[str, Any]) -> dict[str, Any]:
    """Return one row per (shape, cache, final, selected, op) with every impl's medians, and the checks."""
    table: dict[tuple[Any, ...], dict[str, dict[str, float]]] = {}
    graph_samples: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    inners = {}
    for record in result["records"]:
        key = (record["shape"], record["dtype"], record["final_dtype"], record["selected"], record["op"])
        inners[record["shape"]] = record["inner"]
        table.setdefault(key, {}).setdefault(record["impl"], {})[record["mode"]] = record["median_us"]
        if record["mode"] == "graph" and record.get("samples_us"):
            graph_samples.setdefault(key, {})[record["impl"]] = record["samples_us"]
    reference_name = peer_reference({impl for impls in table.values() for impl in impls})
    instances = graph_instances_of(result)
    rows = []
    checks: dict[str, Any] = {}
    for key in sorted(table, key=lambda k: (k[0], k[1], k[2], k[4], k[3])):
        shape, cache, final, selected, op = key
        impls = table[key]
        floor = floor_us(result, inners[shape], cache, final, selected, op)
        row: dict[str, Any] = {"shape": shape, "dtype": cache, "final_dtype": final, "selected": selected,
                               "op": op, "floor_us": floor, "impls": impls}
        native, plan = impls.get("native", {}), impls.get("plan", {})
        row["speedup_vs_native"] = {mode: native[mode] / plan[mode] for mode in MODES
                                    if native.get(mode) and plan.get(mode)}
        row["plan_graph_over_floor"] = plan["graph"] / floor if plan.get("graph") and floor else None
        copy = impls.get("copy", {})
        row["plan_graph_over_copy"] = plan["graph"] / copy["graph"] if plan.get("graph") and copy.get("graph") else None
        row["copy_graph_over_floor"] = copy["graph"] / floor if copy.get("graph") and floor else None
        # peer / reference plan per mode: > 1 means the plan is faster than that peer
        reference = impls.get(reference_name, {})
        row_peers = [name for name in impls if name not in OWN_IMPLS]
        row["plan_speedup_vs_peer"] = {name: {mode: impls[name][mode] / reference[mode] for mode in MODES
                                              if impls[name].get(mode) and reference.get(mode)} for name in row_peers}
        samples = graph_samples.get(key, {})
        if reference_name in samples:  # per capture block: a capture's placement shows as one block apart
            ours = capture_medians(samples[reference_name], instances)
            row["peer_capture_ratios"] = {
                name: [theirs / own
                       for theirs, own in zip(capture_medians(samples[name], instances), ours, strict=True)]
                for name in row_peers if name in samples}
        rows.append(row)
        tag = f"{shape}/{cache}:{final}/{selected}"
        if selected >= 64 and op == "pair" and (cache, final) in SPEEDUP_CASES:
            for mode in ("graph", "wall"):
                checks[f"pair_speedup_vs_native[{mode}] {tag}"] = target_check(
                    row["speedup_vs_native"].get(mode), GDN_TARGETS["pair_speedup_vs_native_min"], "min")
        if selected >= 64 and op == "scatter":
            checks[f"scatter_graph_over_floor {tag}"] = target_check(
                row["plan_graph_over_floor"], GDN_TARGETS["scatter_graph_over_floor_max"], "max")
            if row["plan_graph_over_copy"] is not None:  # the same bound against torch's copy of those bytes
                checks[f"scatter_graph_over_contiguous_copy {tag}"] = target_check(
                    row["plan_graph_over_copy"], GDN_TARGETS["scatter_graph_over_floor_max"], "max")
    summary = close_summary(result, rows, checks, GDN_TARGETS)
    peers = sorted({name for row in rows for name in row["plan_speedup_vs_peer"]})
    if peers:
        summary["peer_reference"] = reference_name
        summary["peers"] = {name: peer_verdict(rows, name) for name in peers}
    return summary


def peer_verdict(rows: list[dict[str, Any]], peer: str) -> dict[str, Any]:
    """Return where the reference plan (:func:`peer_reference`) leads ``peer`` by :data:`PEER_LEAD` or more in
    graph replay (the operator's question: is an overlay plan worth offering where the fork has its own), where it
    is behind (ratio below 1, with the range of its per-capture ratios), and the range of graph-replay ratios."""
    ratios = [(row, row["plan_speedup_vs_peer"][peer]["graph"]) for row in rows
              if row["plan_speedup_vs_peer"].get(peer, {}).get("graph")]

    def where(row: dict[str, Any]) -> str:
        return f"{row['shape']} {row['dtype']}:{row['final_dtype']} S={row['selected']} {row['op']}"

    leads = [f"{where(row)} {ratio:.2f}x" for row, ratio in ratios if ratio >= PEER_LEAD]
    behind = []
    for row, ratio in ratios:
        if ratio < 1:
            captures = row.get("peer_capture_ratios", {}).get(peer)
            behind.append(f"{where(row)} {ratio:.3f}x"
                          + (f" (captures {min(captures):.3f}-{max(captures):.3f})" if captures else ""))
    values = [ratio for _, ratio in ratios]
    return {"graph_ratio_min": min(values, default=None), "graph_ratio_max": max(values, default=None),
            "plan_leads_by_10pct": leads, "plan_behind": behind}


def _show(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def print_gdn_table(result: dict[str, Any]) -> None:
    """Print native vs plan medians (graph replay and synchronized wall) per case, then the checks."""
    ceiling = result.get("copy_ceiling")
    if ceiling:
        print(f"copy ceiling: {ceiling['bytes_per_s'] / 1e12:.3f} TB/s (read + write)")
    print("shape / cache:final / rows / op | native graph, wall | plan graph, wall | speedup graph, wall | "
          "plan graph / floor")
    for row in result["summary"]["rows"]:
        native, plan = row["impls"].get("native", {}), row["impls"].get("plan", {})
        speed = row["speedup_vs_native"]
        ratio = row["plan_graph_over_floor"]
        extra = row["impls"].get("plan+torch-cast")
        copy = row["impls"].get("copy")
        print(f"{row['shape']} {row['dtype']}:{row['final_dtype']} S={row['selected']:<4} {row['op']:<7} | "
              f"{_show(native.get('graph'))}, {_show(native.get('wall'))} | {_show(plan.get('graph'))}, "
              f"{_show(plan.get('wall'))} | {speed.get('graph', 0):.2f}x, {speed.get('wall', 0):.2f}x | "
              + (f"{ratio:.2f}x" if ratio else "-")
              + (f" | plan+torch-cast graph {_show(extra.get('graph'))}" if extra else "")
              + (f" | contiguous copy graph {_show(copy.get('graph'))} ({row['copy_graph_over_floor']:.2f}x floor;"
                 f" plan {row['plan_graph_over_copy']:.2f}x copy)" if copy and row["plan_graph_over_copy"] else ""))
    reference = result["summary"].get("peer_reference", "plan")
    for row in result["summary"]["rows"]:
        for peer, ratios in row.get("plan_speedup_vs_peer", {}).items():
            graph = row["impls"][peer].get("graph")
            print(f"{row['shape']} {row['dtype']}:{row['final_dtype']} S={row['selected']:<4} {row['op']:<7} | "
                  f"{peer} graph {_show(graph)}, wall {_show(row['impls'][peer].get('wall'))} | {reference} faster "
                  f"by {ratios.get('graph', 0):.3f}x graph, {ratios.get('wall', 0):.2f}x wall")
    for peer, verdict in result["summary"].get("peers", {}).items():
        behind = verdict.get("plan_behind", [])
        print(f"peer {peer}: peer/{reference} graph-replay time {verdict['graph_ratio_min']:.3f}-"
              f"{verdict['graph_ratio_max']:.3f}x; {reference} ahead by >= {(PEER_LEAD - 1) * 100:.0f} % in "
              f"{len(verdict['plan_leads_by_10pct'])} rows, behind in {len(behind)}"
              + (": " + "; ".join(behind) if behind else ""))
    for name, check in result["summary"]["checks"].items():
        value = check["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"check {name}: {shown} (target {check.get('kind', '==')} {check['target']}) met={check['met']}")


def plot_gdn(result: dict[str, Any], path: Path) -> str | None:
    """Draw one panel per (shape, cache:final): graph-replay pair and scatter per impl, with floors.

    Returns:
        The path written, or None when matplotlib is missing, there are no graph timings, or ``path`` exists.
    """
    plt = load_pyplot()
    if plt is None:
        return None
    graph = [r for r in result["records"] if r["mode"] == "graph"]
    if not graph or path.exists():
        return None
    panels = sorted({(r["shape"], r["dtype"], r["final_dtype"]) for r in graph})
    columns = min(len(panels), 3)
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6.2 * columns, 4.6 * rows), squeeze=False)
    for number, (shape, cache, final) in enumerate(panels):
        axis = axes[number // columns][number % columns]
        records = [r for r in graph if (r["shape"], r["dtype"], r["final_dtype"]) == (shape, cache, final)]
        inner = records[0]["inner"]
        selected = sorted({r["selected"] for r in records})
        for impl in sorted({r["impl"] for r in records}):
            for op, style in (("pair", "-"), ("scatter", "--")):
                points = sorted((r["selected"], r["median_us"]) for r in records if r["impl"] == impl and r["op"] == op)
                if points:
                    axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", linestyle=style,
                              label=f"{impl} {op}")
        for op, style in (("pair", ":"), ("scatter", "-.")):
            floors = [floor_us(result, inner, cache, final, count, op) for count in selected]
            if all(floors):
                axis.plot(selected, floors, linestyle=style, color="black", label=f"{op} floor (bytes / D2D ceiling)")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("selected rows")
        axis.set_ylabel("graph replay median per call (us)")
        axis.set_title(f"{shape} [N, {', '.join(map(str, inner))}] cache {cache}, finals {final}", fontsize=9)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=6)
    for number in range(len(panels), rows * columns):
        axes[number // columns][number % columns].axis("off")
    figure.suptitle(f"GDN prefill state copy: native gather/clear/scatter vs plan (cast folded), "
                    f"{result['argv']['rows']} cache rows + gap {result['argv']['gap_items']} items")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    """Print a saved GDN or ``bench peer`` result's table and checks with today's summary (peer ratios against
    :func:`peer_reference`, per-capture ratios of the rows behind), without touching the file.

    Usage: ``python -m kda_patches.bench.gdn_report RESULT.json[.xz]``. Returns 0, or 2 when the file is missing.
    """
    import argparse

    from kda_patches.results_io import read_json

    parser = argparse.ArgumentParser(description="print a saved GDN or `bench peer` result with today's summary")
    parser.add_argument("result", help="a `bench gdn-state-copy` or `bench peer` JSON (.json or .json.xz)")
    args = parser.parse_args(argv)
    try:
        result = read_json(args.result)
    except FileNotFoundError as error:
        print(f"gdn_report: {error}")
        return 2
    result["summary"] = summarize_gdn(result)
    print_gdn_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
