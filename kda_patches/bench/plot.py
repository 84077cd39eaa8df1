"""PNG plot of a state-copy benchmark: graph-replay time vs selected rows per implementation, floor line."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_results(result: dict[str, Any], path: Path) -> str | None:
    """Draw one panel per (dtype, op) and save it to ``path``.

    Args:
        result: the benchmark result (records, copy ceiling).
        path: PNG path (must not exist).
    Returns:
        The path written, or None when matplotlib is missing or there are no graph timings.
    """
    plt = load_pyplot()
    if plt is None:
        return None
    from kda_patches.bench.report import floor_us

    graph = [r for r in result["records"] if r["mode"] == "graph"]
    if not graph or path.exists():
        return None
    dtypes = sorted({r["dtype"] for r in graph})
    ops = sorted({r["op"] for r in graph})
    figure, axes = plt.subplots(len(dtypes), len(ops), figsize=(6.5 * len(ops), 4.8 * len(dtypes)), squeeze=False)
    panels = [(axes[row][column], dtype, op) for row, dtype in enumerate(dtypes) for column, op in enumerate(ops)]
    for axis, dtype, op in panels:
        records = [r for r in graph if r["dtype"] == dtype and r["op"] == op]
        selected = sorted({r["selected"] for r in records})
        for impl in sorted({r["impl"] for r in records}):
            points = sorted((r["selected"], r["median_us"]) for r in records if r["impl"] == impl)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
        floors = [floor_us(result, dtype, count) for count in selected]
        if all(floors):
            axis.plot(selected, floors, linestyle="--", color="black", label="bytes / copy ceiling")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("selected rows")
        axis.set_ylabel("graph replay median per call (us)")
        axis.set_title(f"{op} {dtype}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(f"state copy, cache [{result['argv']['rows']}, {', '.join(map(str, result['argv']['inner']))}]"
                    f" + gap {result['argv']['gap_items']} items")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)


def load_pyplot() -> Any:
    """Return ``matplotlib.pyplot`` on the file-only Agg backend, or None (said once) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kda-patches bench: matplotlib is not installed; no plot written")
        return None
    return plt
