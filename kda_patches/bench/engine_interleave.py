"""Every arm's engine alive at once, their timed passes alternated: an engine A/B where the machine's drift cancels.

On the H200 the same requests' pass on one baseline engine nearly doubled in time over a few minutes, and the decode
steps of three engines (CUDA-graph replays the overlay never touches) varied by half as much again (issue 26;
``docs/results/h200-vllm-engine/``, the bisection and profile): the
machine drifts by more than the effect an arm-after-arm bisection (:func:`~kda_patches.bench.engine_repeat.run_arms`)
tries to measure. Here each arm's process starts its engine once (one after the other: their memory profiling must
not overlap), runs the batch once unmeasured, and then waits; every *cycle* runs one timed pass per arm in a shuffled
order, so an arm's pass and the baseline's pass of the same cycle are seconds apart. The verdict is the *paired*
ratio: arm pass / baseline pass of the same cycle, its median over the cycles. Each engine gets an equal share of
:data:`SHARED_MEMORY` of the GPU's memory. The GPU's clocks, power, temperature and clock-event reasons are sampled
for the whole run (:mod:`kda_patches.bench.gpu_clocks`) and summarized over every pass's window.

``python -m kda_patches.bench.engine_repeat --interleave CYCLES --out DIR [--arm ...] -- CHILD OPTIONS``
"""

from __future__ import annotations

import json
import os
import random
import select
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from kda_patches.bench import gpu_clocks
from kda_patches.bench.cpu_pin import check_available, pin_children
from kda_patches.bench.engine_repeat import BASELINE, child_command, finish_record, write_document

SHARED_MEMORY = 0.85  # of the GPU's memory, split equally between the arms' engines
MEMORY_ARG = "gpu_memory_utilization"


class ArmFailed(RuntimeError):
    """An arm's process ended, answered something unexpected, or did not answer in time."""


def share_memory(child_args: list[str], arms: int) -> list[str]:
    """Return ``child_args`` with one ``--engine-arg gpu_memory_utilization=`` of ``SHARED_MEMORY / arms`` (any given
    one replaced: engines that live side by side must fit together)."""
    shared, skip = [], False
    for position, item in enumerate(child_args):
        if skip:
            skip = False
            continue
        if item == "--engine-arg" and child_args[position + 1:position + 2] and \
                child_args[position + 1].startswith(f"{MEMORY_ARG}="):
            skip = True
            continue
        shared.append(item)
    return [*shared, "--engine-arg", f"{MEMORY_ARG}={SHARED_MEMORY / arms:.4f}"]


def cycle_order(names: list[str], cycle: int, seed: int) -> list[str]:
    """Return the arms' pass order in ``cycle``: every arm once, shuffled by ``seed`` and the cycle."""
    order = list(names)
    random.Random(seed * 100_003 + cycle).shuffle(order)
    return order


class ArmProcess:
    """One arm's engine process in ``--serve-fd`` mode, and the reply lines it writes."""

    def __init__(self, name: str, env_overrides: dict[str, str], child_args: list[str], run_dir: str,
                 profile: bool, cpus: frozenset[int] | None = None) -> None:
        from kda_patches.bench.serve_ab import run_env

        os.makedirs(run_dir)
        self.name, self.env_overrides, self.run_dir = name, env_overrides, run_dir
        self.started = time.perf_counter()
        read_fd, write_fd = os.pipe()
        self.log = open(os.path.join(run_dir, "run.log"), "wb")
        self.process = subprocess.Popen(
            child_command(child_args, run_dir, profile, "--serve-fd", str(write_fd)), stdin=subprocess.PIPE,
            stdout=self.log, stderr=self.log, env=run_env(env_overrides, os.path.join(run_dir, "status")),
            pass_fds=(write_fd,), preexec_fn=pin_children(cpus))
        os.close(write_fd)  # the child holds the only writer: its exit is the reader's end of file
        self.replies, self.buffer = read_fd, b""

    def read_reply(self, timeout_s: float) -> dict[str, Any]:
        """Return the next JSON line the arm writes.

        Raises:
            ArmFailed: the process ended first, or ``timeout_s`` passed.
        """
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ArmFailed(f"arm {self.name}: no answer within {timeout_s:.0f} s")
            # a forked engine process may hold the pipe's writer too, so the arm's end is not always end of file
            if not select.select([self.replies], [], [], min(left, 1.0))[0]:
                if self.process.poll() is not None:
                    raise ArmFailed(f"arm {self.name}: its process ended with status {self.process.returncode} "
                                    f"(see {self.run_dir}/run.log)")
                continue
            chunk = os.read(self.replies, 65536)
            if not chunk:
                raise ArmFailed(f"arm {self.name}: its process ended (see {self.run_dir}/run.log)")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def command(self, text: str) -> None:
        """Send one command line (``pass`` / ``quit``).

        Raises:
            ArmFailed: the process no longer reads its stdin.
        """
        try:
            self.process.stdin.write(f"{text}\n".encode())
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError) as error:
            raise ArmFailed(f"arm {self.name}: cannot send {text!r}: {error}") from error

    def finish(self, timeout_s: float) -> dict[str, Any]:
        """Ask the arm to quit (it writes its result and, with a profile, runs the profiled pass), wait, and return
        :func:`~kda_patches.bench.engine_repeat.finish_record`; a process that does not end in time is killed."""
        try:
            self.command("quit")
            self.process.stdin.close()
        except (ArmFailed, BrokenPipeError):
            pass
        try:
            returncode = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            returncode = None
        self.log.close()
        os.close(self.replies)
        return finish_record(self.run_dir, self.env_overrides, returncode, time.perf_counter() - self.started)


def summarize_pairs(passes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm: its passes, their median, and the paired ratios (its pass / the baseline's pass of the same cycle;
    > 1: slower): median, min, max, and in how many cycles it was faster. Only cycles where both ran count."""
    by_cycle: dict[int, dict[str, float]] = {}
    for record in passes:
        by_cycle.setdefault(record["cycle"], {})[record["arm"]] = record["elapsed_s"]
    summary: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(record["arm"] for record in passes):
        samples = [cycle[name] for cycle in by_cycle.values() if name in cycle]
        row: dict[str, Any] = {"passes": len(samples), "median_s": statistics.median(samples)}
        ratios = [cycle[name] / cycle[BASELINE] for cycle in by_cycle.values() if name in cycle and BASELINE in cycle]
        if name != BASELINE and ratios:
            row.update(paired=len(ratios), ratio_median=statistics.median(ratios), ratio_min=min(ratios),
                       ratio_max=max(ratios), faster_cycles=sum(ratio < 1 for ratio in ratios))
        summary[name] = row
    return summary


def attach_clocks(passes: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
    """Give every pass the summary of the GPU clock samples inside its window (``gpu``)."""
    for record in passes:
        record["gpu"] = gpu_clocks.summarize_window(samples, record["start"], record["end"])


def run_interleaved(arms: dict[str, dict[str, str]], child_args: list[str], out_dir: str, cycles: int,
                    seed: int = 0, timeout_s: float = 900.0, profile: bool = False,
                    start_sampler: Callable[[str], tuple[Any, str]] = gpu_clocks.start_sampler,
                    cpus: frozenset[int] | None = None) -> dict[str, Any]:
    """Start the baseline and every arm, run ``cycles`` cycles of one timed pass each, and write and return
    ``OUT_DIR/engine_repeat.json`` (rewritten after every cycle).

    Args:
        arms: name -> environment overrides (see :func:`~kda_patches.bench.engine_repeat.parse_arm`).
        child_args: the engine's arguments; the memory share replaces any ``gpu_memory_utilization``.
        cycles: timed passes per arm.
        timeout_s: for one engine's start (with its unmeasured pass), one pass, and one arm's quit.
        start_sampler: starts the GPU clock record into a path (:func:`kda_patches.bench.gpu_clocks.start_sampler`).
        cpus: pin every arm's processes to these same host cores (:mod:`kda_patches.bench.cpu_pin`); None: not
            pinned.

    Returns:
        the document: ``passes`` (cycle, position, arm, elapsed, window, ``gpu``), ``summary``
        (:func:`summarize_pairs`), ``runs`` (each arm's record), ``error`` when an arm failed (the run stops there:
        later cycles would compare fewer arms).

    Raises:
        ValueError: ``out_dir`` is not empty, ``cycles`` < 1, or a core of ``cpus`` is not available.
    """
    if cycles < 1:
        raise ValueError(f"cycles={cycles}: give at least one cycle")
    if cpus is not None:
        check_available(cpus)
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir} is not empty; give a new --out")
    os.makedirs(out_dir, exist_ok=True)
    plan = {BASELINE: {"KDA_PATCHES": "0"}, **arms}
    shared = share_memory(child_args, len(plan))
    clock_path = os.path.join(out_dir, "gpu_clocks.csv")
    sampler, clock_note = start_sampler(clock_path)
    document: dict[str, Any] = {"mode": "interleaved", "child_args": shared, "arms": plan, "cycles": cycles,
                                "seed": seed, "passes": [], "gpu_clocks": {"note": clock_note},
                                "cpus": None if cpus is None else sorted(cpus)}
    running: dict[str, ArmProcess] = {}
    try:
        for position, name in enumerate(plan):
            running[name] = ArmProcess(name, plan[name], shared, os.path.join(out_dir, f"{position}-{name}"),
                                       profile, cpus)
            ready = running[name].read_reply(timeout_s)
            print(f"  {name:<24} ready: start-up {ready['startup_s']:.1f} s, unmeasured pass "
                  f"{ready['warmup_s']:.3f} s", flush=True)
        for cycle in range(cycles):
            for position, name in enumerate(cycle_order(list(plan), cycle, seed)):
                running[name].command("pass")
                document["passes"].append({"cycle": cycle, "position": position, "arm": name,
                                           **running[name].read_reply(timeout_s)})
            print(f"  cycle {cycle}: " + "  ".join(f"{record['arm']} {record['elapsed_s']:.3f}"
                                                   for record in document["passes"] if record["cycle"] == cycle),
                  flush=True)
            document["summary"] = summarize_pairs(document["passes"])
            write_document(document, out_dir)
    except ArmFailed as error:
        document["error"] = str(error)
    finally:
        document["runs"] = [{"arm": name, **arm.finish(timeout_s)} for name, arm in running.items()]
        gpu_clocks.stop_sampler(sampler)
    samples, skipped = gpu_clocks.read_samples(clock_path)
    document["gpu_clocks"].update(samples=len(samples), skipped_lines=skipped)
    attach_clocks(document["passes"], samples)
    document["summary"] = summarize_pairs(document["passes"]) if document["passes"] else {}
    write_document(document, out_dir)
    return document


def format_pairs(document: dict[str, Any]) -> list[str]:
    """Return the lines of the paired table, each arm's GPU clock median, and the run's error if any."""
    lines = [f"{'arm':<24} {'passes':>6} {'median s':>9} {'paired /baseline: median':>25} {'min':>6} {'max':>6} "
             f"{'faster':>7}  GPU"]
    for name, row in document["summary"].items():
        windows = [record["gpu"] for record in document["passes"] if record["arm"] == name and record.get("gpu")]
        clocks = [window["sm_mhz_median"] for window in windows if window.get("sm_mhz_median") is not None]
        gpu = f"sm {statistics.median(clocks):.0f} MHz" if clocks else document["gpu_clocks"]["note"] or "no samples"
        paired = (f"{row['ratio_median']:>25.3f} {row['ratio_min']:>6.3f} {row['ratio_max']:>6.3f} "
                  f"{row['faster_cycles']:>3}/{row['paired']:<3}") if "ratio_median" in row else f"{'':>47}"
        lines.append(f"{name:<24} {row['passes']:>6} {row['median_s']:>9.3f} {paired}  {gpu}")
    if document.get("error"):
        lines.append(f"stopped early: {document['error']}")
    return lines
