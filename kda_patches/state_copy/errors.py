"""Errors of the state-copy plans, and the one place where refusals are recorded in the ledger.

Every refusal (a launch the plan will not make, a layout it will not prepare) is counted under the
ledger path ``state_copy`` as ``refused:<reason>`` and the latest one is kept as the fact
``state_copy/last_refusal``, so ``kda-patches status`` shows what was refused and why.
"""

from __future__ import annotations

from typing import NoReturn

from kda_patches.ledger import get_ledger

LEDGER_SECTION = "state_copy"


class StateCopyError(RuntimeError):
    """Base class of every state-copy error (a ``RuntimeError``, as the worker contract says).

    Attributes:
        reason: short machine-readable key (``unsealed``, ``signature``, ``too_many_rows``, ...).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class LayoutError(StateCopyError):
    """A cache, index, flag or packed tensor does not satisfy the plan contract."""


class StateCopyRefused(StateCopyError):
    """A plan refused to launch (or to prepare/seal); nothing was copied."""


def refuse(reason: str, message: str, layer: str | None = None, error: type[StateCopyError] = StateCopyRefused
           ) -> NoReturn:
    """Record a refusal in the ledger and raise it.

    Args:
        reason: short key, becomes the counter ``refused:<reason>``.
        message: what happened and what to do about it.
        layer: layer name the refusal concerns (prefixed to the message), if known.
        error: the exception class to raise.
    Raises:
        StateCopyError: always (``error`` instance).
    """
    text = f"layer {layer!r}: {message}" if layer else message
    ledger = get_ledger()
    ledger.count(LEDGER_SECTION, f"refused:{reason}")
    ledger.set_fact(LEDGER_SECTION, "last_refusal", {"reason": reason, "layer": layer, "message": text})
    raise error(reason, text)
