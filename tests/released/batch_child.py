"""Child side of a released-code batch: one process runs every case of one configuration (issue 28).

A child script declares three functions and hands them to :func:`serve` (its ``__main__``):

- ``setup(args, cases)``: everything the cases share -- the overlay activated, the release's files installed
  under their real names, the stand-ins -- for the group arguments ``args`` (e.g. the release) and the case
  ids that will run (so only what they need is loaded); returns the child's own state object;
- ``run_case(state, case, seed)``: one case, its layers and inputs drawn from its own generator seeded with
  ``seed`` (fresh per case, chosen by the parent), so a case's results do not depend on the other cases;
  returns the case's saved dict (``outputs``, ``snapshots``, ...);
- ``describe(state)``: what the whole process reports once (``bound``, ...).

``python CHILD.py SPEC OUT``: ``SPEC`` is JSON ``{"args": [...], "cases": [[case, seed, slot], ...]}`` (``slot``:
the case's position in its batch's full case list, the same on every side even where a side runs only some of the
cases; a child that numbers per-case objects, e.g. layer names, reads it as :data:`current_slot`); ``OUT`` gets a
``torch.save`` dict ``{"cases": {case: dict}, "ledger": final snapshot, **describe(state)}``. A case that
raises is recorded as ``{"error": traceback}`` and the next case runs (its test reports it; the others keep
their results). Each case's dict also gets ``counters`` (the ledger counters that changed during the case, as
increments) and ``ledger``: the ledger snapshot right after the case, its ``counters`` being the ones counted
during setup plus the case's -- what the process's ledger would hold had the process run only that case.

Once the results are written the process ends without Python's interpreter teardown (seconds of freeing torch
and vLLM objects on this 2-core machine): ``atexit`` handlers run (the overlay's ledger flush is one), the
standard streams are flushed, and ``os._exit`` leaves with the real status (:func:`kda_test_fast_exit.finish`):
0 once the results are saved, the ``SystemExit`` code, or 1 after an uncaught exception (traceback printed).
"""

from __future__ import annotations

import copy
import json
import pathlib
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(1, str(HERE.parent / "fast_exit"))  # tests/fast_exit: kda_test_fast_exit (imports nothing heavy)

import kda_test_fast_exit  # noqa: E402  (after its folder is on sys.path)

current_slot = 0  # the running case's slot (see the module docstring), set before each run_case


def counter_delta(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """Return the ledger counters that changed between two snapshots, as increments per section."""
    delta: dict[str, dict[str, int]] = {}
    for section, values in after.get("counters", {}).items():
        old = before.get("counters", {}).get(section, {})
        changed = {key: value - old.get(key, 0) for key, value in values.items() if value != old.get(key, 0)}
        if changed:
            delta[section] = changed
    return delta


def counter_sum(first: dict[str, dict[str, int]], second: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Return the section-wise sum of two counter tables."""
    total = {section: dict(values) for section, values in first.items()}
    for section, values in second.items():
        for key, value in values.items():
            total.setdefault(section, {})[key] = total.get(section, {}).get(key, 0) + value
    return total


def run_batch(spec: dict[str, Any], out: str, setup: Callable[[list[str], list[str]], Any],
              run_case: Callable[[Any, str, int], dict[str, Any]], describe: Callable[[Any], dict[str, Any]]) -> None:
    """Set up once, run every case of ``spec`` (errors recorded per case) and save the results to ``out``."""
    import torch

    global current_slot
    cases = [(str(case), int(seed), int(slot[0]) if slot else position)
             for position, (case, seed, *slot) in enumerate(spec["cases"])]
    state = setup(list(spec["args"]), [case for case, _, _ in cases])
    ledger = sys.modules["kda_patches"].get_ledger()  # setup activated the overlay
    at_setup = counter_delta({}, ledger.snapshot())
    results = {}
    for case, seed, slot in cases:
        current_slot = slot
        before = ledger.snapshot()
        try:
            result = run_case(state, case, seed)
        except Exception:  # recorded for this case's test; the other cases still run
            result = {"error": traceback.format_exc()}
        after = copy.deepcopy(ledger.snapshot())
        result["counters"] = counter_delta(before, after)
        result["ledger"] = {**after, "counters": counter_sum(at_setup, result["counters"])}
        results[case] = result
    torch.save({"cases": results, "ledger": ledger.snapshot(), **describe(state)}, out)


def serve(setup: Callable[[list[str], list[str]], Any], run_case: Callable[[Any, str, int], dict[str, Any]],
          describe: Callable[[Any], dict[str, Any]]) -> NoReturn:
    """The child's ``__main__``: :func:`run_batch` on ``sys.argv`` (``SPEC OUT``), then end with its status."""
    status: Any = 1
    try:
        run_batch(json.loads(sys.argv[1]), sys.argv[2], setup, run_case, describe)
        status = 0
    except SystemExit as exit_:
        status = exit_.code
        if status is not None and not isinstance(status, int):
            print(status, file=sys.stderr)  # as Python prints a non-integer exit code
    except BaseException:
        traceback.print_exc()
    kda_test_fast_exit.finish(status)

