"""Continue a serve-ab A/B that stopped before its last round (``--resume``), and stop one in time (``--time-budget``).

A device call has a wall-clock limit (600 s on the H200 machine here) and five rounds of two fresh engine processes
do not always fit in one. serve-ab writes its document after every round; ``--resume`` picks it up in the next call:
the same benchmark arguments, seed and entry, the finished rounds kept as they are, the shuffle of the next rounds
the one an uninterrupted run would have drawn. The run directories of a round that was cut off are kept beside the
others under a new name (``round3-baseline.cut1``), never reused or deleted. ``--time-budget`` stops before a round
that would not finish in the time left, so the call still returns what it measured.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

DOCUMENT = "serve_ab.json"
_ROUND_DIR = re.compile(r"round(\d+)-(baseline|patched)$")


def load_unfinished(out_dir: str, bench: list[str], seed: int, entry: str) -> dict[str, Any]:
    """Return the document of the A/B in ``out_dir`` that ``--resume`` continues.

    Args:
        out_dir: the directory of the earlier serve-ab call.
        bench, seed, entry: this call's benchmark arguments (the tiny model already filled in), shuffle seed and
            entry; each must equal the earlier call's, or the rounds would not measure the same thing.
    Raises:
        ValueError: no earlier document, a different benchmark / seed / entry, or an earlier run (warm-up included)
            that failed (a failed A/B is not continued: start a new directory).
    """
    path = os.path.join(out_dir, DOCUMENT)
    if not os.path.isfile(path):
        raise ValueError(f"--resume: {path} does not exist; nothing to continue (leave out --resume to start)")
    with open(path) as handle:
        document = json.load(handle)
    for name, ours in (("bench_args", bench), ("seed", seed), ("entry", entry)):
        if document.get(name) != ours:
            raise ValueError(f"--resume: the earlier A/B in {out_dir} ran with {name} {document.get(name)!r}, this "
                             f"call with {ours!r}; resume with the same arguments or use a new --out")
    failed = [f"warm-up {label}: {run['error']}" for label, run in document.get("warmup", {}).items()
              if run.get("error")]
    failed += [f"round {record['round']} {label}: {run['error']}" for record in document["raw"]
               for label, run in record["runs"].items() if run.get("error")]
    if failed:
        raise ValueError(f"--resume: the earlier A/B in {out_dir} has a failed run ({failed[0]}); a failed A/B is not "
                         "continued, start a new --out")
    return document


def set_aside_unfinished(out_dir: str, rounds_done: int) -> list[str]:
    """Rename the run directories of rounds the earlier call did not finish; return their new names.

    ``roundK-LABEL`` with ``K >= rounds_done`` becomes ``roundK-LABEL.cutN`` with the first free ``N`` (a round can
    be cut more than once), so the next run of that round starts in a fresh directory and the cut run's log and
    ledgers stay readable.
    """
    renamed = []
    for name in sorted(os.listdir(out_dir)):
        match = _ROUND_DIR.match(name)
        if not match or int(match.group(1)) < rounds_done:
            continue
        number = 1
        while os.path.exists(os.path.join(out_dir, f"{name}.cut{number}")):
            number += 1
        os.rename(os.path.join(out_dir, name), os.path.join(out_dir, f"{name}.cut{number}"))
        renamed.append(f"{name}.cut{number}")
    return renamed


def round_fits(elapsed_s: float, round_walls_s: list[float], budget_s: float | None) -> bool:
    """Return whether another round fits: no budget, no round timed yet, or elapsed + the longest round so far
    stays within the budget."""
    if budget_s is None or not round_walls_s:
        return True
    return elapsed_s + max(round_walls_s) <= budget_s
