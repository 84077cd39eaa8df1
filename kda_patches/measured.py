"""The measured headline figures, read from the one place they are declared: ``kda_patches/measured.json``.

Stand-aside reasons, switch help texts and docstrings name a result folder and the rule that decided, never a figure
(a figure in code goes stale the day the next run lands; ``tests/test_no_figures_in_code.py``). What was measured --
the figure, the card, the date, the run and the result README that tells it -- is an entry of ``measured.json``, and
``tests/test_measured.py`` recomputes every checked value of an entry from the raw result data it names.

``kda-patches status`` and ``doctor`` print the entries beside what they explain: :func:`switch_lines` for the switch
choices, :func:`target_lines` under a target whose reason names the entry's result folder. Standard library only, and
read lazily: ``import kda_patches`` never imports this module.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

TABLE = pathlib.Path(__file__).with_name("measured.json")
_ENTRIES: list[dict[str, Any]] | None = None


def entries() -> list[dict[str, Any]]:
    """Return the entries of ``measured.json`` (read once per process).

    Each entry: ``id``, ``switch`` (the ``KDA_PATCHES_*`` choice it explains), ``targets`` (``module:qualname`` keys
    whose stand-aside it explains), ``what``, ``figure``, ``card``, ``date``, ``run``, ``source`` (the result
    README), ``data`` (the raw result files, glob patterns allowed) and ``checks`` (what the test recomputes).
    """
    global _ENTRIES
    if _ENTRIES is None:
        _ENTRIES = json.loads(TABLE.read_text(encoding="utf-8"))["entries"]
    return _ENTRIES


def result_folder(entry: dict[str, Any]) -> str:
    """Return the result folder an entry's README lies in, e.g. ``docs/results/h200-vllm-layers``."""
    return str(pathlib.PurePosixPath(entry["source"]).parent)


def describe(entry: dict[str, Any]) -> str:
    """Return one line: what was measured, the figure, and where (card, date, run, result README)."""
    return f"{entry['what']}: {entry['figure']} [{entry['card']}, {entry['date']}, {entry['run']}: {entry['source']}]"


def switch_lines(switches: dict[str, Any]) -> list[str]:
    """Return ``measured [SWITCH=value]: ...`` for every entry that explains one of ``switches``' choices.

    Args:
        switches: a ledger's ``switches`` (``Flags.as_dict()``); a switch it lacks is shown without a value.
    """
    return [f"measured [{entry['switch']}={switches.get(entry['switch'], '?')}]: {describe(entry)}"
            for entry in entries() if entry.get("switch")]


def target_lines(target: str, reason: str | None) -> list[str]:
    """Return ``measured: ...`` for the entries about ``target`` whose result folder its ``reason`` names.

    A stand-aside reason names the result folder and the rule (e.g. ``per docs/results/h200-vllm-layers``); the
    figures that rule read are these entries. A reason that names no folder (a plain "applied") gets none.
    """
    if not reason:
        return []
    return [f"measured: {describe(entry)}" for entry in entries()
            if target in entry.get("targets", ()) and result_folder(entry) in reason]
