"""Summaries of a state-copy benchmark result: floors, ratios, targets, and the printed table."""

from __future__ import annotations

from typing import Any

TARGETS = {
    "fused_over_floor_max": 1.15,  # graph replay, >= 64 rows, FP32 and BF16, gather and scatter
    "fused_speedup_vs_native_64_fp32_min": 2.5,
    "fallback_over_fused_max": 2.0,  # >= 64 rows
    "eager_single_row_gather_wall_us_max": 12.0,
}


def floor_us(result: dict[str, Any], dtype: str, selected: int) -> float | None:
    """Return the bytes/bandwidth floor (read + write of the selected rows) in microseconds."""
    ceiling = result.get("copy_ceiling")
    if not ceiling:
        return None
    inner = result["argv"]["inner"]
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    payload_bytes = inner[0] * inner[1] * inner[2] * element
    return 2 * selected * payload_bytes / ceiling["bytes_per_s"] * 1e6


def medians(result: dict[str, Any]) -> dict[tuple[str, int, str, str, str], float]:
    """Return ``{(dtype, selected, op, impl, mode): median_us}``."""
    return {(r["dtype"], r["selected"], r["op"], r["impl"], r["mode"]): r["median_us"] for r in result["records"]}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Return the headline numbers and target checks of a benchmark result."""
    table = medians(result)
    cases = sorted({(d, s, o) for d, s, o, _, _ in table})
    rows = []
    for dtype, selected, op in cases:
        floor = floor_us(result, dtype, selected)
        row: dict[str, Any] = {"dtype": dtype, "selected": selected, "op": op, "floor_us": floor}
        for impl in sorted({i for d, s, o, i, _ in table if (d, s, o) == (dtype, selected, op)}):
            graph = table.get((dtype, selected, op, impl, "graph"))
            row[impl] = {mode: table.get((dtype, selected, op, impl, mode)) for mode in ("graph", "event", "wall",
                                                                                       "enqueue")}
            row[impl]["graph_over_floor"] = graph / floor if graph and floor else None
        rows.append(row)
    checks: dict[str, Any] = {}
    for row in rows:
        fused, fallback, native = row.get("fused"), row.get("fallback"), row.get("torch-native")
        tag = f"{row['dtype']}/{row['selected']}/{row['op']}"
        if fused and fused["graph"] and row["selected"] >= 64:
            checks[f"fused_over_floor {tag}"] = target_check(fused["graph_over_floor"], TARGETS["fused_over_floor_max"],
                                                      "max")
            if fallback and fallback["graph"]:
                checks[f"fallback_over_fused {tag}"] = target_check(fallback["graph"] / fused["graph"],
                                                              TARGETS["fallback_over_fused_max"], "max")
        if fused and native and fused["graph"] and row["selected"] == 64 and row["dtype"] == "float32":
            checks[f"speedup_vs_native {tag}"] = target_check(native["graph"] / fused["graph"],
                                                        TARGETS["fused_speedup_vs_native_64_fp32_min"], "min")
        if fused and row["selected"] == 1 and row["op"] == "gather":
            checks[f"eager_single_row_gather_wall_us {row['dtype']}"] = target_check(
                fused["wall"], TARGETS["eager_single_row_gather_wall_us_max"], "max")
    return close_summary(result, rows, checks, TARGETS)


def target_check(value: float | None, target: float, kind: str) -> dict[str, Any]:
    """Return a check of ``value`` against ``target`` (``kind`` "max" or "min"); ``met`` is None without a value."""
    met = None if value is None else (value <= target if kind == "max" else value >= target)
    return {"value": value, "target": target, "kind": kind, "met": met}


def close_summary(result: dict[str, Any], rows: list[dict[str, Any]], checks: dict[str, Any],
                  targets: dict[str, float]) -> dict[str, Any]:
    """Add the zero-compiler-entries check and return the benchmark summary (``all_met`` over known checks)."""
    entries = sum(result["compiler_entries_after_seal"].values())
    checks["compiler_entries_after_seal"] = {"value": entries, "target": 0, "met": entries == 0}
    return {"rows": rows, "checks": checks, "targets": targets,
            "all_met": all(check["met"] for check in checks.values() if check["met"] is not None)}


def print_table(result: dict[str, Any]) -> None:
    """Print graph-replay medians per case and the target checks."""
    summary = result["summary"]
    ceiling = result.get("copy_ceiling")
    if ceiling:
        print(f"copy ceiling: {ceiling['bytes_per_s'] / 1e12:.3f} TB/s (read + write)")
    for row in summary["rows"]:
        impls = [key for key in row if isinstance(row[key], dict)]
        parts = []
        for impl in impls:
            values = row[impl]
            graph = values["graph"]
            ratio = values["graph_over_floor"]
            parts.append(f"{impl}: graph {graph:.1f}" + (f" ({ratio:.2f}x)" if ratio else "") if graph else
                         f"{impl}: wall {values['wall']:.1f}")
        floor = f"floor {row['floor_us']:.1f}" if row["floor_us"] else "floor n/a"
        print(f"{row['dtype']:>8} S={row['selected']:<4} {row['op']:<7} {floor} | " + " | ".join(parts))
    for name, piece in (result.get("host_breakdown") or {}).items():
        print(f"host: {name}: {piece['median_us']:.1f} us")
    for name, check in summary["checks"].items():
        value = check["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"check {name}: {shown} (target {check.get('kind', '==')} {check['target']}) met={check['met']}")
