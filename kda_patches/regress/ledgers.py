"""Aggregate the ledgers every process of a run wrote to its status dir, and check expectations.

Each process of a run (the workload's own interpreter, vLLM's engine core, its workers) writes
``ledger-<pid>.json``. The runner reads them all with :func:`kda_patches.ledger.read_ledger_dir`
and keeps, per process: pid, role, each patch's state and reason with the targets it applied,
and the path counters. The expectations a workload declares (``patch:counter``) are checked
against these summaries: some process must have the patch ``applied`` and the counter > 0.
"""

from __future__ import annotations

import os
from typing import Any

from kda_patches.ledger import read_ledger_dir, sum_counters


def summarize_ledger(ledger: dict[str, Any]) -> dict[str, Any]:
    """Return the per-process summary of one ledger snapshot.

    Returns:
        ``{"pid", "role", "argv", "enabled", "patches": {name: {"state", "reason", "applied_targets",
        "targets"}}, "counters", "facts", "final"}``; ``targets`` keeps every target's own ``state`` and ``reason``
        (a seam the patch stood aside from is ``not-applicable`` there, with why), ``applied_targets`` names the
        applied ones; ``enabled`` is the process's ``KDA_PATCHES`` switch, ``argv`` its first
        three arguments (Ray actors are told apart by them), ``final`` the ledger's own end-of-process
        marker when it has one, else None.
    """
    patches = {}
    for name, entry in sorted(ledger.get("patches", {}).items()):
        targets = {key: {"state": target.get("state"), "reason": target.get("reason", "")}
                   for key, target in sorted(entry.get("targets", {}).items())}
        applied = [key for key, target in targets.items() if target["state"] == "applied"]
        patches[name] = {"state": entry.get("state"), "reason": entry.get("reason", ""),
                         "applied_targets": applied, "targets": targets}
    return {"pid": ledger.get("pid"), "role": ledger.get("role"), "argv": list(ledger.get("argv") or []),
            "enabled": bool((ledger.get("switches") or {}).get("KDA_PATCHES")), "patches": patches,
            "counters": {path: dict(values) for path, values in sorted(ledger.get("counters", {}).items())},
            "facts": {section: dict(values) for section, values in sorted(ledger.get("facts", {}).items())},
            "final": ledger.get("final")}


def collect_ledgers(status_dir: str) -> list[dict[str, Any]]:
    """Return the summaries of every ledger in ``status_dir`` (empty when the dir is missing), by pid."""
    if not os.path.isdir(status_dir):
        return []
    return [summarize_ledger(ledger) for ledger in read_ledger_dir(status_dir)]


def total_counters(summaries: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Return every counter summed over all processes, by path then key."""
    return sum_counters(summaries)


def check_expectation(summaries: list[dict[str, Any]], expectation: str) -> tuple[bool, str]:
    """Check one ``patch:counter`` (or bare ``patch``) expectation against a run's ledgers.

    The counter is read under the counters path named like the patch.

    Returns:
        ``(met, explanation)``: which processes satisfied it, or what was found instead.
    """
    patch, _, counter = expectation.partition(":")
    satisfied, seen = [], []
    for summary in summaries:
        state = summary["patches"].get(patch, {}).get("state", "absent")
        value = summary["counters"].get(patch, {}).get(counter, 0) if counter else None
        seen.append(f"pid {summary['pid']} {summary['role']}: {state}" + (f", {counter}={value}" if counter else ""))
        if state == "applied" and (not counter or value > 0):
            satisfied.append(f"pid {summary['pid']} {summary['role']}" + (f" {counter}={value}" if counter else ""))
    if satisfied:
        return True, f"{expectation}: met in " + "; ".join(satisfied)
    return False, f"{expectation}: NOT met in any process ({'; '.join(seen) or 'no ledgers written'})"


def find_applied_patches(summaries: list[dict[str, Any]]) -> list[str]:
    """Return ``pid role: patch`` for every patch applied in any process (a baseline must have none)."""
    found = []
    for summary in summaries:
        for name, entry in summary["patches"].items():
            if entry["state"] == "applied":
                found.append(f"pid {summary['pid']} {summary['role']}: {name}")
    return found
