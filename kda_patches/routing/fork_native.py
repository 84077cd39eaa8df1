"""Forks that ship their own Kimi state-copy plan (vllm-ascend >= 0.30): stand aside, or publish into their seam.

vllm-ascend 0.30 prepares its own plan: ``vllm_ascend.ops.kda_state_copy_plan.initialize_kda_state_copy(
static_forward_context, max_selected)`` -- called by both runners' ``initialize_kv_cache`` after the cache
is bound -- gives every layer marked ``_requires_kda_state_copy = True`` a sealed ``KDAStateCopyPlan``
(fused, 950/A5 layouts) or ``StridedKDAFallbackPlan`` (byte-copy fallback, everything else) as
``layer._ascend_kda_state_copy`` and sets ``layer._kda_state_copy_ready``; ``_run_prefill`` then calls
``state_copy.gather(recurrent_state, state_indices, has_initial_state)`` and
``state_copy.scatter(recurrent_state, final_state, state_indices)``.

``kimi_prefill`` wraps that function (never the fork's ``_run_prefill``) and, after the fork's own
initialization returned:

- ``KDA_PATCHES_KIMI_PLAN=fork`` (default): changes nothing, prepares nothing; records per layer the
  fork's plan kind (``fused`` / ``fallback``) with ``decision: fork-native``;
- ``KDA_PATCHES_KIMI_PLAN=overlay``: prepares and seals the overlay's plans for the same layers (one
  :func:`~kda_patches.state_copy.worker.initialize` call, all-or-nothing), then publishes each binding as
  ``_ascend_kda_state_copy`` (the fork's seam: its gather/scatter signatures are the overlay plan's) and
  as ``_kda_state_copy_plan`` (so the overlay's compile-boundary ops resolve it), and sets
  ``_kda_state_copy_ready``. **Unverified on NPUs**: only CPU (Triton interpreter) and CUDA ran it. If the
  overlay's preparation fails, the fork's own plans stay published and startup aborts naming the layer.
"""

from __future__ import annotations

from typing import Any

from kda_patches.ledger import get_ledger
from kda_patches.routing.calls import read_argument
from kda_patches.routing.proof import PLAN_ATTRIBUTE

FORK_MARKER = "_requires_kda_state_copy"
FORK_PLAN = "_ascend_kda_state_copy"
FORK_READY = "_kda_state_copy_ready"
FORK_PLAN_KINDS = {"KDAStateCopyPlan": "fused", "StridedKDAFallbackPlan": "fallback"}
UNVERIFIED = ("unverified on NPUs: the overlay plan in the fork's seam ran only on the CPU (Triton interpreter) "
              "and CUDA; KDA_PATCHES_KIMI_PLAN=fork (default) keeps the fork's own plan")


def fork_plan_kind(plan: Any) -> str:
    """Return ``fused`` / ``fallback`` for the fork's plan classes, else ``unknown (<class>)`` (``none`` for None)."""
    if plan is None:
        return "none"
    name = type(plan).__name__
    return FORK_PLAN_KINDS.get(name, f"unknown ({name})")


def route_fork_initialize(wrapped: Any, args: tuple, kwargs: dict, section: str) -> Any:
    """Run the fork's ``initialize_kda_state_copy``; then record its plans, or publish the overlay's.

    Args:
        wrapped: the fork's function ``(static_forward_context, max_selected)``.
        args, kwargs: its arguments.
        section: the ledger section (``kimi_prefill``).
    Returns:
        The fork's return value.
    Raises:
        RuntimeError: ``overlay`` mode and a layer's overlay plan could not be prepared (names the layer).
    """
    from kda_patches import current_flags

    result = wrapped(*args, **kwargs)  # the fork prepares, seals and publishes its own plans (or raises)
    context = read_argument(args, kwargs, 0, "static_forward_context") or {}
    max_selected = read_argument(args, kwargs, 1, "max_selected")
    layers = {name: layer for name, layer in context.items() if getattr(layer, FORK_MARKER, False)}
    ledger = get_ledger()
    fork_kinds = {name: fork_plan_kind(getattr(layer, FORK_PLAN, None)) for name, layer in layers.items()}
    if current_flags().kimi_plan != "overlay" or not layers:
        for name, layer in layers.items():
            ledger.set_fact(section, name, {"decision": "fork-native", "plan_kind": fork_kinds[name],
                                            "plan_class": type(getattr(layer, FORK_PLAN, None)).__name__,
                                            "ready": bool(getattr(layer, FORK_READY, False))})
        ledger.set_fact(section, "startup", {"ok": True, "layers": len(layers), "decision": "fork-native",
                                             "reason": "the fork prepares its own Kimi state-copy plan "
                                             "(KDA_PATCHES_KIMI_PLAN=fork)"})
        return result
    publish_overlay(layers, max_selected, section, fork_kinds)
    return result


def publish_overlay(layers: dict[str, Any], max_selected: Any, section: str, fork_kinds: dict[str, str]) -> None:
    """Prepare and seal the overlay's plans for ``layers``, then publish them into the fork's seam at once.

    Raises:
        RuntimeError: naming the layer; the fork's own plans stay published.
    """
    from kda_patches.state_copy.worker import initialize

    ledger = get_ledger()
    try:
        states = {}
        for name, layer in layers.items():
            cache = getattr(layer, "kv_cache", None)
            states[name] = cache[1] if isinstance(cache, (tuple, list)) and len(cache) > 1 else None
            if states[name] is None:
                raise RuntimeError(f"{section}: overlay plan startup aborted: layer {name!r} has no bound "
                                   "recurrent-state cache kv_cache[1]; the fork's own plans stay published")
        plans = initialize(states, int(max_selected))
    except Exception as error:
        ledger.count(section, "startups_failed")
        ledger.set_fact(section, "startup", {"ok": False, "layers": len(layers), "decision": "overlay",
                                             "error": str(error)})
        if isinstance(error, RuntimeError):
            raise
        raise RuntimeError(f"{section}: overlay plan startup aborted: {type(error).__name__}: {error}; the "
                           "fork's own plans stay published") from error
    for name, layer in layers.items():
        setattr(layer, FORK_PLAN, plans[name])
        setattr(layer, PLAN_ATTRIBUTE, plans[name])
        setattr(layer, FORK_READY, True)
    for name in layers:
        ledger.set_fact(section, name, {"decision": "overlay", "plan_kind": plans[name].kind,
                                        "fork_plan_replaced": fork_kinds[name], "verified": UNVERIFIED})
    ledger.set_fact(section, "startup", {"ok": True, "layers": len(layers), "decision": "overlay",
                                         "max_num_seqs": int(max_selected), "verified": UNVERIFIED})
