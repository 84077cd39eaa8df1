"""vLLM >= 0.34's extensible KV cache: re-validate and republish the seam layers' plans after the rebind.

With the extensible KV cache (vLLM 0.34's default on CUDA/ROCm) ``initialize_kv_cache(extensible=True)`` binds
views over the whole reservation (``shape[0]`` = capacity); after warmup ``extend_kv_cache(runner,
kv_cache_config, num_blocks)`` commits the final block count and rebinds every layer's views through
``bind_kv_caches`` -> ``MambaBase.bind_kv_cache``: the same ``data_ptr`` and strides, another ``shape[0]``. A
plan sealed for the first views refuses every call on the rebound ones (the row count is in its signature).

The wrapper runs the original, then, once (stacked wrappers of both state-copy patches share one outermost
guard):

1. every seam layer that held a published plan before the call is compared with its rebound cache: device,
   dtype, inner ``[H, V, K]``, strides and ``data_ptr`` must be unchanged (only the row count may differ);
   anything else aborts startup with a ``RuntimeError`` naming the layer and what changed;
2. the plans are prepared again for the rebound caches and published for all layers at once
   (:func:`~kda_patches.routing.startup.prepare_and_publish`: all or nothing, failure names the layer);
3. the ledger fact ``rebind`` of each patch section records per layer the old and new row counts and that
   the pointer and strides were kept, and ``recompiled``: the row count is still a compile-time constant of
   the plan's kernels, so the republished plans compile once more here (issue 27, deliverable 2 open: after
   vLLM's JIT monitor is on, that compile is what it would report).

Without a published plan before the call (no seam layer, or the cache was not extensible) the wrapper only
republishes what ``prepare_and_publish`` finds.
"""

from __future__ import annotations

from typing import Any

import torch

from kda_patches.ledger import get_ledger
from kda_patches.outermost import OutermostCall
from kda_patches.routing.calls import read_argument
from kda_patches.routing.proof import PLAN_ATTRIBUTE
from kda_patches.routing.startup import find_layers, find_state, prepare_and_publish, seam_of

_outermost_extend = OutermostCall()
RECOMPILED_REASON = ("the row count (cache shape[0]) is a compile-time constant of the plan's kernels, so the "
                     "republished plans compiled again after the rebind (issue 27: a runtime row bound is open)")


def _facts(state: torch.Tensor) -> dict[str, Any]:
    return {"device": str(state.device), "dtype": str(state.dtype).replace("torch.", ""),
            "inner": list(state.shape[1:]), "strides": list(state.stride()), "data_ptr": state.data_ptr(),
            "rows": int(state.shape[0])}


def snapshot_published(runner: Any) -> dict[str, dict[str, Any]]:
    """Return the cache facts of every seam layer of ``runner`` that holds a published plan now."""
    found = {}
    for name, layer in find_layers(runner).items():
        seam = seam_of(layer) if getattr(layer, PLAN_ATTRIBUTE, None) is not None else None
        if seam is not None:
            found[name] = {"section": seam.section, **_facts(find_state(name, layer, seam))}
    return found


def describe_change(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """List what changed between two cache snapshots other than the row count (empty: a legal rebind)."""
    return [f"{key} {before[key]} -> {after[key]}" for key in ("device", "dtype", "inner", "strides", "data_ptr")
            if before[key] != after[key]]


def route_extend_kv_cache(wrapped: Any, args: tuple, kwargs: dict, section: str) -> Any:
    """Run ``extend_kv_cache``, then re-validate and republish the plans (outermost call only).

    Raises:
        RuntimeError: a rebound cache changed more than its row count, or a plan could not be prepared
            (names the layer; nothing is published).
    """
    if _outermost_extend.active:
        return wrapped(*args, **kwargs)
    runner = read_argument(args, kwargs, 0, "runner")
    before = snapshot_published(runner)
    result, _ = _outermost_extend.run(wrapped, args, kwargs)
    ledger = get_ledger()
    layers = find_layers(runner)
    rebound: dict[str, dict[str, Any]] = {}
    for name, old in before.items():
        layer = layers.get(name)
        seam = seam_of(layer) if layer is not None else None
        new = _facts(find_state(name, layer, seam)) if seam is not None else None
        changes = ["the layer left the forward context"] if new is None else describe_change(old, new)
        if changes:
            error = RuntimeError(f"{old['section']}: worker startup aborted after extend_kv_cache: layer {name!r}'s "
                                 f"recurrent-state cache changed more than its row count ({'; '.join(changes)}); "
                                 "a plan is only re-validated for the same pointer and strides; no state-copy "
                                 "plan was published")
            ledger.count(old["section"], "startups_failed")
            ledger.set_fact(old["section"], "rebind", {"ok": False, "layer": name, "error": str(error)})
            for other in layers.values():  # nothing half-published: no binding of the old caches survives
                if getattr(other, PLAN_ATTRIBUTE, None) is not None:
                    setattr(other, PLAN_ATTRIBUTE, None)
            raise error
        rebound[name] = {"section": old["section"], "old_rows": old["rows"], "new_rows": new["rows"],
                         "same_data_ptr": True, "same_strides": True}
    prepare_and_publish(runner, section)
    for name in sorted({entry["section"] for entry in rebound.values()} | {section}):
        mine = {layer: {k: v for k, v in entry.items() if k != "section"} for layer, entry in rebound.items()
                if entry["section"] == name}
        ledger.set_fact(name, "rebind", {"ok": True, "layers": mine, "recompiled": bool(mine),
                                         "reason": RECOMPILED_REASON if mine else "no plan was published before "
                                         "the rebind"})
        if mine:
            ledger.count(name, "rebinds", len(mine))
    return result
