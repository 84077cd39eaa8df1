"""Render an :class:`~kda_patches.regress.runner.ABReport` as text or as a JSON-able dict."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kda_patches.regress.ledgers import total_counters
from kda_patches.regress.runner import ABReport, RunResult


def _format_counters(counters: dict[str, dict[str, int]]) -> str:
    return "; ".join(f"{path}: " + " ".join(f"{key}={value}" for key, value in sorted(values.items()))
                     for path, values in sorted(counters.items()))


def _format_run(run: RunResult) -> str:
    switches = " ".join(f"{key}={value}" for key, value in run.switches.items()
                        if key in ("KDA_PATCHES", "KDA_PATCHES_STRICT", "KDA_PATCHES_DISABLE", "KDA_PATCHES_ONLY"))
    if run.source == "not run":
        return f"  {run.label:<9} not run"
    wall = "?" if run.wall_s is None else f"{run.wall_s:.1f} s"
    text = f"  {run.label:<9} {run.source:<7} wall {wall}"
    if run.workload_s is not None:
        text += f" (workload {run.workload_s:.1f} s)"
    if run.source == "run":
        text += f"  exit {run.returncode}  {len(run.ledgers)} process ledger(s)  {switches}"
    return text


def format_ledgers(ledgers: list[dict[str, Any]], title: str) -> list[str]:
    """Return report lines listing each process's pid, role, patch states and counters, then totals."""
    lines = [f"{title} ({len(ledgers)} process(es)):"]
    for entry in ledgers:
        lines.append(f"  pid {entry['pid']}  role {entry['role']}" + ("" if entry.get("final") is None
                                                                     else f"  final={entry['final']}"))
        for name, patch in entry["patches"].items():
            detail = (", ".join(patch["applied_targets"]) if patch["state"] == "applied" else patch["reason"])
            lines.append(f"    {name}: {patch['state']}" + (f" ({detail})" if detail else ""))
        if entry["counters"]:
            lines.append(f"    counters  {_format_counters(entry['counters'])}")
    totals = total_counters(ledgers)
    lines.append(f"  all processes: {_format_counters(totals) if totals else 'no counters'}")
    return lines


def format_report(report: ABReport) -> str:
    """Return the human-readable report: runs and wall times, result, expectations, ledgers."""
    lines = [f"kda-patches regress: workload {report.workload} ({report.target})"]
    if report.params:
        lines.append(f"  params    {report.params}")
    lines.append(_format_run(report.baseline))
    lines += [_format_run(run) for run in report.extra_baselines]
    lines.append(_format_run(report.patched))
    lines.append(f"  schedule  {report.schedule or 'not stated by the workload (its own engine calls decide it)'}")
    if report.baseline_file:
        lines.append(f"  baseline file {report.baseline_file} ({report.baseline_action})")
    comparison = report.comparison
    if report.baseline_self is not None:
        runs = 1 + len(report.extra_baselines)
        if report.baseline_self.equal:
            lines.append(f"  baseline self-check: {runs} unpatched runs agree ({report.baseline_self.compared} values)")
        else:
            lines.append(f"  baseline self-check: the unpatched runs DIFFER from each other "
                         f"({report.baseline_self.differing} of {report.baseline_self.compared} values); first: "
                         f"{report.baseline_self.first.describe() if report.baseline_self.first else '?'}")
    if report.verdict == "error":
        lines.append("RESULT: ERROR")
    elif report.verdict == "baseline unstable":
        lines.append("RESULT: BASELINE UNSTABLE — the workload is not reproducible without the overlay, so this A/B "
                     "can neither blame nor clear it (make the schedule deterministic, then re-run)")
    elif comparison is not None and comparison.equal:
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(comparison.kinds.items()))
        lines.append(f"RESULT: EQUAL — {comparison.compared} values compared ({kinds}); integers exact, floats "
                     f"rtol={report.rtol} atol={report.atol}, max |float diff| {comparison.max_abs_diff:.3g}")
    elif comparison is not None and comparison.first is not None:
        lines.append(f"RESULT: DIFFERENT — {comparison.differing} of {comparison.compared} values differ "
                     f"(floats rtol={report.rtol} atol={report.atol}); first difference:")
        lines.append(f"  {comparison.first.describe()}")
    lines += [f"  error: {message}" for message in report.errors]
    lines += [f"  note: {message}" for message in report.notes]
    for met, explanation in report.expectations:
        lines.append(f"  expect {'ok  ' if met else 'FAIL'} {explanation}")
    for name, (state, reason) in report.effects.items():
        lines.append(f"  effect {name}: {state.upper() if state == 'not in effect' else state} ({reason})")
    if report.ranks:
        patched = sum(check.met for check in report.ranks)
        lines.append(f"  ranks: {patched} of {len(report.ranks)} expected processes patched")
        for check in report.ranks:
            lines.append(f"    {'ok  ' if check.met else 'FAIL'} {check.label} ({check.role}): {check.detail}")
    for run in (report.baseline, report.patched):
        if run.raised:
            lines.append(f"  raised in the {run.label} run's processes (first seen first):")
            lines += [f"    {text}" for text in run.raised]
    for run in (report.baseline, report.patched):
        if run.error and run.log_tail:
            lines.append(f"--- last lines of the {run.label} run's log ({run.log_path}):")
            lines.append(run.log_tail.rstrip("\n"))
    if report.patched.source == "run":
        lines += format_ledgers(report.patched.ledgers, "ledgers of the patched run")
    if report.baseline.source == "run":
        states = sorted({f"{name}={patch['state']}" for entry in report.baseline.ledgers
                         for name, patch in entry["patches"].items()})
        lines.append(f"baseline run: {len(report.baseline.ledgers)} process ledger(s), patch states "
                     f"{', '.join(states) or 'none'}")
    if report.work_dir:
        lines.append(f"work dir (logs, outputs, ledgers): {report.work_dir}")
    return "\n".join(lines)


def report_as_dict(report: ABReport, include_outputs: bool = False) -> dict[str, Any]:
    """Return the report as a JSON-able dict (outputs left out unless ``include_outputs``)."""
    def run_dict(run: RunResult) -> dict[str, Any]:
        data = asdict(run)
        if not include_outputs:
            data.pop("outputs")
        return data

    comparison = None
    if report.comparison is not None:
        comparison = {"equal": report.comparison.equal, "compared": report.comparison.compared,
                      "differing": report.comparison.differing, "max_abs_diff": report.comparison.max_abs_diff,
                      "kinds": report.comparison.kinds,
                      "first_difference": None if report.comparison.first is None else asdict(report.comparison.first)}
    return {"workload": report.workload, "target": report.target, "params": report.params,
            "verdict": report.verdict, "exit_code": report.exit_code, "rtol": report.rtol, "atol": report.atol,
            "comparison": comparison, "baseline_action": report.baseline_action,
            "baseline_file": report.baseline_file,
            "expectations": [{"met": met, "explanation": text} for met, text in report.expectations],
            "ranks": [asdict(check) for check in report.ranks],
            "errors": report.errors, "notes": report.notes, "work_dir": report.work_dir,
            "schedule": report.schedule,
            "effects": {name: {"state": state, "reason": reason} for name, (state, reason) in report.effects.items()},
            "baseline_self_check": None if report.baseline_self is None else {
                "equal": report.baseline_self.equal, "runs": 1 + len(report.extra_baselines),
                "differing": report.baseline_self.differing},
            "runs": {"baseline": run_dict(report.baseline), "patched": run_dict(report.patched),
                     **{run.label: run_dict(run) for run in report.extra_baselines}},
            "patched_counter_totals": total_counters(report.patched.ledgers)}
