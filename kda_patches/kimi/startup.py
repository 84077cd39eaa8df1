"""Worker startup hook: prepare, seal and publish every Kimi layer's state-copy plan after cache binding.

Wrapped around the model runner's ``initialize_kv_cache`` (vLLM's V1/V2 ``GPUModelRunner``, vllm-ascend's
V1/V2 ``NPUModelRunner``). After the original returned -- the KV cache is allocated, reshaped and bound
to the layers, before any warmup forward, graph capture or request -- it:

1. finds the layers that need a plan: every layer of the runner's static forward context whose class
   resolves a seam this patch wrapped (``_run_prefill`` or upstream ``_forward``), or that is marked
   ``_requires_kda_state_copy = True``; their previous bindings (from an earlier cache) are withdrawn;
2. takes each layer's recurrent-state cache (``layer.kv_cache[1]``, ``[N, H, V, K]``) and calls
   :func:`kda_patches.state_copy.plan.initialize` with ``max_selected = scheduler_config.max_num_seqs``,
   which prepares and seals every plan before returning any binding;
3. publishes all bindings at once (``layer._kda_state_copy_plan``; the compile-boundary custom ops find
   them through vLLM's ``no_compile_layers[layer_name]``) and records each layer's plan kind.

Any failure publishes nothing and aborts startup with a ``RuntimeError`` naming the layer and the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kda_patches.kimi.routing import LEDGER_PATH, PLAN_ATTRIBUTE
from kda_patches.ledger import get_ledger
from kda_patches.outermost import OutermostCall

MARKER_ATTRIBUTE = "_requires_kda_state_copy"
SEAM_METHODS = ("_run_prefill", "_forward")

_outermost_initialize = OutermostCall()


def route_initialize_kv_cache(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Run the runner's ``initialize_kv_cache``, then prepare and publish the plans (outermost call only).

    Raises:
        RuntimeError: a layer's plan could not be prepared (names the layer; nothing is published).
    """
    result, outermost = _outermost_initialize.run(wrapped, args, kwargs)
    if outermost:  # NPUModelRunner calling GPUModelRunner's: the outer one publishes
        prepare_and_publish(instance)
    return result


def is_patched_seam(layer: Any) -> bool:
    """Return whether the layer's class resolves ``_run_prefill`` or ``_forward`` to a kimi_prefill wrapper."""
    from kda_patches.patches.kimi_prefill import SEAM_WRAPPERS

    for method in SEAM_METHODS:
        for klass in type(layer).__mro__:
            if method in vars(klass):
                if getattr(vars(klass)[method], "_self_wrapper", None) in SEAM_WRAPPERS:
                    return True
                break
    return False


def requires_state_copy(layer: Any) -> bool:
    """Return whether ``layer`` must get a plan: its class is patched here, or it is marked explicitly."""
    return getattr(layer, MARKER_ATTRIBUTE, False) is True or is_patched_seam(layer)


def find_layers(runner: Any) -> Mapping[str, Any]:
    """Return the runner's static forward context (layer name -> layer), or an empty mapping."""
    config = getattr(runner, "compilation_config", None)
    if config is None:
        config = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    layers = getattr(config, "static_forward_context", None)
    return layers if isinstance(layers, Mapping) else {}


def find_max_num_seqs(runner: Any) -> int:
    """Return ``scheduler_config.max_num_seqs`` of the runner (the most rows one prefill may select).

    Raises:
        RuntimeError: the runner has no scheduler config.
    """
    scheduler = getattr(runner, "scheduler_config", None)
    if scheduler is None:
        scheduler = getattr(getattr(runner, "vllm_config", None), "scheduler_config", None)
    value = getattr(scheduler, "max_num_seqs", None)
    if not isinstance(value, int) or value < 1:
        raise RuntimeError("kimi_prefill: worker startup aborted: cannot read scheduler_config.max_num_seqs "
                           f"from the model runner ({type(runner).__name__}); no state-copy plan was published")
    return value


def find_recurrent_state(name: str, layer: Any) -> torch.Tensor:
    """Return the layer's bound recurrent-state cache ``kv_cache[1]`` (``[N, H, V, K]``).

    Raises:
        RuntimeError: the cache is not bound or not 4-D (names the layer).
    """
    cache = getattr(layer, "kv_cache", None)
    state = cache[1] if isinstance(cache, (tuple, list)) and len(cache) > 1 else None
    if not isinstance(state, torch.Tensor):
        raise RuntimeError(f"kimi_prefill: worker startup aborted: layer {name!r} has no bound recurrent-state "
                           f"cache (layer.kv_cache is {type(cache).__name__}, expected (conv_state, "
                           "recurrent_state, ...) bound by initialize_kv_cache); no state-copy plan was published")
    if state.dim() != 4:
        raise RuntimeError(f"kimi_prefill: worker startup aborted: layer {name!r} recurrent-state cache has shape "
                           f"{tuple(state.shape)}, expected [N, H, V, K]; no state-copy plan was published")
    return state


def withdraw_plans(layers: Mapping[str, Any]) -> None:
    """Remove any previously published binding from ``layers`` (their caches were just rebound)."""
    for layer in layers.values():
        if getattr(layer, PLAN_ATTRIBUTE, None) is not None:
            setattr(layer, PLAN_ATTRIBUTE, None)


def publish_plans(layers: Mapping[str, Any], plans: Mapping[str, Any]) -> None:
    """Attach every binding to its layer (all were prepared and sealed before this is called)."""
    for name, layer in layers.items():
        setattr(layer, PLAN_ATTRIBUTE, plans[name])


def prepare_and_publish(runner: Any) -> dict[str, Any]:
    """Prepare, seal and publish the plans of every layer of ``runner`` that needs one.

    Args:
        runner: the model runner whose ``initialize_kv_cache`` just returned.
    Returns:
        ``{layer_name: binding}`` as published (empty when the model has no such layer).
    Raises:
        RuntimeError: naming the layer and the reason; nothing is published.
    """
    ledger = get_ledger()
    selected = {name: layer for name, layer in find_layers(runner).items() if requires_state_copy(layer)}
    withdraw_plans(selected)
    if not selected:
        ledger.set_fact(LEDGER_PATH, "startup", {"ok": True, "layers": 0})
        return {}
    try:
        max_num_seqs = find_max_num_seqs(runner)
        states = {name: find_recurrent_state(name, layer) for name, layer in selected.items()}
        from kda_patches.state_copy.plan import initialize

        plans = initialize(states, max_num_seqs)
        missing = sorted(set(selected) - set(plans))
        if missing:
            raise RuntimeError(f"kimi_prefill: worker startup aborted: no plan was returned for layer {missing[0]!r}; "
                               "no state-copy plan was published")
    except Exception as error:
        failure = error if isinstance(error, RuntimeError) else RuntimeError(
            f"kimi_prefill: worker startup aborted while preparing the plans of {sorted(selected)}: "
            f"{type(error).__name__}: {error}; no state-copy plan was published")
        ledger.count(LEDGER_PATH, "startups_failed")
        ledger.set_fact(LEDGER_PATH, "startup", {"ok": False, "layers": len(selected), "error": str(failure)})
        if failure is error:
            raise
        raise failure from error
    publish_plans(selected, plans)
    for name in selected:
        ledger.set_fact(LEDGER_PATH, name, {
            "plan_kind": plans[name].kind, "cache_shape": list(states[name].shape),
            "cache_dtype": str(states[name].dtype).replace("torch.", ""), "max_selected": max_num_seqs})
    ledger.set_fact(LEDGER_PATH, "startup", {"ok": True, "layers": len(selected), "max_num_seqs": max_num_seqs})
    return dict(plans)
