"""The one routing mechanism every state-copy seam shares: read the declaration, alias, run, prove.

:func:`route_call` is what a :class:`~kda_patches.routing.wrappers.SeamWrapper` runs for one call of a
seam function:

1. a call nested inside a routed call runs plain (the outer one routes); a prefill-gated seam whose
   forward-context metadata has no prefill (decode-only, speculative-only, profile runs) runs plain and
   is not counted;
2. ``calls_seen``; the layer's published plan, or refuse (:class:`~kda_patches.routing.proof.PlanNotPublished`);
3. the cache (declared argument or ``kv_cache`` slot) is replaced by the call's routed alias; where the
   seam clears natively (``initial[~flags, ...] = 0``) the declared flags are replaced by a
   :class:`~kda_patches.routing.alias.RoutedFlags` alias too (a metadata field is set back afterwards);
4. the fork's own function runs; every replaced object is put back; the call is settled (routed or
   bypassed, :func:`~kda_patches.routing.proof.settle_route`).

:func:`route_clear` and :func:`route_gather` serve the module-level ``clear_ssm_states`` /
``gather_initial_states`` names a fork calls inside a routed call; :func:`route_final` the chunk callable
whose final state the seam scatters cast (``Seam.final``), and a layer-attribute chunk callable is shadowed
on the instance for the call by a :class:`FinalTagger`.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

from kda_patches.ledger import get_ledger
from kda_patches.routing.alias import CallRoute, make_alias, make_flags_alias, tag_final
from kda_patches.routing.proof import layer_name_of, plan_free_by_backend, report_bypass, require_plan, settle_route
from kda_patches.routing.seams import CLEAR_NATIVE, CLEAR_NONE, Argument, KVCacheSlot, MetadataField, Seam

active_call = threading.local()
_MISSING = object()


class FinalTagger:
    """Stands in for a layer's chunk-callable attribute during one routed call: tags its final state."""

    __slots__ = ("index", "route", "wrapped")

    def __init__(self, wrapped: Any, index: int, route: CallRoute) -> None:
        self.wrapped = wrapped
        self.index = index
        self.route = route

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return tag_final(self.wrapped(*args, **kwargs), self.index, self.route)


def prefill_metadata(layer: Any) -> Any:
    """Return the layer's forward-context attention metadata when its batch has prefills, else None.

    Reads ``get_forward_context().attn_metadata[layer.prefix]`` without importing vLLM (None when vLLM's
    forward context is not imported or not set, or the metadata is not a per-layer dict).
    """
    context_module = sys.modules.get("vllm.forward_context")
    if context_module is None or not context_module.is_forward_context_available():
        return None
    metadata = context_module.get_forward_context().attn_metadata
    entry = metadata.get(getattr(layer, "prefix", None)) if isinstance(metadata, dict) else None
    return entry if entry is not None and (getattr(entry, "num_prefills", 0) or 0) > 0 else None


NOT_CAPTURING, CAPTURE_EAGER, CAPTURE_RECORDING = 0, 1, 2


def breakable_capture_phase() -> int:
    """Return where this call stands in vLLM's breakable CUDA-graph capture (none before vLLM imports it).

    Returns:
        :data:`NOT_CAPTURING` (serving, replays included: a replay runs outside any capture context),
        :data:`CAPTURE_EAGER` (a capture is current but its segment is closed: the eager run that
        ``add_eager`` makes of a break while recording it -- a capture-time dummy batch, not a request), or
        :data:`CAPTURE_RECORDING` (a segment is recording: the call's kernels go into a graph that replays
        without this wrapper).
    """
    module = sys.modules.get("vllm.compilation.breakable_cudagraph")
    if module is None:
        return NOT_CAPTURING
    capture_class = module.BreakableCUDAGraphCapture
    tls = getattr(capture_class, "_tls", None)
    # vLLM's current() is getattr(cls._tls, "active", None): on a thread that never captured, that attribute
    # miss raises and catches inside (~0.5 us per routed call); the thread's own dict answers without it
    capture = tls.__dict__.get("active") if type(tls) is threading.local else capture_class.current()
    if capture is None:
        return NOT_CAPTURING
    return CAPTURE_RECORDING if getattr(capture, "_capturing", False) else CAPTURE_EAGER


CAPTURE_RECORDING_REASON = ("a breakable CUDA-graph segment was recording: its replays run the copies without any "
                            "wrapper (a seam is routed under breakable graphs only as an eager break)")


def read_argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    """Return the argument at ``position`` of ``args`` or, when not passed positionally, ``kwargs[name]``."""
    return args[position] if len(args) > position else kwargs.get(name)


def replace_argument(args: tuple, kwargs: dict, position: int, name: str, value: Any) -> tuple[tuple, dict]:
    """Return ``(args, kwargs)`` with the argument at ``position`` (or named ``name``) replaced by ``value``."""
    if len(args) > position:
        return (*args[:position], value, *args[position + 1:]), kwargs
    return args, {**kwargs, name: value}


def read_declared(where: Any, args: tuple, kwargs: dict, metadata: Any) -> Any:
    """Return the object a declaration points at (an argument or a metadata field), or None."""
    if isinstance(where, Argument):
        return read_argument(args, kwargs, where.position, where.name)
    if isinstance(where, MetadataField):
        return getattr(metadata, where.name, None)
    return None


def read_state(seam: Seam, layer: Any, args: tuple, kwargs: dict) -> Any:
    """Return the cache tensor the seam declares (argument or ``layer.kv_cache[slot]``), or None."""
    if isinstance(seam.state, Argument):
        return read_argument(args, kwargs, seam.state.position, seam.state.name)
    cache = getattr(layer, "kv_cache", None)
    slot = seam.state.slot
    return cache[slot] if isinstance(cache, (tuple, list)) and len(cache) > slot else None


def run_routed(wrapped: Any, args: tuple, kwargs: dict, route: CallRoute) -> Any:
    """Call ``wrapped`` with ``route`` active for this thread; count a failure; settle the route on success."""
    active_call.route = route
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        route.close()
        get_ledger().count(route.seam.section, "calls_failed")
        raise
    finally:
        active_call.route = None
    settle_route(route)
    return result


def route_call(seam: Seam, wrapped: Any, instance: Any, args: tuple, kwargs: dict, fold: bool = True) -> Any:
    """Run one call of a seam function with its state copy routed through the layer's plan.

    Args:
        seam: the declaration.
        wrapped: the original bound function.
        instance: the layer.
        args, kwargs: the call's arguments (``self`` excluded).
        fold: False when the function's source shows no foldable clear after its gather (the rewrite's
            refusal): the gather then takes no flags and the fork's own clear runs.
    Returns:
        The original's return value.
    Raises:
        PlanNotPublished: the layer has no published plan.
        StateCopyBypassed: under STRICT, when the call did not route exactly one gather and one scatter.
    """
    if getattr(active_call, "route", None) is not None:  # a nested override: the outer call routes
        return wrapped(*args, **kwargs)
    phase = breakable_capture_phase()
    if phase == CAPTURE_EAGER:
        seam = seam.at_capture  # a capture's dummy batch: routed, counted apart from the requests
    metadata = None
    if seam.prefill_gated:
        metadata = prefill_metadata(instance)
        if metadata is None:  # decode-only, speculative-only or no forward context: untouched, uncounted
            return wrapped(*args, **kwargs)
    section = seam.section
    if plan_free_by_backend(instance, section):
        return wrapped(*args, **kwargs)
    get_ledger().count(section, "calls_seen")
    plan = require_plan(instance, section)
    state = read_state(seam, instance, args, kwargs)
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        report_bypass(section, layer_name_of(instance), f"the declared state {seam.state!r} is not a "
                      "[N, H, V, K] tensor")
        return wrapped(*args, **kwargs)
    if phase == CAPTURE_RECORDING and seam.prefill_gated:
        report_bypass(section, layer_name_of(instance), CAPTURE_RECORDING_REASON)
        return wrapped(*args, **kwargs)
    indices = read_declared(seam.indices, args, kwargs, metadata)
    flags = None if seam.clear == CLEAR_NONE or not fold else read_declared(seam.flags, args, kwargs, metadata)
    route = CallRoute(seam, layer_name_of(instance), plan, state, indices, flags)
    proxy = make_alias(route)
    restore_cache = restore_flags = None
    if isinstance(seam.state, KVCacheSlot):
        cache = instance.kv_cache
        aliased = list(cache)
        aliased[seam.state.slot] = proxy
        set_plain_attribute(instance, "kv_cache", tuple(aliased) if isinstance(cache, tuple) else aliased)
        restore_cache = cache
    else:
        args, kwargs = replace_argument(args, kwargs, seam.state.position, seam.state.name, proxy)
    if seam.clear == CLEAR_NATIVE and route.flags is not None:
        if isinstance(seam.flags, Argument):
            args, kwargs = replace_argument(args, kwargs, seam.flags.position, seam.flags.name,
                                            make_flags_alias(route))
        else:
            try:
                setattr(metadata, seam.flags.name, make_flags_alias(route))
                restore_flags = route.flags
            except (AttributeError, TypeError):  # frozen/slotted metadata: no fold, the fork clears itself
                route.flags = None
    final = seam.final
    shadowed = final is not None and final.attribute is not None and shadow_attribute(instance, final, route)
    try:
        return run_routed(wrapped, args, kwargs, route)
    finally:
        if restore_cache is not None:
            set_plain_attribute(instance, "kv_cache", restore_cache)
        if restore_flags is not None:
            setattr(metadata, seam.flags.name, restore_flags)
        if shadowed:
            unshadow_attribute(instance, final.attribute, shadowed)


def set_plain_attribute(target: Any, name: str, value: Any) -> None:
    """Set ``target.<name>``; straight into the instance ``__dict__`` when the attribute already lives there.

    For an ``nn.Module`` that is what ``Module.__setattr__`` ends up doing for a plain attribute (one that is
    not a parameter, buffer or submodule), minus its per-call type checks (two per routed call, each a visible
    share of the routed call's bookkeeping on a GPU host, ``docs/results/route-host-costs/``). Anything else (a
    property, a slot, a new attribute) goes through ``setattr``.
    """
    namespace = getattr(target, "__dict__", None)
    if namespace is not None and name in namespace:
        namespace[name] = value
    else:
        setattr(target, name, value)


def submodule_of(layer: Any, name: str) -> Any:
    """Return ``layer._modules[name]`` when attribute lookup would find it there (``nn.Module.__getattr__``'s
    answer without its Python fallback chain), else :data:`_MISSING`. A class attribute of that name wins, as
    in normal lookup."""
    modules = layer.__dict__.get("_modules")
    if type(modules) is not dict or hasattr(type(layer), name):
        return _MISSING
    return modules.get(name, _MISSING)


def shadow_attribute(layer: Any, final: Any, route: CallRoute) -> tuple[Any] | None:
    """Shadow ``layer.<final.attribute>`` on the instance with a :class:`FinalTagger` for one call.

    The instance ``__dict__`` entry wins over a class attribute and over ``nn.Module``'s submodule lookup,
    and is removed afterwards.

    Returns:
        ``(previous,)``: what the instance ``__dict__`` held under that name (:data:`_MISSING` if nothing);
        None when the layer has no such attribute (nothing shadowed: the fork's own lookup fails as it would).
    """
    attribute = final.attribute
    previous = layer.__dict__.get(attribute, _MISSING)
    current = previous if previous is not _MISSING else submodule_of(layer, attribute)
    if current is _MISSING:
        current = getattr(layer, attribute, _MISSING)
        if current is _MISSING:
            return None
    layer.__dict__[final.attribute] = FinalTagger(current, final.index, route)
    return (previous,)


def unshadow_attribute(layer: Any, attribute: str, shadowed: tuple[Any]) -> None:
    """Undo :func:`shadow_attribute`: put back the instance's own entry, or remove the shadow."""
    previous = shadowed[0]
    if previous is _MISSING:
        layer.__dict__.pop(attribute, None)
    else:
        layer.__dict__[attribute] = previous


def route_clear(wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """Elide ``clear_ssm_states(gathered, has_initial_state)`` when the plan's gather already cleared those rows."""
    route = getattr(active_call, "route", None)
    if route is not None and route.elide_clear(read_argument(args, kwargs, 0, "ssm_states"),
                                               read_argument(args, kwargs, 1, "has_initial_state")):
        return None
    return wrapped(*args, **kwargs)


def route_gather(wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """Inside a routed call, send ``gather_initial_states(alias, indices, flags)`` to the plan."""
    route = getattr(active_call, "route", None)
    if route is None or not route.open or read_argument(args, kwargs, 0, "state") is not route.proxy:
        return wrapped(*args, **kwargs)
    return route.gather(read_argument(args, kwargs, 1, "indices"), read_argument(args, kwargs, 2, "has_initial_state"))


def route_final(wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """Inside a routed call whose seam declares ``FinalFrom(function=...)``, tag the chunk callable's final state."""
    result = wrapped(*args, **kwargs)
    route = getattr(active_call, "route", None)
    if type(route) is not CallRoute or route.seam.final is None or route.seam.final.function is None:
        return result  # no alias route (a rewritten seam folds its cast from its source)
    return tag_final(result, route.seam.final.index, route)
