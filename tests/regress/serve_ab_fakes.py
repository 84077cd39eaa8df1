"""A stand-in for serve-ab's ``run_bench_once`` (no benchmark process): it records what was on disk when each run
started and returns what a finished run returns. Shared by the serve-ab round, resume and warm-up tests."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

BENCH = ["throughput", "--model", "/models/m", "--input-len", "16", "--output-len", "4"]


def fake_run(seen_documents: list, out_dir: str, stop_at_round: int | None = None, wall_s: float = 1.0,
             fail: str | None = None) -> Callable[..., dict[str, Any]]:
    """Return a ``run_bench_once`` stand-in.

    Args:
        seen_documents: gets the ``serve_ab.json`` on disk when each run starts (None before the first).
        out_dir: the A/B's directory.
        stop_at_round: raise KeyboardInterrupt in this round's first run (the call's time ran out), after its run
            directory was made, as a real run's would be.
        wall_s: each run's reported wall time.
        fail: a run directory name (``warmup-patched``, ``round1-baseline``) whose run reports an error.
    """
    def run_bench_once(bench, enabled, run_dir, timeout_s, entry):
        os.makedirs(run_dir)  # as the real one: a reused directory is an error
        name = os.path.basename(run_dir)
        round_index = int(name.split("-")[0].removeprefix("round")) if name.startswith("round") else -1
        path = os.path.join(out_dir, "serve_ab.json")
        seen_documents.append(json.load(open(path)) if os.path.isfile(path) else None)
        if stop_at_round is not None and round_index == stop_at_round:
            raise KeyboardInterrupt
        label = "patched" if enabled else "baseline"
        applied = {"state": "applied" if enabled else "disabled"}
        return {"label": label, "error": "exited with status 1" if name == fail else None, "wall_s": wall_s,
                "entry": entry, "ledgers": [{"role": "main", "patches": {"gdn_state_copy": applied}}],
                "metrics": {"tokens_per_second": 100.0 + (round_index if enabled else 0)}}
    return run_bench_once
