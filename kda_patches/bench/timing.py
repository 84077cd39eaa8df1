"""Timing primitives of the benchmarks (seed 000 method), one mode per function.

- eager event: CUDA events around one eager call (includes host dispatch gaps; not kernel time);
- synchronized wall: host clock from a synchronized start to a synchronized end ("host-to-done");
- host enqueue: host clock around the call alone (the device may still be running);
- graph replay: a CUDA graph of ``calls`` captured calls, replayed; event time divided by ``calls``.

Each measured call returns its output; outputs are released after the timed region ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kda_patches.bench.stats import check_graph_instances, median

Call = Callable[[int], Any]


def synchronize(device: torch.device) -> None:
    """Wait for the device (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager_event(call: Call, step: int, device: torch.device) -> float:
    """Return microseconds between CUDA events recorded around ``call(step)``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    synchronize(device)
    start.record()
    result = call(step)
    end.record()
    end.synchronize()
    del result
    return start.elapsed_time(end) * 1000.0


def time_wall(call: Call, step: int, device: torch.device) -> float:
    """Return microseconds of host wall time from a synchronized start to the call's completion."""
    synchronize(device)
    begin = time.perf_counter_ns()
    result = call(step)
    synchronize(device)
    elapsed = time.perf_counter_ns() - begin
    del result
    return elapsed / 1000.0


def time_enqueue(call: Call, step: int, device: torch.device) -> float:
    """Return microseconds of host time spent inside ``call(step)`` (launch/enqueue cost)."""
    synchronize(device)
    begin = time.perf_counter_ns()
    result = call(step)
    elapsed = time.perf_counter_ns() - begin
    synchronize(device)
    del result
    return elapsed / 1000.0


def capture_graph(call: Call, calls: int, device: torch.device) -> torch.cuda.CUDAGraph:
    """Capture ``call(0) ... call(calls - 1)`` into one CUDA graph (after a warm-up on a side stream)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for step in range(min(calls, 3)):
            call(step)
    torch.cuda.current_stream(device).wait_stream(stream)
    synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in range(calls):
            call(step)
    synchronize(device)
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, calls: int, device: torch.device) -> float:
    """Return microseconds per captured call of one replay of ``graph``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    synchronize(device)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / calls


def measure_copy_ceiling(device: torch.device, nbytes: int = 2 << 30, repeats: int = 20) -> dict[str, Any]:
    """Measure the device-to-device copy bandwidth (bytes read + written per second).

    Args:
        device: a CUDA device.
        nbytes: bytes per copy (large enough to leave the L2 out).
        repeats: timed copies (after three warm-ups).
    Returns:
        ``{"bytes_per_s": median bandwidth, "samples_us": [...], "nbytes": nbytes}``.
    """
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    del source, target
    torch.cuda.empty_cache()
    return {"bytes_per_s": 2 * nbytes / (median(samples) * 1e-6), "samples_us": samples, "nbytes": nbytes}


def measure_rounds(calls: dict[tuple[str, ...], Call], trials: int, graph_calls: int, device: torch.device,
                   shuffler: Any, graph_instances: int = 1) -> dict[tuple[str, ...], list[float]]:
    """Time every call in every mode, shuffling the order of the calls in each round (seed 000 method).

    Args:
        calls: ``{key: call}``; every call gets the same inputs and allocation boundaries.
        trials: rounds per mode.
        graph_calls: calls captured per CUDA graph (graph mode: CUDA only).
        device: the device the calls run on.
        shuffler: a ``random.Random`` (the order of each round).
        graph_instances: graph mode: how many times each call is captured anew (:func:`replay_graphs`).
    Returns:
        ``{(*key, mode): raw samples in us}`` for modes wall, enqueue, and on CUDA event and graph.
    """
    modes: dict[str, Any] = {"wall": time_wall, "enqueue": time_enqueue}
    if device.type == "cuda":
        modes["event"] = time_eager_event
        check_graph_instances(trials, graph_instances)  # before the eager rounds, not after them
    samples: dict[tuple[str, ...], list[float]] = {}
    order = list(calls)
    for step in range(trials):
        shuffler.shuffle(order)
        for key in order:
            for mode, measure in modes.items():
                samples.setdefault((*key, mode), []).append(measure(calls[key], step, device))
    if device.type == "cuda":
        for key, values in replay_graphs(calls, graph_calls, trials, device, shuffler, graph_instances).items():
            samples[(*key, "graph")] = values
    return samples


def graph_schedule(keys: list[Any], trials: int, instances: int,
                   shuffler: Any) -> list[tuple[list[Any], list[list[Any]]]]:
    """Plan :func:`replay_graphs`: ``instances`` blocks, each ``(capture order, replay order of each round)``.

    Every block captures every key anew, in an order of its own, and replays them in ``trials // instances``
    rounds of shuffled order. Why: one graph of a call carries an offset of its own into every replay of it
    (identical kernels captured as separate graphs read apart by as much as the differences being measured at one
    to eight rows, H100 and H200, ``docs/results/launch-shape/``, "One capture's own offset"); samples from several
    captures spread that offset
    over both sides of a comparison instead of handing it to one.

    Args:
        keys: the calls' keys.
        trials: replay rounds in all, a multiple of ``instances``.
        instances: captures per key (at least 1).
        shuffler: a ``random.Random``.
    Returns:
        The blocks in the order they run.
    Raises:
        ValueError: from :func:`check_graph_instances`.
    """
    check_graph_instances(trials, instances)
    blocks = []
    for _ in range(instances):
        capture = list(keys)
        shuffler.shuffle(capture)
        rounds = []
        for _ in range(trials // instances):
            order = list(keys)
            shuffler.shuffle(order)
            rounds.append(order)
        blocks.append((capture, rounds))
    return blocks


def replay_graphs(calls: dict[Any, Call], graph_calls: int, trials: int, device: torch.device,
                  shuffler: Any, instances: int = 1) -> dict[Any, list[float]]:
    """Capture each call into CUDA graphs of ``graph_calls`` calls, then replay them in shuffled rounds
    (:func:`graph_schedule`: ``instances`` blocks, each with fresh captures released before the next block).

    Args:
        calls: ``{key: call}`` (CUDA).
        graph_calls: calls captured per graph.
        trials: replay rounds in all; each round replays every graph of its block once.
        device: the CUDA device.
        shuffler: a ``random.Random``.
        instances: captures per call (divides ``trials``).
    Returns:
        ``{key: microseconds per captured call, one sample per round}``, block after block (block ``b``'s
        samples are ``[b * trials // instances, (b + 1) * trials // instances)``). A key whose capture fails
        (e.g. a pattern that synchronizes the host) is reported on stdout and left out.
    """
    samples: dict[Any, list[float]] = {}
    failed: set[Any] = set()
    for capture, rounds in graph_schedule(list(calls), trials, instances, shuffler):
        graphs = {}
        for key in capture:
            if key in failed:
                continue
            try:
                graphs[key] = capture_graph(calls[key], graph_calls, device)
            except RuntimeError as exc:
                name = "/".join(key) if isinstance(key, tuple) else str(key)
                print(f"kda-patches bench: {name} cannot be captured in a CUDA graph: {exc}", flush=True)
                synchronize(device)
                failed.add(key)
                samples.pop(key, None)
        for order in rounds:
            for key in order:
                if key in graphs:
                    samples.setdefault(key, []).append(time_graph(graphs[key], graph_calls, device))
        del graphs
        torch.cuda.empty_cache()
    return {key: samples[key] for key in calls if key in samples}  # in the calls' order, as before blocks


def best_loop_us(call: Callable[[], Any], calls: int = 3000, loops: int = 5, warmup: int = 100,
                 synchronize_device: torch.device | None = None) -> float:
    """Return the best of ``loops`` tight loops of ``calls`` calls, in microseconds per call (host time).

    For host costs only (the device may run behind): with ``synchronize_device`` the device is synchronized
    after the warm-up and after each loop, outside the timed part.
    """
    for _ in range(warmup):
        call()
    if synchronize_device is not None:
        synchronize(synchronize_device)
    best = float("inf")
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        if synchronize_device is not None:
            synchronize(synchronize_device)
    return round(best, 3)
