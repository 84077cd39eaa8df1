"""GPU clocks, power, temperature and clock-event reasons during each timed pass, to tell a drifting machine from a
slower engine.

The same pass of the same requests can take half as long again a few minutes later on the same H200
(``docs/results/h200-vllm-engine/``): the GPU may have run
at lower clocks (power cap, thermal slowdown) for part of the run. The benchmark parent starts one background
``nvidia-smi`` sampler for the whole run (:func:`start_sampler`), notes ``time.time()`` at each pass's start and
end, stops the sampler (:func:`stop_sampler`), then summarizes the samples inside each pass's window
(:func:`read_samples`, :func:`summarize_window`, :func:`format_window`).

The sampler writes ``nvidia-smi --format=csv,noheader,nounits`` lines of :data:`FIELDS`, one per interval, e.g.
``2024/05/06 13:14:15.250, 1980, 2619, 412.37, 61, 0x0000000000000004``. nvidia-smi prints the timestamp in local
time; :func:`parse_samples` reads it in the local time zone of the process that parses it, which is the parent's,
so sample times and the parent's ``time.time()`` windows are on one clock (to the millisecond nvidia-smi prints).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from datetime import datetime
from typing import Any

FIELDS: tuple[str, ...] = ("timestamp", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu",
                           "clocks_event_reasons.active")
LEGACY_REASONS_FIELD = "clocks_throttle_reasons.active"  # drivers before 535 name the last field this way
CSV_FORMAT = "--format=csv,noheader,nounits"
TIMESTAMP_FORMAT = "%Y/%m/%d %H:%M:%S.%f"
MIN_INTERVAL_MS = 50
PROBE_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 2.0

# Clock-event reason bits (nvmlClocksEventReasons). 0x1 means the GPU is idle: nothing is running, so low clocks
# are expected and say nothing about the pass. Every other bit means the GPU is not running at the clocks it could:
# 0x2 applications clocks setting, 0x4 SW power cap, 0x8 HW slowdown, 0x10 sync boost, 0x20 SW thermal slowdown,
# 0x40 HW thermal slowdown, 0x80 HW power brake slowdown, 0x100 display clock setting.
IDLE_REASON = 0x1


def query_fields(reasons_field: str = FIELDS[-1]) -> str:
    """Return the ``--query-gpu`` value: :data:`FIELDS` joined by commas, the last one replaced by
    ``reasons_field`` (the driver's name for the clock-event reasons bitmask)."""
    return ",".join((*FIELDS[:-1], reasons_field))


def probe_query(executable: str, reasons_field: str, gpu_index: int) -> tuple[bool, str]:
    """Run one ``--query-gpu`` of GPU ``gpu_index`` with ``reasons_field`` as the reasons field.

    Args:
        executable: path of nvidia-smi.
        reasons_field: ``clocks_event_reasons.active`` or :data:`LEGACY_REASONS_FIELD`.
        gpu_index: the GPU to query.

    Returns:
        (True, "") when the query exits 0; else (False, why: the exit status and the last line nvidia-smi printed,
        or the error of running it). Never raises for a failing or hanging tool.
    """
    command = [executable, f"--query-gpu={query_fields(reasons_field)}", CSV_FORMAT, "-i", str(gpu_index)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"{type(error).__name__}: {error}"
    if result.returncode == 0:
        return True, ""
    lines = (result.stderr or result.stdout).strip().splitlines()
    return False, f"exit {result.returncode}" + (f": {lines[-1].strip()}" if lines else "")


def choose_reasons_field(executable: str, gpu_index: int) -> tuple[str | None, str]:
    """Return the reasons field this driver accepts: ``clocks_event_reasons.active``, else the older
    :data:`LEGACY_REASONS_FIELD` (tried only when the first probe fails).

    Returns:
        (field, "") or, when both probes fail, (None, why the last one failed).
    """
    why = ""
    for reasons_field in (FIELDS[-1], LEGACY_REASONS_FIELD):
        accepted, why = probe_query(executable, reasons_field, gpu_index)
        if accepted:
            return reasons_field, ""
    return None, why


def start_sampler(path: str, interval_ms: int = 200, gpu_index: int = 0,
                  executable: str = "nvidia-smi") -> tuple[subprocess.Popen | None, str]:
    """Start ``nvidia-smi --query-gpu=<FIELDS> --format=csv,noheader,nounits -i <gpu_index> -lms <interval_ms>``
    in the background, its stdout going to the file at ``path`` (created or truncated).

    A missing or failing tool does not stop the benchmark: the sampler is then None and the note says why, for the
    benchmark to record.

    Args:
        path: file that receives the CSV lines (see :func:`read_samples`).
        interval_ms: sampling interval in milliseconds, at least :data:`MIN_INTERVAL_MS`.
        gpu_index: the GPU to sample (nvidia-smi's ``-i``).
        executable: nvidia-smi's name (looked up on PATH) or path.

    Returns:
        (process, note): the running sampler and a note naming the GPU, the interval and the reasons field the
        driver accepted; or (None, a note naming why there is no record: the tool is not on PATH, both field names
        were rejected, or it could not be started).

    Raises:
        ValueError: ``interval_ms`` is below :data:`MIN_INTERVAL_MS`.
    """
    if interval_ms < MIN_INTERVAL_MS:
        raise ValueError(f"interval_ms={interval_ms}: must be at least {MIN_INTERVAL_MS} (milliseconds)")
    resolved = shutil.which(executable)
    if resolved is None:
        return None, f"{executable} not found on PATH: no GPU clock record"
    reasons_field, why = choose_reasons_field(resolved, gpu_index)
    if reasons_field is None:
        return None, (f"{executable} rejected both {FIELDS[-1]} and {LEGACY_REASONS_FIELD} ({why}): "
                      "no GPU clock record")
    command = [resolved, f"--query-gpu={query_fields(reasons_field)}", CSV_FORMAT, "-i", str(gpu_index),
               "-lms", str(interval_ms)]
    try:
        with open(path, "w") as handle:
            process = subprocess.Popen(command, stdout=handle, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    except OSError as error:
        return None, f"{executable} could not be started ({type(error).__name__}: {error}): no GPU clock record"
    return process, f"{executable} GPU {gpu_index} every {interval_ms} ms, reasons field {reasons_field}"


def stop_sampler(process: subprocess.Popen | None) -> None:
    """Terminate the sampler and wait for it; kill it when it has not ended :data:`STOP_TIMEOUT_S` seconds after.

    Args:
        process: what :func:`start_sampler` returned; None (no sampler) and an ended process are no-ops.
    """
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def parse_timestamp(text: str) -> float:
    """Return unix seconds of nvidia-smi's local-time ``YYYY/MM/DD HH:MM:SS.mmm``.

    Raises:
        ValueError: ``text`` is not in that format.
    """
    return datetime.strptime(text.strip(), TIMESTAMP_FORMAT).timestamp()


def parse_number(text: str) -> float | None:
    """Return the field as a float; None for a bracketed value (``[N/A]``, ``[Not Supported]``, ...).

    Raises:
        ValueError: the field is neither bracketed nor a number.
    """
    text = text.strip()
    return None if text.startswith("[") else float(text)


def parse_reasons(text: str) -> int | None:
    """Return the reasons bitmask from its hex form (``0x0000000000000004``); None for a bracketed value.

    Raises:
        ValueError: the field is neither bracketed nor hex.
    """
    text = text.strip()
    return None if text.startswith("[") else int(text, 16)


def parse_line(line: str) -> dict[str, Any] | None:
    """Return one sample (see :func:`parse_samples`) of a CSV line; None when the line is malformed: a field count
    other than ``len(FIELDS)``, a timestamp that does not parse, or an unbracketed value that is not a number."""
    fields = line.split(",")
    if len(fields) != len(FIELDS):
        return None
    try:
        return {"t": parse_timestamp(fields[0]), "sm_mhz": parse_number(fields[1]),
                "mem_mhz": parse_number(fields[2]), "power_w": parse_number(fields[3]),
                "temp_c": parse_number(fields[4]), "reasons": parse_reasons(fields[5])}
    except ValueError:
        return None


def parse_text(text: str) -> tuple[list[dict[str, Any]], int]:
    """Return (samples, skipped): the sample of each well-formed line and the number of malformed ones (see
    :func:`parse_line`); blank lines are neither."""
    samples: list[dict[str, Any]] = []
    skipped = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        sample = parse_line(line)
        if sample is None:
            skipped += 1
        else:
            samples.append(sample)
    return samples, skipped


def parse_samples(text: str) -> list[dict[str, Any]]:
    """Return one sample per well-formed line of the sampler's output, in file order; malformed lines are skipped
    (:func:`read_samples` also counts them).

    Args:
        text: ``nvidia-smi --format=csv,noheader,nounits`` lines of :data:`FIELDS`.

    Returns:
        dicts with ``t`` (unix seconds of the local-time timestamp), ``sm_mhz``, ``mem_mhz``, ``power_w``,
        ``temp_c`` (floats, None for ``[N/A]`` / ``[Not Supported]``) and ``reasons`` (the clock-event reasons
        bitmask as an int, or None).
    """
    return parse_text(text)[0]


def read_samples(path: str) -> tuple[list[dict[str, Any]], int]:
    """Return (samples, skipped_lines) of the sampler's file (see :func:`parse_samples`); a missing file gives
    ([], 0): the sampler never started."""
    if not os.path.exists(path):
        return [], 0
    with open(path, errors="replace") as handle:
        return parse_text(handle.read())


def is_throttled(reasons: int) -> bool:
    """Return whether the reasons bitmask has any bit other than GPU idle (0x1) set.

    Every other bit counts as "not running at the clocks it could": the dynamic events (SW power cap 0x4, HW
    slowdown 0x8, sync boost 0x10, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80) and also the configured
    caps (applications clocks setting 0x2, display clock setting 0x100), which are settings rather than events but
    hold the clocks down all the same.
    """
    return bool(reasons & ~IDLE_REASON)


def present(samples: list[dict[str, Any]], key: str) -> list[Any]:
    """Return the non-None values of ``key`` over ``samples``."""
    return [sample[key] for sample in samples if sample.get(key) is not None]


def summarize_window(samples: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Summarize the samples of one timed pass: those with ``start <= t <= end``.

    Args:
        samples: from :func:`parse_samples` / :func:`read_samples`.
        start: the pass's start, ``time.time()`` seconds.
        end: the pass's end, ``time.time()`` seconds.

    Returns:
        ``{"count": 0}`` when no sample is inside; else ``count``, ``sm_mhz_median``, ``sm_mhz_min``,
        ``sm_mhz_max``, ``power_w_median``, ``temp_c_max`` and ``throttled_fraction`` (the fraction of samples
        whose reasons are throttled, see :func:`is_throttled`). Each statistic ignores the samples whose value is
        None and is None when no sample has a value.
    """
    inside = [sample for sample in samples if start <= sample["t"] <= end]
    if not inside:
        return {"count": 0}
    sm, power, temp, reasons = (present(inside, key) for key in ("sm_mhz", "power_w", "temp_c", "reasons"))
    return {"count": len(inside),
            "sm_mhz_median": statistics.median(sm) if sm else None,
            "sm_mhz_min": min(sm) if sm else None,
            "sm_mhz_max": max(sm) if sm else None,
            "power_w_median": statistics.median(power) if power else None,
            "temp_c_max": max(temp) if temp else None,
            "throttled_fraction": sum(map(is_throttled, reasons)) / len(reasons) if reasons else None}


def format_window(summary: dict[str, Any]) -> str:
    """Return one short line of a :func:`summarize_window` result, e.g.
    ``sm MEDIAN MHz (MIN-MAX), POWER W, TEMP C, throttled FRACTION%`` (each a whole number); ``?`` stands for a
    statistic without values, and an
    empty window gives ``no GPU clock samples``."""
    if not summary.get("count"):
        return "no GPU clock samples"

    def number(key: str) -> str:
        value = summary.get(key)
        return "?" if value is None else f"{value:.0f}"

    fraction = summary.get("throttled_fraction")
    throttled = "?" if fraction is None else f"{fraction:.0%}"
    return (f"sm {number('sm_mhz_median')} MHz ({number('sm_mhz_min')}-{number('sm_mhz_max')}), "
            f"{number('power_w_median')} W, {number('temp_c_max')} C, throttled {throttled}")
