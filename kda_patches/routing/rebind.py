"""vLLM >= 0.34's extensible KV cache: re-validate the seam layers' plans after the rebind, republish, never compile.

With the extensible KV cache (vLLM 0.34's default on CUDA/ROCm) ``initialize_kv_cache(extensible=True)`` binds
views over the whole reservation (``shape[0]`` = capacity); after warmup ``extend_kv_cache(runner,
kv_cache_config, num_blocks)`` commits the final block count and rebinds every layer's views through
``bind_kv_caches`` -> ``MambaBase.bind_kv_cache``: the same ``data_ptr`` and strides, another ``shape[0]``. The
plans prepared at ``initialize_kv_cache`` serve the rebound views as they are: the row count is not compiled into
them (the kernels take the cache's ``shape[0]`` at each launch as ``num_rows``,
:mod:`kda_patches.state_copy.kernels`), so nothing is compiled after upstream's warmup, when vLLM's JIT monitor
is on.

The wrapper runs the original, then, once (stacked wrappers of both state-copy patches share one outermost
guard):

1. every seam layer that held a published plan before the call is compared with its rebound cache: device,
   dtype, inner ``[H, V, K]``, strides and ``data_ptr`` must be unchanged (only the row count may differ), and
   the layer's plan re-validates the rebound cache itself
   (:meth:`~kda_patches.state_copy.plan.StateCopyPlan.check_cache`: its compiled signature, which has no row
   count); a seam layer that held no plan but needs one (a cache the plans serve) is refused too, since plans
   are prepared only at ``initialize_kv_cache``, before warmup. Anything else aborts startup with a
   ``RuntimeError`` naming the layer and what changed, and no plan stays published on any layer;
2. the same bindings (the same compiled plans) are republished to all those layers at once; nothing is
   prepared or compiled;
3. the ledger fact ``rebind`` of each patch section records per layer the old and new row counts and that
   the pointer and strides were kept, with ``recompiled: False``; each layer's plan fact gets the new
   ``cache_shape``.

Without a published plan before the call (no seam layer, or caches on the CPU without the Triton interpreter) the
fact records that nothing was republished. With the extensible cache off vLLM never calls ``extend_kv_cache``:
the plans published at ``initialize_kv_cache`` are the final ones, and this module does nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from kda_patches.ledger import get_ledger
from kda_patches.outermost import OutermostCall
from kda_patches.routing.calls import read_argument
from kda_patches.routing.proof import PLAN_ATTRIBUTE, STANDS_ASIDE_ATTRIBUTE
from kda_patches.routing.startup import find_layers, find_state, seam_of
from kda_patches.state_copy.device import interpreter_active

_outermost_extend = OutermostCall()
REPUBLISHED_REASON = ("the row count (cache shape[0]) is a runtime argument of the plan's kernels, passed at each "
                      "launch, so the plans prepared at initialize_kv_cache were re-validated for the rebound caches "
                      "and republished without compiling")
NOTHING_PUBLISHED_REASON = "no plan was published before the rebind"


class RebindRefused(RuntimeError):
    """A rebound cache changed more than its row count (or a seam layer has no plan to republish)."""

    def __init__(self, section: str, layer: str, message: str) -> None:
        super().__init__(message)
        self.section = section
        self.layer = layer


def _facts(state: torch.Tensor) -> dict[str, Any]:
    return {"device": str(state.device), "dtype": str(state.dtype).replace("torch.", ""),
            "inner": list(state.shape[1:]), "strides": list(state.stride()), "data_ptr": state.data_ptr(),
            "rows": int(state.shape[0])}


def snapshot_published(runner: Any) -> dict[str, dict[str, Any]]:
    """Return the cache facts and the binding of every seam layer of ``runner`` that holds a published plan now."""
    found = {}
    for name, layer in find_layers(runner).items():
        binding = getattr(layer, PLAN_ATTRIBUTE, None)
        seam = seam_of(layer) if binding is not None else None
        if seam is not None:
            found[name] = {"section": seam.section, "binding": binding, **_facts(find_state(name, layer, seam))}
    return found


def describe_change(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """List what changed between two cache snapshots other than the row count (empty: a legal rebind).

    A rebind to one row may also change the row stride (``.view(-1, H, V, K)`` of one page reports the payload):
    its only valid row is 0, which no row stride moves.
    """
    strides = after["strides"]
    if after["rows"] == 1 and strides[1:] == before["strides"][1:]:
        strides = before["strides"]
    after = {**after, "strides": strides}
    return [f"{key} {before[key]} -> {after[key]}" for key in ("device", "dtype", "inner", "strides", "data_ptr")
            if before[key] != after[key]]


def _refusal(section: str, name: str, what: str) -> RebindRefused:
    return RebindRefused(section, name, f"{section}: worker startup aborted after extend_kv_cache: layer {name!r}"
                         f"{what}; no state-copy plan was published (restart the worker; with vLLM >= 0.34 "
                         "--no-enable-extensible-kv-cache binds the final caches at initialize_kv_cache)")


def _revalidate(before: dict[str, dict[str, Any]], layers: Any) -> dict[str, torch.Tensor]:
    """Return each previously published layer's rebound cache, or raise :class:`RebindRefused` naming the layer."""
    states = {}
    for name, old in before.items():
        layer = layers.get(name)
        seam = seam_of(layer) if layer is not None else None
        if seam is None:
            raise _refusal(old["section"], name, " left the forward context during the rebind")
        state = find_state(name, layer, seam)
        changes = describe_change(old, _facts(state))
        if changes:
            raise _refusal(old["section"], name, f"'s recurrent-state cache changed more than its row count "
                           f"({'; '.join(changes)}); a plan is only re-validated for the same pointer and strides")
        plan = getattr(old["binding"], "plan", None)
        if plan is not None and hasattr(plan, "check_cache"):
            try:
                plan.check_cache(state, name)
            except Exception as exc:
                raise _refusal(old["section"], name, f"'s rebound cache was refused by its plan: {exc}") from exc
        states[name] = state
    for name, layer in layers.items():
        if name in before:
            continue
        seam = seam_of(layer)
        if seam is None or getattr(layer, STANDS_ASIDE_ATTRIBUTE, None):  # no plan by design: its backend's copies
            continue
        state = find_state(name, layer, seam)
        if state.device.type == "cpu" and not interpreter_active():
            continue  # recorded not-prepared at initialize_kv_cache (vLLM's CPU kernels run these layers)
        raise _refusal(seam.section, name, " holds no state-copy plan from initialize_kv_cache, so none can be "
                       "republished after the rebind (plans are prepared only before warmup, never compiled after "
                       "it); the layer was bound by another path than the patched runner")
    return states


def route_extend_kv_cache(wrapped: Any, args: tuple, kwargs: dict, section: str) -> Any:
    """Run ``extend_kv_cache``, then re-validate and republish the plans without compiling (outermost call only).

    Raises:
        RuntimeError: a rebound cache changed more than its row count, its plan refused it, or a seam layer has
            no plan to republish (names the layer; nothing stays published). Whatever ``extend_kv_cache`` itself
            raises propagates after every plan was withdrawn (some layers may already hold their new views).
    """
    if _outermost_extend.active:
        return wrapped(*args, **kwargs)
    runner = read_argument(args, kwargs, 0, "runner")
    before = snapshot_published(runner)
    ledger = get_ledger()
    try:
        result, _ = _outermost_extend.run(wrapped, args, kwargs)
    except BaseException as error:  # some layers may be rebound already: none keeps a plan of the old caches
        for other in find_layers(runner).values():
            if getattr(other, PLAN_ATTRIBUTE, None) is not None:
                setattr(other, PLAN_ATTRIBUTE, None)
        ledger.count(section, "startups_failed")
        ledger.set_fact(section, "rebind", {"ok": False, "layer": None, "error": f"extend_kv_cache raised "
                                            f"{type(error).__name__}: {error}; every state-copy plan was withdrawn"})
        raise
    layers = find_layers(runner)
    try:
        states = _revalidate(before, layers)
    except Exception as error:
        failed = error.section if isinstance(error, RebindRefused) else section
        ledger.count(failed, "startups_failed")
        ledger.set_fact(failed, "rebind", {"ok": False, "layer": getattr(error, "layer", None), "error": str(error)})
        for other in layers.values():  # nothing half-published: no binding of the old caches survives
            if getattr(other, PLAN_ATTRIBUTE, None) is not None:
                setattr(other, PLAN_ATTRIBUTE, None)
        raise
    for name in before:  # all at once, after every layer passed: the same compiled plans
        setattr(layers[name], PLAN_ATTRIBUTE, before[name]["binding"])
    facts = ledger.snapshot()["facts"]
    for name, state in states.items():
        plan_fact = facts.get(before[name]["section"], {}).get(name)
        if isinstance(plan_fact, dict) and "cache_shape" in plan_fact:
            ledger.set_fact(before[name]["section"], name, {**plan_fact, "cache_shape": list(state.shape)})
    for name in sorted({entry["section"] for entry in before.values()} | {section}):
        mine = {layer: {"old_rows": entry["rows"], "new_rows": int(states[layer].shape[0]), "same_data_ptr": True,
                        "same_strides": True} for layer, entry in before.items() if entry["section"] == name}
        ledger.set_fact(name, "rebind", {"ok": True, "layers": mine, "recompiled": False,
                                         "reason": REPUBLISHED_REASON if mine else NOTHING_PUBLISHED_REASON})
        if mine:
            ledger.count(name, "rebinds", len(mine))
    return result
