"""Parent side of the released-code A/B runs: two fresh processes per case, then bitwise comparison.

Baseline = ``KDA_PATCHES=0``; patched = ``KDA_PATCHES=1``; both ``KDA_PATCHES_STRICT=1`` and
``TRITON_INTERPRET=1``; same seed (fresh per test run, printed on failure). Each child saves a
``torch.save`` dict (see the child scripts); this module runs both at once and compares them.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

import torch

HERE = pathlib.Path(__file__).resolve().parent
EXECUTED: dict[str, str] = {}  # what ran -> what was stood in (printed at the end of the session by conftest)
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
CHILD_TIMEOUT_S = 600


def fresh_seed() -> int:
    """Return a new random seed (the inputs are fresh every run; the seed is in every failure message)."""
    return int.from_bytes(os.urandom(4), "little")


def child_env(patched: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Return the environment of one side: the overlay off or on, STRICT and the Triton interpreter in both."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("KDA_PATCHES") or key == "KDA_PATCHES_RELEASE_CACHE"}
    env.update({"KDA_PATCHES": "1" if patched else "0", "KDA_PATCHES_STRICT": "1", "TRITON_INTERPRET": "1"})
    env.update(extra or {})
    return env


def run_pair(script: str, args: list[str], extra: dict[str, str] | None = None,
             base_extra: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``script ARGS... OUT`` unpatched and patched (concurrently); return both saved dicts.

    Raises:
        AssertionError: a child failed (its exit status and stderr tail are in the message).
    """
    runs = run_sides(script, args, {"baseline": child_env(False, base_extra), "patched": child_env(True, extra)})
    return runs["baseline"], runs["patched"]


def run_sides(script: str, args: list[str], envs: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    """Run ``script ARGS... OUT`` once per named environment (concurrently); return ``side -> saved dict``.

    Raises:
        AssertionError: a child failed (its side, exit status and stderr tail are in the message).
    """
    with tempfile.TemporaryDirectory(prefix="kda-released-") as folder:
        outs = {side: os.path.join(folder, f"{side}.pt") for side in envs}
        procs = {side: subprocess.Popen([sys.executable, str(HERE / script), *args, outs[side]], env=env,
                                        cwd=str(HERE), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for side, env in envs.items()}
        logs = {side: proc.communicate(timeout=CHILD_TIMEOUT_S)[0] for side, proc in procs.items()}
        for side, proc in procs.items():
            assert proc.returncode == 0, f"{side} child {script} {args} exited {proc.returncode}:\n{logs[side][-6000:]}"
        return {side: torch.load(out, weights_only=False) for side, out in outs.items()}


def raw_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Return the tensor's bits as integers (so NaN patterns compare bit for bit)."""
    return tensor.view(BITS[tensor.dtype]) if tensor.dtype in BITS else tensor


def differing(first: torch.Tensor, second: torch.Tensor) -> str | None:
    """Return a description of the first differences of two tensors' bits, or None when equal bitwise."""
    if first.shape != second.shape or first.dtype != second.dtype:
        return f"shape/dtype {tuple(first.shape)}/{first.dtype} vs {tuple(second.shape)}/{second.dtype}"
    if torch.equal(raw_bits(first), raw_bits(second)):
        return None
    where = (raw_bits(first) != raw_bits(second)).flatten().nonzero().flatten()
    return f"{where.numel()} elements differ, first at flat {where[:6].tolist()}"


def compare_runs(baseline: dict[str, Any], patched: dict[str, Any]) -> list[str]:
    """Return every difference between two runs' outputs and cache snapshots (empty when bitwise equal)."""
    problems = []
    if len(baseline["outputs"]) != len(patched["outputs"]):
        problems.append(f"{len(baseline['outputs'])} vs {len(patched['outputs'])} outputs")
    for i, (first, second) in enumerate(zip(baseline["outputs"], patched["outputs"], strict=False)):
        if (problem := differing(first, second)) is not None:
            problems.append(f"output {i}: {problem}")
    if len(baseline["snapshots"]) != len(patched["snapshots"]):
        problems.append(f"{len(baseline['snapshots'])} vs {len(patched['snapshots'])} cache snapshots")
    for step, (first, second) in enumerate(zip(baseline["snapshots"], patched["snapshots"], strict=False)):
        for name in sorted(set(first) | set(second)):
            if name not in first or name not in second:
                problems.append(f"snapshot {step}: cache {name} missing on one side")
            elif (problem := differing(first[name], second[name])) is not None:
                problems.append(f"snapshot {step} (after batch {step}), cache {name}: {problem}")
    return problems


def counters(run: dict[str, Any], path: str) -> dict[str, int]:
    """Return the ledger counters of ``path`` (e.g. ``kimi_prefill``) of a run."""
    return dict(run["ledger"].get("counters", {}).get(path, {}))


def describe_standins(run: dict[str, Any]) -> str:
    """Return the stood-in names of a run (declared list + what the release files actually bound)."""
    lines = [f"  {name}: {what}" for name, what in sorted(run["standins"].items())]
    bound = {kind: sorted(f"{module}.{name}" for module, names in run["bound"].items()
                          for name, k in names.items() if k == kind)
             for kind in ("standin", "inert", "release", "lifted")}
    lines.append(f"  bound as stand-in: {', '.join(bound['standin'])}")
    if bound["lifted"]:
        lines.append(f"  device guards lifted from release files: {', '.join(bound['lifted'])}")
    lines.append(f"  bound inert (placeholders, unused by the executed path): {', '.join(bound['inert'])}")
    lines.append(f"  executed from the release: {', '.join(bound['release'])}")
    return "\n".join(lines)


def note_run(title: str, run: dict[str, Any]) -> str:
    """Record that ``title`` was executed with ``run``'s stand-ins; return the failure-message context."""
    EXECUTED[title] = describe_standins(run)
    return f"{title}\nstood in:\n{EXECUTED[title]}"
