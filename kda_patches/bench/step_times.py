"""Wall time of every engine step and model-runner call, to find where an engine A/B's time goes (issue 26).

serve-ab says *whether* the patched engine is slower; these samples say *where*: more steps, slower prefill steps
(the overlay's routed layer calls run in those), slower decode steps (CUDA-graph replays: the overlay is not in
them), or occasional stalls (a high p99 / max). Both sides record the same way, so the timer's own cost (one
``perf_counter`` pair and a list append per call) cancels in the ratio.

``KDA_BENCH_STEP_TIMES=1`` plus :func:`install_from_env` (the GPU scripts' start-up hook calls it in every
process) wraps :data:`TARGETS` when their modules are imported; a process that recorded anything writes
``step-times-<pid>.json`` into ``KDA_PATCHES_STATUS_DIR`` (serve-ab gives each run its own), which
:func:`load_step_times` summarizes per label. It writes every :data:`FLUSH_EVERY_S` seconds while new samples
arrive (a background thread, off the timed calls) and again at exit: vLLM stops its engine-core process without
running exit handlers (on the H200 its ledger stayed ``final: false``), so an exit-only write lost every sample.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

ENV = "KDA_BENCH_STEP_TIMES"
STATUS_DIR_ENV = "KDA_PATCHES_STATUS_DIR"
FILE_PATTERN = "step-times-*.json"
FLUSH_EVERY_S = 1.0

# (module, qualname, label); execute_model's label gets [prefill] / [decode] / [empty] from its scheduler output
TARGETS: tuple[tuple[str, str, str], ...] = (
    ("vllm.v1.engine.core", "EngineCore.step", "engine_step"),
    ("vllm.v1.engine.core", "EngineCore.step_with_batch_queue", "engine_step"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", "execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens", "sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens", "sample_tokens"),
)


def batch_kind(scheduler_output: Any) -> str:
    """Return ``prefill`` when a request is scheduled more than one token, ``decode`` when each gets one,
    ``empty`` when none is scheduled (or the object has no ``num_scheduled_tokens`` mapping)."""
    per_request = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    if not per_request:
        return "empty"
    return "prefill" if max(per_request.values()) > 1 else "decode"


class StepTimes:
    """Samples (seconds) per label of one process."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def wrapper(self, label: str) -> Any:
        """Return a wrapt wrapper that records each call's wall time under ``label`` (``execute_model``: with the
        batch kind of its first argument, see :func:`batch_kind`)."""
        record = self.samples.setdefault
        classify = label == "execute_model"

        def timed(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            started = time.perf_counter()
            try:
                return wrapped(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                name = label
                if classify:
                    name = f"{label}[{batch_kind(args[0] if args else kwargs.get('scheduler_output'))}]"
                record(name, []).append(elapsed)
        return timed

    def count(self) -> int:
        """Return how many samples are recorded, over all labels."""
        return sum(len(values) for values in list(self.samples.values()))

    def write(self, directory: str) -> str | None:
        """Write ``step-times-<pid>.json`` into ``directory``; return its path (None: nothing was recorded).

        Safe beside the recording threads: it writes a copy taken in one step (whole lists, no torn sample), and
        replaces the file atomically, so a reader sees the previous write or this one.
        """
        snapshot = {label: list(values) for label, values in list(self.samples.items())}
        if not snapshot:
            return None
        path = os.path.join(directory, f"step-times-{os.getpid()}.json")
        partial = f"{path}.{threading.get_ident()}.partial"
        with open(partial, "w") as handle:
            json.dump({"pid": os.getpid(), "samples": snapshot}, handle)
        os.replace(partial, path)
        return path

    def start_flusher(self, directory: str, every_s: float = FLUSH_EVERY_S) -> threading.Thread:
        """Start a daemon thread that writes every ``every_s`` seconds when samples were added since its last write.

        Returns:
            the thread (a daemon: it never holds the process open).

        Raises:
            ValueError: ``every_s`` is not positive.
        """
        if every_s <= 0:
            raise ValueError(f"every_s={every_s}: the flush interval must be positive")

        def flush_forever() -> None:
            written = 0
            while True:
                time.sleep(every_s)
                count = self.count()
                if count != written:
                    try:
                        self.write(directory)
                    except OSError as error:  # the run's directory is gone: the at-exit write says the same
                        print(f"kda_patches step times: stopped flushing to {directory}: {error}", file=sys.stderr)
                        return
                    written = count

        thread = threading.Thread(target=flush_forever, name="kda-step-times-flush", daemon=True)
        thread.start()
        return thread


def install(times: StepTimes, directory: str, targets: tuple[tuple[str, str, str], ...] = TARGETS,
            write_at_exit: bool = True, flush_every_s: float | None = FLUSH_EVERY_S) -> None:
    """Wrap each target of ``targets`` when its module is imported (now, if it is); write at exit and, unless
    ``flush_every_s`` is None, every ``flush_every_s`` seconds while samples arrive (:meth:`StepTimes.start_flusher`).

    A target missing from its module (another vLLM release) is skipped: each release has only some of them.
    """
    import wrapt

    def attach(module: Any, qualname: str, label: str) -> None:
        owner_name, _, attribute = qualname.rpartition(".")
        owner = getattr(module, owner_name, None) if owner_name else module
        if owner is not None and attribute in vars(owner):
            wrapt.wrap_function_wrapper(module, qualname, times.wrapper(label))

    for module_name, qualname, label in targets:
        wrapt.register_post_import_hook(
            lambda module, qualname=qualname, label=label: attach(module, qualname, label), module_name)
    if write_at_exit:
        atexit.register(times.write, directory)
    if flush_every_s is not None:
        times.start_flusher(directory, flush_every_s)


def install_from_env() -> StepTimes | None:
    """:func:`install` when ``KDA_BENCH_STEP_TIMES=1`` and ``KDA_PATCHES_STATUS_DIR`` is set; return the recorder.

    Only the processes of one benchmark run have a status directory (serve-ab sets it per run); serve-ab itself and
    the script that starts it have none and record nothing (None), so one switch in the outer environment reaches
    exactly the runs.

    Raises:
        ValueError: the switch has a value other than ``1`` or ``0``.
    """
    switch = os.environ.get(ENV, "0")
    if switch not in ("0", "1"):
        raise ValueError(f"{ENV}={switch!r}: use 1 (record step times) or 0")
    directory = os.environ.get(STATUS_DIR_ENV)
    if switch == "0" or not directory:
        return None
    times = StepTimes()
    install(times, directory)
    return times


def summarize(samples: list[float]) -> dict[str, float]:
    """Return count, total and the median / p90 / p99 / max in milliseconds of one label's samples."""
    ordered = sorted(samples)

    def percentile(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1e3

    return {"count": len(ordered), "total_s": sum(ordered), "median_ms": statistics.median(ordered) * 1e3,
            "p90_ms": percentile(0.90), "p99_ms": percentile(0.99), "max_ms": ordered[-1] * 1e3}


def load_step_times(directory: str) -> dict[str, dict[str, float]]:
    """Return :func:`summarize` per label over every ``step-times-*.json`` in ``directory`` (empty: none)."""
    merged: dict[str, list[float]] = {}
    for path in sorted(glob.glob(os.path.join(directory, FILE_PATTERN))):
        with open(path) as handle:
            for label, values in json.load(handle)["samples"].items():
                merged.setdefault(label, []).extend(values)
    return {label: summarize(values) for label, values in sorted(merged.items()) if values}


def compare_step_times(raw: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per label, the median over rounds of each side's step count and total seconds, and patched/baseline of the
    totals; only labels both sides recorded in every round that has step times."""
    rounds = [record["runs"] for record in raw
              if all(run.get("step_times") for run in record["runs"].values()) and len(record["runs"]) == 2]
    if not rounds:
        return {}
    labels = set.intersection(*(set(runs[side]["step_times"]) for runs in rounds for side in ("baseline", "patched")))
    table = {}
    for label in sorted(labels):
        row = {}
        for side in ("baseline", "patched"):
            row[f"{side}_count"] = statistics.median(runs[side]["step_times"][label]["count"] for runs in rounds)
            row[f"{side}_total_s"] = statistics.median(runs[side]["step_times"][label]["total_s"] for runs in rounds)
            row[f"{side}_median_ms"] = statistics.median(runs[side]["step_times"][label]["median_ms"]
                                                         for runs in rounds)
        row["total_ratio"] = row["patched_total_s"] / row["baseline_total_s"] if row["baseline_total_s"] else 0.0
        table[label] = row
    return table


def format_comparison(table: dict[str, dict[str, float]]) -> list[str]:
    """Return the lines of :func:`compare_step_times`'s table."""
    lines = [f"{'step label':<24} {'count b/p':>13} {'total s b/p':>15} {'median ms b/p':>17} {'p/b total':>9}"]
    for label, row in table.items():
        lines.append(f"{label:<24} {row['baseline_count']:>6.0f}/{row['patched_count']:<6.0f} "
                     f"{row['baseline_total_s']:>7.3f}/{row['patched_total_s']:<7.3f} "
                     f"{row['baseline_median_ms']:>8.3f}/{row['patched_median_ms']:<8.3f} {row['total_ratio']:>9.3f}")
    return lines
