"""Worker startup hook shared by every state-copy seam: prepare, seal and publish all plans at once.

Wrapped around the model runner's ``initialize_kv_cache`` (vLLM's V1/V2 ``GPUModelRunner``, vllm-ascend's
V1/V2 ``NPUModelRunner``) by every patch that declares seams (``kimi_prefill``, ``gdn_state_copy``); the
wrappers share one outermost-call guard, so however many are stacked (a patch each, an NPU runner calling
the GPU runner's method), exactly one runs the startup after the original returned -- the KV cache is
allocated, reshaped and bound, before any warmup forward, graph capture or request:

1. the *seam layers* are the layers of the runner's static forward context whose class resolves a method
   to a :class:`~kda_patches.routing.wrappers.SeamWrapper` (Kimi and GDN layers alike); bindings published
   to them by an earlier cache are withdrawn first;
2. each layer's cache ``layer.kv_cache[seam.cache_slot]`` (``[N, H, V, K]``) goes into ONE call of
   :func:`kda_patches.state_copy.worker.initialize` with ``max_selected = scheduler_config.max_num_seqs``:
   layers with the same layout share one compiled table whichever patch they belong to, and every plan
   is prepared and sealed before any binding exists;
3. all bindings are published at once (``layer._kda_state_copy_plan``); each layer's plan facts go to
   its seam's ledger section. A layer whose prefill backend its seam does not route (the seam's
   :class:`~kda_patches.routing.seams.BackendGate`) gets no plan: it is marked standing aside, with the reason, and
   its calls run the fork's function as written.

Any failure publishes nothing and aborts startup with a ``RuntimeError`` naming the layer and the reason.
The fork's own marker ``_requires_kda_state_copy`` (vllm-ascend >= 0.30) does NOT select a layer: such a
fork prepares its own plan (:mod:`kda_patches.routing.fork_native`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kda_patches.ledger import get_ledger
from kda_patches.outermost import OutermostCall
from kda_patches.routing.proof import PLAN_ATTRIBUTE, STANDS_ASIDE_ATTRIBUTE
from kda_patches.routing.seams import Seam

_outermost_initialize = OutermostCall()


def route_initialize_kv_cache(wrapped: Any, instance: Any, args: tuple, kwargs: dict, section: str) -> Any:
    """Run the runner's ``initialize_kv_cache``, then prepare and publish the plans (outermost call only).

    Args:
        wrapped, instance, args, kwargs: the wrapt call.
        section: ledger section of the patch whose wrapper is outermost (gets the summary even with no layer).
    Raises:
        RuntimeError: a layer's plan could not be prepared (names the layer; nothing is published).
    """
    result, outermost = _outermost_initialize.run(wrapped, args, kwargs)
    if outermost:
        prepare_and_publish(instance, section)
    return result


def seam_of(layer: Any) -> Seam | None:
    """Return the seam declaration wrapped on the layer's class (the first in MRO order), or None."""
    seen: set[str] = set()
    for klass in type(layer).__mro__:
        for name, value in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)  # a subclass override hides the parent's (wrapped) method
            seam = getattr(getattr(value, "_self_wrapper", None), "seam", None)  # a routing.wrappers.SeamWrapper
            if isinstance(seam, Seam):
                return seam
    return None


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
        raise RuntimeError("state-copy worker startup aborted: cannot read scheduler_config.max_num_seqs "
                           f"from the model runner ({type(runner).__name__}); no state-copy plan was published")
    return value


def find_state(name: str, layer: Any, seam: Seam) -> torch.Tensor:
    """Return the layer's bound recurrent-state cache ``kv_cache[seam.cache_slot]`` (``[N, H, V, K]``).

    Raises:
        RuntimeError: the cache is not bound or not 4-D (names the layer).
    """
    cache = getattr(layer, "kv_cache", None)
    slot = seam.cache_slot
    state = cache[slot] if isinstance(cache, (tuple, list)) and len(cache) > slot else None
    if not isinstance(state, torch.Tensor):
        raise RuntimeError(f"{seam.section}: worker startup aborted: layer {name!r} has no bound recurrent-state "
                           f"cache (layer.kv_cache is {type(cache).__name__}, expected entry {slot} bound by "
                           "initialize_kv_cache); no state-copy plan was published")
    if state.dim() != 4:
        raise RuntimeError(f"{seam.section}: worker startup aborted: layer {name!r} recurrent-state cache has "
                           f"shape {tuple(state.shape)}, expected [N, H, V, K]; no state-copy plan was published")
    return state


def record_cpu_layers(seams: Mapping[str, Seam], states: Mapping[str, torch.Tensor]) -> None:
    """Record the seam layers whose cache is on the CPU while the Triton interpreter is off (no plan for them).

    vLLM's CPU platform runs GDN layers through its own in-place CPU kernels (``forward_cpu``), never through
    these seams, and a compiled Triton plan cannot run on CPU tensors; a seam call of such a layer would be
    refused with :class:`~kda_patches.routing.proof.PlanNotPublished` naming it.
    """
    ledger = get_ledger()
    for name, state in states.items():
        if state.device.type == "cpu":
            ledger.set_fact(seams[name].section, name, {
                "decision": "not-prepared", "seam": seams[name].name,
                "reason": "cache on the CPU and TRITON_INTERPRET is not 1 (vLLM's CPU backend runs these layers "
                "through its own CPU kernels, not this seam); a seam call would be refused"})


# layer attributes in which the released layers name the prefill backend they picked (Kimi K3 / Qwen / Kimi Linear)
PREFILL_BACKEND_ATTRIBUTES = ("kda_prefill_backend", "gdn_prefill_backend")


def prefill_backend_of(layer: Any) -> str | None:
    """Return the prefill backend the layer picked (its first :data:`PREFILL_BACKEND_ATTRIBUTES`), or None."""
    for attribute in PREFILL_BACKEND_ATTRIBUTES:
        value = getattr(layer, attribute, None)
        if isinstance(value, str):
            return value
    return None


def mark_standing_aside(selected: Mapping[str, Any], seams: Mapping[str, Seam]) -> dict[str, Any]:
    """Mark the layers whose prefill backend their seam does not route (:class:`~kda_patches.routing.seams.
    BackendGate`): no plan, ``layer._kda_state_copy_stands_aside`` = the reason, a ``stands-aside`` fact per layer.

    Returns:
        The layers that do get a plan.
    """
    ledger = get_ledger()
    routed = {}
    for name, layer in selected.items():
        seam = seams[name]
        reason = seam.backend.stands_aside_on(layer) if seam.backend is not None else None
        setattr(layer, STANDS_ASIDE_ATTRIBUTE, reason)
        if reason is None:
            routed[name] = layer
        else:
            ledger.set_fact(seam.section, name, {
                "decision": "stands-aside", "seam": seam.name,
                "backend": str(getattr(layer, seam.backend.attribute, None)), "reason": reason})
    return routed


def prepare_and_publish(runner: Any, section: str | None = None) -> dict[str, Any]:
    """Prepare, seal and publish the plans of every seam layer of ``runner``.

    Args:
        runner: the model runner whose ``initialize_kv_cache`` just returned.
        section: a ledger section that gets a ``startup`` summary even when none of its layers is present.
    Returns:
        ``{layer_name: binding}`` as published (empty when the model has no seam layer).
    Raises:
        RuntimeError: naming the layer and the reason; nothing is published.
    """
    ledger = get_ledger()
    layers = find_layers(runner)
    by_class: dict[type, Seam | None] = {}
    seams = {}
    for name, layer in layers.items():
        if type(layer) not in by_class:
            by_class[type(layer)] = seam_of(layer)
        if by_class[type(layer)] is not None:
            seams[name] = by_class[type(layer)]
    selected = {name: layers[name] for name in seams}
    for layer in selected.values():  # their caches were just (re)bound: no stale binding may survive
        if getattr(layer, PLAN_ATTRIBUTE, None) is not None:
            setattr(layer, PLAN_ATTRIBUTE, None)
    selected = mark_standing_aside(selected, seams)
    sections = sorted({seam.section for seam in seams.values()} | ({section} if section else set()))
    if not selected:
        for name in sections:
            ledger.set_fact(name, "startup", {"ok": True, "layers": 0})
        return {}
    try:
        max_num_seqs = find_max_num_seqs(runner)
        states = {name: find_state(name, layer, seams[name]) for name, layer in selected.items()}
        from kda_patches.state_copy.device import interpreter_active
        from kda_patches.state_copy.worker import initialize

        if any(state.device.type == "cpu" for state in states.values()) and not interpreter_active():
            record_cpu_layers(seams, states)
            selected = {name: layer for name, layer in selected.items() if states[name].device.type != "cpu"}
            states = {name: states[name] for name in selected}
        from kda_patches import current_flags

        plans = initialize(states, max_num_seqs, pdl=current_flags().pdl_request()) if states else {}
        missing = sorted(set(selected) - set(plans))
        if missing:
            raise RuntimeError(f"{seams[missing[0]].section}: worker startup aborted: no plan was returned for "
                               f"layer {missing[0]!r}; no state-copy plan was published")
    except Exception as error:
        failure = error if isinstance(error, RuntimeError) else RuntimeError(
            f"state-copy worker startup aborted while preparing the plans of {sorted(selected)}: "
            f"{type(error).__name__}: {error}; no state-copy plan was published")
        for name in sections:
            ledger.count(name, "startups_failed")
            ledger.set_fact(name, "startup", {"ok": False, "layers": sum(
                seam.section == name for seam in seams.values()), "error": str(failure)})
        if failure is error:
            raise
        raise failure from error
    for name, layer in selected.items():
        setattr(layer, PLAN_ATTRIBUTE, plans[name])
    for name in selected:
        seam = seams[name]
        ledger.set_fact(seam.section, name, {
            "decision": "overlay-plan", "seam": seam.name, "plan_kind": plans[name].kind,
            "cache_shape": list(states[name].shape), "cache_dtype": str(states[name].dtype).replace("torch.", ""),
            "max_selected": max_num_seqs, "prefill_backend": prefill_backend_of(selected[name])})
    for name in sections:
        ledger.set_fact(name, "startup", {"ok": True, "layers": sum(seams[layer].section == name for layer in selected),
                                          "max_num_seqs": max_num_seqs})
    return dict(plans)
