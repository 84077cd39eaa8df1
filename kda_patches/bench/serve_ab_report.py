"""serve-ab's report: per metric the patched/baseline ratio of every round, its min/median/max, a table and a plot."""

from __future__ import annotations

import statistics
from typing import Any


def metric_direction(name: str) -> str:
    """Return ``higher`` for rates (per second, throughput) and ``lower`` for times."""
    return "higher" if "per_second" in name or "throughput" in name else "lower"


def summarize_rounds(raw: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Return per metric the patched/baseline ratio of every round and their min/median/max.

    Args:
        raw: the per-round records (each with ``runs.baseline.metrics`` and ``runs.patched.metrics``).
    """
    names = sorted({name for record in raw for side in record["runs"].values() for name in side["metrics"]})
    summary = {}
    for name in names:
        pairs = [(record["runs"]["baseline"]["metrics"].get(name), record["runs"]["patched"]["metrics"].get(name))
                 for record in raw]
        pairs = [(base, patched) for base, patched in pairs if base and patched is not None]
        if not pairs:
            continue
        ratios = [patched / base for base, patched in pairs]
        summary[name] = {"direction": metric_direction(name), "ratios": ratios, "min": min(ratios),
                         "median": statistics.median(ratios), "max": max(ratios),
                         "baseline": [base for base, _ in pairs], "patched": [patched for _, patched in pairs]}
    return summary


def format_table(summary: dict[str, dict[str, Any]], rounds: int) -> list[str]:
    """Return the ratio table lines."""
    lines = [f"{'metric':<28} {'better':<7} {'min':>7} {'median':>7} {'max':>7}   patched/baseline over {rounds} "
             "round(s)"]
    for name, entry in summary.items():
        lines.append(f"{name:<28} {entry['direction']:<7} {entry['min']:7.3f} {entry['median']:7.3f} "
                     f"{entry['max']:7.3f}")
    return lines


def plot_ratios(summary: dict[str, dict[str, Any]], path: str, title: str) -> None:
    """Save a PNG: per metric, each round's patched/baseline ratio and the median, with 1.0 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    figure, axis = plt.subplots(figsize=(max(6.0, 1.3 * len(names) + 2), 4.5))
    for index, name in enumerate(names):
        ratios = summary[name]["ratios"]
        axis.scatter([index] * len(ratios), ratios, color="tab:blue", alpha=0.7, label="round" if index == 0 else None)
        axis.hlines(summary[name]["median"], index - 0.3, index + 0.3, color="tab:red",
                    label="median" if index == 0 else None)
    axis.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    axis.set_xticks(range(len(names)), [f"{n}\n({summary[n]['direction']} better)" for n in names], fontsize=7)
    axis.set_ylabel("patched / baseline")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
