"""A/B runner: run a workload unpatched then patched, each in a fresh interpreter, and compare.

The baseline run gets ``KDA_PATCHES=0``; the patched run ``KDA_PATCHES=1`` and
``KDA_PATCHES_STRICT=1`` (a skipped or failed patch raises instead of silently running the
original code). Both get their own ``KDA_PATCHES_STATUS_DIR``, so every process they start writes
its ledger; the baseline's ledgers must show no applied patch, the patched run's are aggregated
into the report. Other ``KDA_PATCHES_*`` switches of the caller (``DISABLE``/``ONLY`` for bisecting)
pass through. With a baseline directory the unpatched outputs are stored once and reused.
A workload's ``validate`` hook runs first, in this process: bad parameters are one error and no
run starts. For workloads that describe their vLLM engine, every rank's ledger is checked
(:mod:`kda_patches.regress.ranks`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from kda_patches.effects import NOT_IN_EFFECT
from kda_patches.regress import baseline as store
from kda_patches.regress.compare import Comparison, compare_outputs
from kda_patches.regress.ledgers import check_expectation, collect_ledgers, find_applied_patches
from kda_patches.regress.processes import terminate_group, wait_for_group_exit
from kda_patches.regress.ranks import RankCheck, check_ranks
from kda_patches.regress.workloads import Workload, load_callable

_OVERRIDDEN = ("KDA_PATCHES", "KDA_PATCHES_STRICT", "KDA_PATCHES_STATUS_DIR", "KDA_PATCHES_ROLE")
_LOG_TAIL_LINES = 40
# An exception line, also inside vLLM's "(EngineCore pid=N) ERROR ... [core.py:N] " log prefix.
_RAISED = re.compile(r"(?:^|\s)((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception)): (.+)$")
_RAISED_MAX = 8


@dataclass
class RunResult:
    """One side of the A/B: a run in a fresh process, or a stored baseline (``source="stored"``)."""

    label: str
    source: str = "run"
    switches: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    wall_s: float | None = None
    workload_s: float | None = None
    outputs: Any = None
    ledgers: list[dict[str, Any]] = field(default_factory=list)
    log_path: str | None = None
    log_tail: str = ""
    raised: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the outputs are available (stored, or the run exited 0 and wrote them)."""
        return self.error is None


@dataclass
class ABReport:
    """Everything the A/B found; see :func:`kda_patches.regress.report.format_report`."""

    workload: str
    target: str
    params: dict[str, Any]
    rtol: float
    atol: float
    baseline: RunResult
    patched: RunResult
    baseline_action: str = "ran"
    baseline_file: str | None = None
    comparison: Comparison | None = None
    expectations: list[tuple[bool, str]] = field(default_factory=list)
    ranks: list[RankCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    work_dir: str | None = None
    effects: dict[str, tuple[str, str]] = field(default_factory=dict)
    schedule: str = ""
    extra_baselines: list[RunResult] = field(default_factory=list)
    baseline_self: Comparison | None = None

    @property
    def verdict(self) -> str:
        """``error`` (a run failed or the baseline was patched), ``baseline unstable`` (two unpatched runs
        differ: the A/B can neither blame nor clear the overlay), ``different`` or ``equal``."""
        if self.errors or self.comparison is None:
            return "error"
        if self.baseline_self is not None and not self.baseline_self.equal:
            return "baseline unstable"
        return "equal" if self.comparison.equal else "different"

    @property
    def exit_code(self) -> int:
        """0: equal, every expectation met and every rank patched; 1: different, an expectation
        unmet (a patch applied but not in effect among them) or a rank missing/unpatched; 2: error;
        3: the baseline differs from itself."""
        if self.verdict == "error":
            return 2
        if self.verdict == "baseline unstable":
            return 3
        if (self.verdict == "different" or not all(met for met, _ in self.expectations)
                or not all(check.met for check in self.ranks)):
            return 1
        return 0


def prepare_child_env(base: dict[str, str], enabled: bool, status_dir: str,
                      pythonpath: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """Return the environment of one run: the caller's, with the A/B switches forced.

    Args:
        base: the caller's environment.
        enabled: True for the patched run (also sets ``KDA_PATCHES_STRICT=1``).
        status_dir: where every process of the run writes its ledger.
        pythonpath: directories prepended to ``PYTHONPATH`` (so test-local workloads import).
    """
    env = {key: value for key, value in base.items() if key not in _OVERRIDDEN}
    env["KDA_PATCHES"] = "1" if enabled else "0"
    if enabled:
        env["KDA_PATCHES_STRICT"] = "1"
    env["KDA_PATCHES_STATUS_DIR"] = status_dir
    env["PYTHONUNBUFFERED"] = "1"
    paths = [os.path.abspath(p) for p in pythonpath] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _read_tail(path: str, lines: int = _LOG_TAIL_LINES) -> str:
    with open(path, errors="replace") as handle:
        return "".join(handle.readlines()[-lines:])


def find_raised(path: str) -> list[str]:
    """Return the distinct exception lines of a run's log, first seen first (at most eight).

    A failure in vLLM's engine core or a worker ends the log with the parent's generic
    ``RuntimeError: Engine core initialization failed``; the root cause is an earlier line.
    """
    raised: list[str] = []
    with open(path, errors="replace") as handle:
        for line in handle:
            match = _RAISED.search(line.rstrip("\n"))
            if match:
                text = f"{match.group(1)}: {match.group(2)}"
                if text not in raised:
                    raised.append(text)
                    if len(raised) == _RAISED_MAX:
                        break
    return raised


def run_workload_process(workload: Workload, params: dict[str, Any], context: dict[str, Any], enabled: bool,
                         run_dir: str, timeout_s: float | None = None, pythonpath: tuple[str, ...] = (),
                         stream_logs: bool = False) -> RunResult:
    """Run the workload once in a fresh interpreter (its own session) and collect what it left.

    Args:
        workload: what to run.
        params: keyword parameters of the workload (JSON-able).
        context: optional runner values (``cache_dir``) passed when the workload accepts them.
        enabled: False for the baseline (``KDA_PATCHES=0``), True for the patched run.
        run_dir: empty directory for the outputs, the log and the status dir.
        timeout_s: wall-clock limit (default the workload's); the whole process group is killed.
        pythonpath: extra import directories for the child.
        stream_logs: also show the child's output live (it is always written to ``run.log``).
    Returns:
        The :class:`RunResult` (``error`` set on a non-zero exit, a timeout or missing outputs).
    """
    label = "patched" if enabled else "baseline"
    status_dir, out_path = os.path.join(run_dir, "status"), os.path.join(run_dir, "outputs.json")
    log_path = os.path.join(run_dir, "run.log")
    os.makedirs(status_dir, exist_ok=True)
    env = prepare_child_env(dict(os.environ), enabled, status_dir, pythonpath)
    switches = {key: env[key] for key in sorted(env) if key.startswith("KDA_PATCHES")}
    command = [sys.executable, "-m", "kda_patches.regress.child", "--target", workload.target,
               "--params", json.dumps(params), "--context", json.dumps(context), "--out", out_path]
    result = RunResult(label=label, switches=switches, log_path=log_path)
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                   stdout=None if stream_logs else log, stderr=None if stream_logs else log)
        try:
            result.returncode = process.wait(timeout=timeout_s or workload.timeout_s)
        except subprocess.TimeoutExpired:
            terminate_group(process.pid, process)
            result.returncode = process.wait()
            result.error = f"timed out after {timeout_s or workload.timeout_s:.0f} s"
    result.wall_s = time.perf_counter() - started
    if not wait_for_group_exit(process.pid, 30.0, process):
        terminate_group(process.pid, process)
        result.error = result.error or "processes of the run outlived it by 30 s and were terminated"
    result.log_tail = "" if stream_logs else _read_tail(log_path)
    if result.returncode != 0 and not stream_logs:
        result.raised = find_raised(log_path)
    result.ledgers = collect_ledgers(status_dir)
    if result.error is None and result.returncode != 0:
        result.error = f"exited with status {result.returncode}"
    if result.error is None:
        if not os.path.isfile(out_path):
            result.error = "exited 0 but wrote no outputs"
        else:
            with open(out_path) as handle:
                record = json.load(handle)
            result.outputs, result.workload_s = record["outputs"], record["workload_s"]
    return result


def _baseline_from_store(report: ABReport, baseline_dir: str) -> bool:
    """Fill the report's baseline from the store. Returns False when none is stored."""
    record = store.load_baseline(baseline_dir, report.workload, report.params)
    if record is None:
        return False
    report.baseline = RunResult(label="baseline", source="stored", outputs=record["outputs"],
                                wall_s=record.get("wall_s"))
    report.baseline_action = "stored"
    report.baseline_file = store.baseline_path(baseline_dir, report.workload)
    report.notes += [f"environment changed since the baseline was recorded: {line}"
                     for line in store.describe_environment_drift(record)]
    return True


def run_ab(workload: Workload, params: dict[str, Any] | None = None, *, cache_dir: str | None = None,
           baseline_dir: str | None = None, update_baseline: bool = False, rtol: float = 0.0, atol: float = 0.0,
           expect: tuple[str, ...] | None = None, work_dir: str | None = None, timeout_s: float | None = None,
           pythonpath: tuple[str, ...] = (), stream_logs: bool = False, baseline_runs: int = 1) -> ABReport:
    """Run the A/B of a workload and return the report.

    Args:
        workload: the workload (see :func:`kda_patches.regress.workloads.resolve_workload`).
        params: its keyword parameters (JSON-able; part of the baseline's identity).
        cache_dir: passed to workloads that accept ``cache_dir`` (the tiny model's cache).
        baseline_dir: baseline store; a stored baseline replaces the unpatched run, a missing one
            is recorded from this run.
        update_baseline: run unpatched and overwrite the stored baseline.
        rtol, atol: float tolerances (token ids and other integers always compare exactly).
        expect: ``patch:counter`` requirements on the patched run (default: the workload's).
        work_dir: keep logs, outputs and ledgers here (default: a temporary dir, removed unless a
            run fails).
        timeout_s: per-run wall-clock limit (default the workload's).
        pythonpath: extra import directories for the runs.
        stream_logs: show the runs' output live.
        baseline_runs: unpatched runs (>= 1); from 2 on, the later ones are compared with the first, and
            a baseline that differs from itself makes the verdict ``baseline unstable`` (never blamed on the
            overlay). A stored baseline counts as the first.
    Returns:
        The :class:`ABReport`; its ``exit_code`` is what the CLI returns.
    """
    params = json.loads(json.dumps(params or {}))
    if baseline_runs < 1:
        raise ValueError(f"baseline_runs must be at least 1, got {baseline_runs}")
    if workload.validate:
        try:
            params = load_callable(workload.validate)(params)
        except ValueError as error:
            report = ABReport(workload=workload.name, target=workload.target, params=params, rtol=rtol, atol=atol,
                              baseline=RunResult(label="baseline", source="not run"),
                              patched=RunResult(label="patched", source="not run"))
            report.errors.append(f"workload {workload.name!r}: {error}")
            return report
    keep = work_dir is not None
    work_dir = os.path.abspath(work_dir) if keep else tempfile.mkdtemp(prefix="kda-regress-")
    report = ABReport(workload=workload.name, target=workload.target, params=params, rtol=rtol, atol=atol,
                      baseline=RunResult(label="baseline", source="not run"),
                      patched=RunResult(label="patched", source="not run"), work_dir=work_dir,
                      schedule=workload.schedule)
    context = {"cache_dir": cache_dir}
    try:
        stored = bool(baseline_dir) and not update_baseline and _baseline_from_store(report, baseline_dir)
    except store.BaselineMismatch as error:
        report.errors.append(str(error))
        return report
    if not stored:
        report.baseline = run_workload_process(workload, params, context, False, _fresh_dir(work_dir, "baseline"),
                                               timeout_s, pythonpath, stream_logs)
        leaked = find_applied_patches(report.baseline.ledgers)
        if leaked:
            report.errors.append("the baseline run (KDA_PATCHES=0) applied patches: " + "; ".join(leaked))
        if report.baseline.ok and baseline_dir:
            existed = os.path.isfile(store.baseline_path(baseline_dir, workload.name))
            report.baseline_file = store.write_baseline(baseline_dir, workload.name, workload.target, params,
                                                        report.baseline.outputs, report.baseline.wall_s or 0.0)
            report.baseline_action = "updated" if existed else "created"
    if report.baseline.ok:
        for number in range(2, baseline_runs + 1):
            extra = run_workload_process(workload, params, context, False,
                                         _fresh_dir(work_dir, f"baseline{number}"), timeout_s, pythonpath,
                                         stream_logs)
            extra.label = f"baseline{number}"
            report.extra_baselines.append(extra)
            if not extra.ok:
                break
            compared = compare_outputs(report.baseline.outputs, extra.outputs, rtol, atol)
            if report.baseline_self is None or not compared.equal:
                report.baseline_self = compared
            if not compared.equal:
                break
    if report.baseline.ok:
        report.patched = run_workload_process(workload, params, context, True, _fresh_dir(work_dir, "patched"),
                                              timeout_s, pythonpath, stream_logs)
    for side in (report.baseline, *report.extra_baselines, report.patched):
        if side.error:
            report.errors.append(f"{side.label} run {side.error}")
    if report.baseline.ok and report.patched.ok:
        report.comparison = compare_outputs(report.baseline.outputs, report.patched.outputs, rtol, atol)
        expectations = workload.expect if expect is None else expect
        report.expectations = [check_expectation(report.patched.ledgers, item) for item in expectations]
        report.effects = judge_effects(report.patched.ledgers)
        report.expectations += [(False, f"{name} applied but not in effect: {reason}")
                                for name, (state, reason) in report.effects.items() if state == NOT_IN_EFFECT]
        engine = report.patched.outputs.get(workload.engine_key) if workload.engine_key and isinstance(
            report.patched.outputs, dict) else None
        if workload.engine_key and not isinstance(engine, dict):
            report.errors.append(f"the workload's outputs have no {workload.engine_key!r} engine description")
        elif engine is not None:
            report.ranks = check_ranks(engine, report.patched.ledgers)
    if not keep and not report.errors:
        shutil.rmtree(work_dir, ignore_errors=True)
        report.work_dir = None
    return report


def judge_effects(ledgers: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Return ``{patch: (effect state, reason)}`` over a run's ledgers for every patch applied in it."""
    from kda_patches.effects import EFFECTS, judge_effect

    judged = {name: judge_effect(name, ledgers) for name in EFFECTS}
    return {name: verdict for name, verdict in judged.items() if verdict is not None}


def _fresh_dir(work_dir: str, name: str) -> str:
    path = os.path.join(work_dir, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path
