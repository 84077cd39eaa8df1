"""The upstream vLLM seam of ``kimi_prefill``: routing inside ``KimiK3DeltaAttention._forward``.

Upstream vLLM has no ``_run_prefill``; its prefill branch sits inside ``_forward`` and gathers with the
module-level ``gather_initial_states(recurrent_state, indices, has_initial_state)`` (a CUDA kernel that does
not bounds-check indices), then scatters with ``recurrent_state[indices] = last.to(recurrent_state.dtype)``.
The smallest seam that covers exactly those two copies: on batches whose forward-context metadata has
prefills, ``self.kv_cache[1]`` is the routed alias of :mod:`kda_patches.kimi.routing` for the duration of
the call, and the ``gather_initial_states`` wrapper sends a gather *of that alias* to the plan. Decode-only
calls pass through untouched and are not counted.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from kda_patches.kimi.routing import (
    LEDGER_PATH,
    CallRoute,
    active_call,
    layer_name_of,
    make_alias,
    read_argument,
    report_bypass,
    require_plan,
    run_routed,
)
from kda_patches.ledger import get_ledger


def count_prefills(layer: Any) -> int:
    """Return how many prefill sequences vLLM's forward context gives ``layer`` now (0 when unknown).

    Reads ``get_forward_context().attn_metadata[layer.prefix].num_prefills`` without importing vLLM.
    """
    context_module = sys.modules.get("vllm.forward_context")
    if context_module is None or not context_module.is_forward_context_available():
        return 0
    metadata = context_module.get_forward_context().attn_metadata
    entry = metadata.get(getattr(layer, "prefix", None)) if isinstance(metadata, dict) else None
    return int(getattr(entry, "num_prefills", 0) or 0)


def breakable_capture_active() -> bool:
    """Return whether vLLM's breakable CUDA-graph capture would record this ``_forward`` for eager replay.

    Such a replay calls the undecorated ``_forward`` without this wrapper, so its copies cannot be routed.
    """
    module = sys.modules.get("vllm.compilation.breakable_cudagraph")
    capture = module.BreakableCUDAGraphCapture.current() if module is not None else None
    return capture is not None and bool(getattr(capture, "_capturing", False))


def route_upstream_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Run upstream ``KimiK3DeltaAttention._forward``; on prefill batches route its state copy.

    The seam is the prefill branch: ``self.kv_cache[1]`` is swapped for the routed alias during the call,
    so ``gather_initial_states(alias, ...)`` (see :func:`route_gather_initial_states`) and the final
    ``alias[indices] = last.to(alias.dtype)`` go to the plan. Decode-only calls pass through untouched.
    """
    if getattr(active_call, "route", None) is not None or not count_prefills(instance):
        return wrapped(*args, **kwargs)
    get_ledger().count(LEDGER_PATH, "calls_seen")
    plan = require_plan(instance)
    cache = getattr(instance, "kv_cache", None)
    state = cache[1] if isinstance(cache, (tuple, list)) and len(cache) > 1 else None
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        report_bypass(layer_name_of(instance), "kv_cache[1] is not a [N, H, V, K] recurrent-state tensor")
        return wrapped(*args, **kwargs)
    if breakable_capture_active():
        report_bypass(layer_name_of(instance), "breakable CUDA-graph capture replays the unwrapped _forward "
                      "(VLLM_USE_BREAKABLE_CUDAGRAPH=1 is not supported by kimi_prefill)")
        return wrapped(*args, **kwargs)
    route = CallRoute(layer_name_of(instance), plan, state)
    aliased = list(cache)
    aliased[1] = make_alias(route)
    instance.kv_cache = tuple(aliased) if isinstance(cache, tuple) else aliased
    try:
        return run_routed(wrapped, args, kwargs, route)
    finally:
        instance.kv_cache = cache


def route_gather_initial_states(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Inside a routed upstream call, send ``gather_initial_states(alias, indices, flags)`` to the plan."""
    route = getattr(active_call, "route", None)
    if route is None or not route.open or read_argument(args, kwargs, 0, "state") is not route.proxy:
        return wrapped(*args, **kwargs)
    return route.gather(read_argument(args, kwargs, 1, "indices"), read_argument(args, kwargs, 2, "has_initial_state"))
