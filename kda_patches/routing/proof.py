"""Per-call proof of a routed state copy: routed / bypassed / refused / failed, in the seam's ledger section.

A routed call counts ``calls_routed`` only when it routed exactly one gather and one scatter of its cache
and every folded clear was recognised and elided; otherwise it counts ``calls_bypassed``, records the
reason in the section's ``last_bypass`` fact, warns once per (section, layer, reason), and raises
:class:`StateCopyBypassed` under ``KDA_PATCHES_STRICT=1``. A layer without a published plan refuses the
call (``calls_refused``, :class:`PlanNotPublished`); an exception inside the call counts ``calls_failed``.
"""

from __future__ import annotations

import logging
from typing import Any

from kda_patches.ledger import get_ledger
from kda_patches.routing.alias import CallRoute

PLAN_ATTRIBUTE = "_kda_state_copy_plan"
# set by the worker startup on a seam layer whose prefill backend the seam's BackendGate does not route: the reason
STANDS_ASIDE_ATTRIBUTE = "_kda_state_copy_stands_aside"

_warned: set[tuple[str, str, str]] = set()
_logger = logging.getLogger("kda_patches")


class PlanNotPublished(RuntimeError):
    """A patched layer was asked to run prefill before its state-copy plan was published."""


class StateCopyBypassed(RuntimeError):
    """A routed call did not route exactly one gather and one scatter (raised under STRICT)."""


def layer_name_of(layer: Any) -> str:
    """Return the name a layer is known by (vLLM's ``prefix``), for messages and the ledger."""
    return getattr(layer, "prefix", None) or getattr(layer, "layer_name", None) or type(layer).__name__


def require_plan(layer: Any, section: str) -> Any:
    """Return the layer's published plan, or refuse (counted ``calls_refused``) naming the layer.

    Args:
        layer: the layer whose call is being routed.
        section: the ledger section (= patch name) of the seam.
    Raises:
        PlanNotPublished: no plan was published to this layer.
    """
    plan = getattr(layer, PLAN_ATTRIBUTE, None)
    if plan is None:
        get_ledger().count(section, "calls_refused")
        raise PlanNotPublished(
            f"{section}: layer {layer_name_of(layer)!r} has no published state-copy plan and refuses to run "
            "prefill. Plans are prepared, sealed and published by the model runner's initialize_kv_cache "
            "(worker startup); this layer was not bound through a patched runner or its startup failed. Start "
            f"the worker through a patched runner, or set KDA_PATCHES_DISABLE={section} to run the fork's own "
            "state copy.")
    return plan


def plan_free_by_backend(layer: Any, section: str) -> bool:
    """Return whether ``layer`` (with no plan) stands aside on its prefill backend, counting the call
    ``calls_upstream``: the fork's function then runs as written, both copies upstream's."""
    if getattr(layer, PLAN_ATTRIBUTE, None) is None and getattr(layer, STANDS_ASIDE_ATTRIBUTE, None):
        get_ledger().count(section, "calls_upstream")
        return True
    return False


def report_bypass(section: str, layer_name: str, reason: str) -> None:
    """Count a bypassed call, record why, warn once per (section, layer, reason), and raise under STRICT.

    Raises:
        StateCopyBypassed: ``KDA_PATCHES_STRICT=1``.
    """
    from kda_patches import current_flags

    ledger = get_ledger()
    ledger.count(section, "calls_bypassed")
    ledger.set_fact(section, "last_bypass", {"layer": layer_name, "reason": reason})
    message = f"{section}: prefill call of layer {layer_name!r} was not routed through its plan: {reason}"
    if (section, layer_name, reason) not in _warned:
        _warned.add((section, layer_name, reason))
        _logger.warning(message)
    if current_flags().strict:
        raise StateCopyBypassed(message + " (KDA_PATCHES_STRICT=1 makes this an error)")


def settle_route(route: CallRoute) -> None:
    """Close ``route`` and count the call as routed, or report it as bypassed."""
    route.close()
    if route.gathers == 1 and route.scatters == 1 and route.folded == route.elided:  # the common case, inline
        ledger = get_ledger()
        ledger.count(route.seam.section, "calls_routed")
        if route.casts_folded:
            ledger.count(route.seam.section, "casts_folded")
        return
    report_bypass(route.seam.section, route.layer_name, route.problem() or "unknown")
