"""Parent side of the released-code A/B runs: fresh processes per side, each running a batch of cases.

Baseline = ``KDA_PATCHES=0``; patched = ``KDA_PATCHES=1`` (some batches add switches, or a third side); all
``KDA_PATCHES_STRICT=1`` and ``TRITON_INTERPRET=1``. A :class:`Batch` declares one configuration (a child script
and its group arguments, e.g. a release) and its cases; :func:`run_batch` runs each side's child once, all cases
in it (:mod:`batch_child`; issue 28: a fresh process costs ~12 s of imports and ~1 s per case), each case with
its own fresh seed (printed on failure), and keeps every case's results for the per-case tests, which compare
the sides bitwise (:func:`compare_runs`).
"""

from __future__ import annotations

import dataclasses
import json
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


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a batch: the overlay off (``KDA_PATCHES=0``) or on, plus extra switches (``(name, value)``)."""

    patched: bool
    extra: tuple[tuple[str, str], ...] = ()

    def env(self) -> dict[str, str]:
        """Return the side's environment (:func:`child_env`)."""
        return child_env(self.patched, dict(self.extra))

    def switches(self) -> str:
        """Return the side's switches as written in failure messages (the overlay's, then the extra ones)."""
        env = self.env()
        named = [key for key in sorted(env) if key.startswith("KDA_PATCHES")]
        named += [key for key, _ in self.extra if key not in named]
        return " ".join(f"{key}={env[key]}" for key in named)


AB = (("baseline", Side(False)), ("patched", Side(True)))


@dataclasses.dataclass(frozen=True)
class Batch:
    """Declaration: one child process per side runs every case of one configuration (:mod:`batch_child`).

    Cases can share a process when they load the same release files under the same module names with the same
    switches; each case draws from its own fresh seed. :func:`run_batch` runs a batch once per pytest process
    (tests in several files that declare the same batch share its processes).

    Attributes:
        title: the configuration, in every failure message (with the case, its seed and the side's switches).
        script: the child script (``setup`` / ``run_case`` / ``describe`` served by :func:`batch_child.serve`).
        args: the group arguments the child's ``setup`` gets (e.g. the release).
        cases: case ids, run in this order.
        sides: ``(name, Side)`` pairs; every side runs at once, in its own fresh process.
        only: ``(case, sides)`` pairs for cases that run on some sides only (default: every side).
    """

    title: str
    script: str
    args: tuple[str, ...]
    cases: tuple[str, ...]
    sides: tuple[tuple[str, Side], ...] = AB
    only: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def runs_on(self, case: str, side: str) -> bool:
        """Whether ``case`` runs on ``side``."""
        return side in dict(self.only).get(case, dict(self.sides))


@dataclasses.dataclass
class BatchRun:
    """What one run of a :class:`Batch` left: per side the saved dict, or why the side's process failed."""

    batch: Batch
    seeds: dict[str, int]
    saved: dict[str, dict[str, Any]]
    failures: dict[str, str]

    def context(self, case: str) -> str:
        """Return the failure-message line naming the configuration, the case and its seed."""
        return f"{self.batch.title}: case {case}, seed {self.seeds[case]}"

    def process(self, side: str, case: str | None = None) -> dict[str, Any]:
        """Return the side's saved dict (every case); ``case`` only names the test asking in a failure.

        Raises:
            AssertionError: the side's process failed (exit status, output tail, the configuration).
        """
        if side in self.failures:
            named = f"{self.context(case)}\n" if case is not None else f"{self.batch.title}\n"
            raise AssertionError(f"{named}{side} ({dict(self.batch.sides)[side].switches()}): "
                                 f"{self.failures[side]}")
        return self.saved[side]

    def case(self, case: str, side: str) -> dict[str, Any]:
        """Return one case's results on one side, with the process-wide entries (``bound``, ...) beside them.

        Its ``ledger`` is the snapshot right after the case with the counters of setup and of this case only.
        Raises:
            AssertionError: the side's process failed, or this case raised there (its traceback).
        """
        saved = self.process(side, case)
        if case not in saved["cases"]:
            raise AssertionError(f"{self.context(case)}\n{side}: the case did not run on this side")
        result = saved["cases"][case]
        if "error" in result:
            raise AssertionError(f"{self.context(case)}\n{side} ({dict(self.batch.sides)[side].switches()}) "
                                 f"raised in this case:\n{result['error']}")
        return {**{key: value for key, value in saved.items() if key != "cases"}, **result}

    def pair(self, case: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Return ``(baseline, patched)`` results of one case of an A/B batch."""
        return self.case(case, "baseline"), self.case(case, "patched")


_RUNS: dict[Batch, BatchRun] = {}


def run_batch(batch: Batch) -> BatchRun:
    """Run ``batch`` (every side at once, fresh seeds per case) the first time it is asked for; return its run.

    A side whose process fails (non-zero exit, no results, a timeout) is recorded, not raised: each case's test
    then fails naming it (:meth:`BatchRun.case`).
    """
    if batch in _RUNS:
        return _RUNS[batch]
    seeds = {case: fresh_seed() for case in batch.cases}
    saved, failures = {}, {}
    with tempfile.TemporaryDirectory(prefix="kda-released-") as folder:
        procs, outs = {}, {}
        for side, spec in batch.sides:
            outs[side] = os.path.join(folder, f"{side}.pt")
            cases = [[case, seeds[case], slot] for slot, case in enumerate(batch.cases) if batch.runs_on(case, side)]
            command = [sys.executable, str(HERE / batch.script),
                       json.dumps({"args": list(batch.args), "cases": cases}), outs[side]]
            procs[side] = subprocess.Popen(command, env=spec.env(), cwd=str(HERE), stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)
        for side, proc in procs.items():
            try:
                log = proc.communicate(timeout=CHILD_TIMEOUT_S)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                log = proc.communicate()[0] + f"\n(killed after {CHILD_TIMEOUT_S} s)"
            if proc.returncode != 0 or not os.path.isfile(outs[side]):
                failures[side] = f"child {batch.script} {list(batch.args)} exited {proc.returncode}:\n{log[-6000:]}"
            else:
                saved[side] = torch.load(outs[side], weights_only=False)
    _RUNS[batch] = BatchRun(batch, seeds, saved, failures)
    return _RUNS[batch]


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
