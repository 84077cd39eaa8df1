"""Per-call routing of a Kimi KDA layer's prefill state copy through its published plan.

Mechanism. For the duration of one prefill call the layer's recurrent-state cache is replaced by a
*routed alias*: ``cache.as_subclass(RoutedCache)``, a second tensor object over the same storage
(no copy, same version counter). ``RoutedCache`` overrides exactly two Python methods:

- ``alias[indices]`` with a 1-D int32/int64 index tensor is the gather: it returns
  ``plan.gather(cache, indices, flags)``, where ``flags`` is the call's ``has_initial_state`` when the
  index tensor is the call's own ``state_indices`` argument (the clear is folded into the gather, and
  the fork's following ``clear_ssm_states(packed, has_initial_state)`` is elided);
- ``alias[indices] = final`` is the scatter: ``plan.scatter(cache, final, indices)``.

Every other use of the alias (``.dtype``, slicing, passing it to a kernel) is plain tensor behaviour:
``__torch_function__`` is disabled on the subclass, so no other operation pays a Python dispatch. The
upstream layer gathers through the module-level ``gather_initial_states`` instead of indexing; inside a
routed call that function sends the alias's gather to the plan too.

Why this and not a ``TorchFunctionMode`` or a permanent subclass: a mode would put a Python callback on
every torch call of the chunk math; a permanent subclass would tax decode too. The alias is scoped to
one argument (or one ``kv_cache`` entry) of one call, is thread-safe, needs no change to the fork's
source, and lets unknown uses of the cache run unchanged -- which is what makes a bypass *detectable*
instead of a crash: each call must route exactly one gather and one scatter, or it is counted
``calls_bypassed`` (and raises under ``KDA_PATCHES_STRICT=1``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from kda_patches.ledger import get_ledger

LEDGER_PATH = "kimi_prefill"
PLAN_ATTRIBUTE = "_kda_state_copy_plan"
_STATE_POSITION, _INDICES_POSITION, _FLAGS_POSITION = 5, 6, 7  # in _run_prefill's args (self excluded)

active_call = threading.local()
_warned: set[tuple[str, str]] = set()
_logger = logging.getLogger("kda_patches")


class PlanNotPublished(RuntimeError):
    """A patched Kimi layer was asked to run prefill before its state-copy plan was published."""


class StateCopyBypassed(RuntimeError):
    """A patched prefill call did not route exactly one gather and one scatter (raised under STRICT)."""


class CallRoute:
    """What one patched prefill call routed: the layer's plan, its cache, and the per-call tallies.

    Attributes:
        layer_name: the layer's name (used in every message).
        plan: the layer's published plan (``gather(state, indices, flags)`` / ``scatter(state, packed, indices)``).
        state: the plain cache tensor the plan copies from and into.
        proxy: the routed alias standing in for ``state`` during the call.
        indices: the call's ``state_indices`` argument (the gather key that folds the clear), or None.
        flags: the call's ``has_initial_state`` when it can be folded into the gather, else None.
        gathers / scatters: how many gathers / scatters of this cache were routed.
        folded / elided: how many gathers folded the clear / how many fork clears were elided.
        open: False once the call returned (a leaked alias then behaves like the plain cache).
    """

    __slots__ = ("elided", "flags", "folded", "gathers", "indices", "layer_name", "open", "packed", "plan",
                 "proxy", "scatters", "state")

    def __init__(self, layer_name: str, plan: Any, state: torch.Tensor, indices: Any = None,
                 flags: Any = None) -> None:
        self.layer_name = layer_name
        self.plan = plan
        self.state = state
        self.indices = indices
        self.flags = flags
        self.proxy: RoutedCache | None = None
        self.gathers = self.scatters = self.folded = self.elided = 0
        self.packed: torch.Tensor | None = None
        self.open = True

    def gather(self, indices: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
        """Gather through the plan (rows with a false flag or an invalid index come back zero)."""
        packed = self.plan.gather(self.state, indices, flags)
        self.gathers += 1
        return packed

    def gather_index(self, indices: torch.Tensor) -> torch.Tensor:
        """Route ``alias[indices]``: fold the clear when ``indices`` is the call's own ``state_indices``."""
        flags = self.flags
        if indices is not self.indices or not foldable_flags(flags, indices, self.state):
            flags = self.flags = None
        packed = self.plan.gather(self.state, indices, flags)
        self.gathers += 1
        if flags is not None:
            self.folded += 1
            self.packed = packed
        return packed

    def scatter(self, indices: torch.Tensor, packed: torch.Tensor) -> None:
        """Route ``alias[indices] = packed`` (cast to the cache dtype; invalid indices skipped)."""
        self.plan.scatter(self.state, packed, indices)
        self.scatters += 1

    def elide_clear(self, states: Any, flags: Any) -> bool:
        """Return True (and count it) when ``clear_ssm_states(states, flags)`` repeats the folded clear."""
        if self.packed is not None and states is self.packed and flags is self.flags:
            self.packed = None
            self.elided += 1
            return True
        return False

    def close(self) -> None:
        """End the call: later use of a leaked alias is plain indexing; drop references (no alias<->route cycle)."""
        self.open = False
        self.proxy = None
        self.packed = None

    def problem(self) -> str | None:
        """Return why this call does not count as routed, or None when it does."""
        if self.gathers != 1 or self.scatters != 1:
            return (f"routed {self.gathers} gather(s) and {self.scatters} scatter(s) of the recurrent-state "
                    "cache, expected exactly 1 and 1: the fork copies states another way")
        if self.folded != self.elided:
            return ("the gather folded the has_initial_state clear but the fork did not call "
                    "clear_ssm_states(gathered, has_initial_state) afterwards")
        return None


class RoutedCache(torch.Tensor):
    """Zero-copy alias of a layer's recurrent-state cache whose index get/set go to the call's plan."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getitem__(self, key: Any) -> torch.Tensor:
        route = self.__dict__.get("_kda_route")
        if route is not None and route.open and is_index_vector(key):
            return route.gather_index(key)
        return torch.Tensor.__getitem__(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        route = self.__dict__.get("_kda_route")
        if route is not None and route.open and is_index_vector(key) and isinstance(value, torch.Tensor):
            route.scatter(key, value)
            return
        torch.Tensor.__setitem__(self, key, value)


def is_index_vector(key: Any) -> bool:
    """Return whether ``key`` is a 1-D int32/int64 tensor (the gather/scatter index form)."""
    return (isinstance(key, torch.Tensor) and (key.dtype is torch.int32 or key.dtype is torch.int64)
            and key.dim() == 1)


def foldable_flags(flags: Any, indices: torch.Tensor, state: torch.Tensor) -> bool:
    """Return whether ``flags`` can be handed to the plan's gather in place of the fork's clear.

    Args:
        flags: the call's ``has_initial_state``.
        indices: the gather's index vector.
        state: the cache.
    Returns:
        True for a 1-D ``torch.bool`` tensor with one flag per index, on the cache's device.
    """
    return (isinstance(flags, torch.Tensor) and flags.dtype is torch.bool and flags.dim() == 1
            and flags.shape == indices.shape and flags.get_device() == state.get_device())


def make_alias(route: CallRoute) -> RoutedCache:
    """Create this call's routed alias of ``route.state`` (a new tensor object over the same storage).

    Not cached across calls: a cached alias would keep the cache's storage alive after vLLM detaches the
    layer's caches (sleep mode, re-initialization).
    """
    proxy = route.state.as_subclass(RoutedCache)
    proxy._kda_route = route
    route.proxy = proxy
    return proxy


def layer_name_of(layer: Any) -> str:
    """Return the name a layer is known by (vLLM's ``prefix``), for messages and the ledger."""
    return getattr(layer, "prefix", None) or getattr(layer, "layer_name", None) or type(layer).__name__


def require_plan(layer: Any) -> Any:
    """Return the layer's published plan, or refuse (counted ``calls_refused``) naming the layer.

    Raises:
        PlanNotPublished: no plan was published to this layer.
    """
    plan = getattr(layer, PLAN_ATTRIBUTE, None)
    if plan is None:
        get_ledger().count(LEDGER_PATH, "calls_refused")
        name = layer_name_of(layer)
        raise PlanNotPublished(
            f"kimi_prefill: layer {name!r} has no published state-copy plan and refuses to run prefill. Plans "
            "are prepared, sealed and published by the model runner's initialize_kv_cache (worker startup); "
            "this layer was not bound through a patched runner or its startup failed. Start the worker through "
            "a patched runner, or set KDA_PATCHES_DISABLE=kimi_prefill to run the fork's own state copy.")
    return plan


def report_bypass(layer_name: str, reason: str) -> None:
    """Count a bypassed call, record why, warn once per (layer, reason), and raise under STRICT.

    Raises:
        StateCopyBypassed: ``KDA_PATCHES_STRICT=1``.
    """
    from kda_patches import current_flags

    ledger = get_ledger()
    ledger.count(LEDGER_PATH, "calls_bypassed")
    ledger.set_fact(LEDGER_PATH, "last_bypass", {"layer": layer_name, "reason": reason})
    message = f"kimi_prefill: prefill call of layer {layer_name!r} was not routed through its plan: {reason}"
    if (layer_name, reason) not in _warned:
        _warned.add((layer_name, reason))
        _logger.warning(message)
    if current_flags().strict:
        raise StateCopyBypassed(message + " (KDA_PATCHES_STRICT=1 makes this an error)")


def settle_route(route: CallRoute) -> None:
    """Close ``route`` and count the call as routed, or report it as bypassed."""
    route.close()
    if route.gathers == 1 and route.scatters == 1 and route.folded == route.elided:  # the common case, inline
        get_ledger().count(LEDGER_PATH, "calls_routed")
        return
    report_bypass(route.layer_name, route.problem() or "unknown")


def read_argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    """Return the argument at ``position`` of ``args`` or, when not passed positionally, ``kwargs[name]``."""
    return args[position] if len(args) > position else kwargs.get(name)


def replace_argument(args: tuple, kwargs: dict, position: int, name: str, value: Any) -> tuple[tuple, dict]:
    """Return ``(args, kwargs)`` with the argument at ``position`` (or named ``name``) replaced by ``value``."""
    if len(args) > position:
        return (*args[:position], value, *args[position + 1:]), kwargs
    return args, {**kwargs, name: value}


def run_routed(wrapped: Any, args: tuple, kwargs: dict, route: CallRoute) -> Any:
    """Call ``wrapped`` with ``route`` active for this thread; count a failure; settle the route on success."""
    active_call.route = route
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        route.close()
        get_ledger().count(LEDGER_PATH, "calls_failed")
        raise
    finally:
        active_call.route = None
    settle_route(route)
    return result


def route_run_prefill(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Run vllm-ascend-shaped ``_run_prefill`` with its ``recurrent_state`` replaced by the routed alias.

    Args:
        wrapped: the original bound ``_run_prefill``.
        instance: the layer.
        args, kwargs: the call's arguments (``self`` excluded).
    Returns:
        The original's return value (the prefill output).
    Raises:
        PlanNotPublished: the layer has no published plan.
        StateCopyBypassed: under STRICT, when the call did not route exactly one gather and one scatter.
    """
    if getattr(active_call, "route", None) is not None:  # a nested override: the outer call routes
        return wrapped(*args, **kwargs)
    get_ledger().count(LEDGER_PATH, "calls_seen")
    plan = require_plan(instance)
    if len(args) > _FLAGS_POSITION:  # the forks pass everything positionally
        state, indices, flags = args[_STATE_POSITION], args[_INDICES_POSITION], args[_FLAGS_POSITION]
    else:
        state = read_argument(args, kwargs, _STATE_POSITION, "recurrent_state")
        indices = read_argument(args, kwargs, _INDICES_POSITION, "state_indices")
        flags = read_argument(args, kwargs, _FLAGS_POSITION, "has_initial_state")
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        report_bypass(layer_name_of(instance), "recurrent_state is not a [N, H, V, K] tensor")
        return wrapped(*args, **kwargs)
    route = CallRoute(layer_name_of(instance), plan, state, indices, flags)
    args, kwargs = replace_argument(args, kwargs, _STATE_POSITION, "recurrent_state", make_alias(route))
    return run_routed(wrapped, args, kwargs, route)


def route_clear_ssm_states(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Elide ``clear_ssm_states(gathered, has_initial_state)`` when the plan's gather already cleared those rows."""
    route = getattr(active_call, "route", None)
    if route is not None and route.elide_clear(read_argument(args, kwargs, 0, "ssm_states"),
                                               read_argument(args, kwargs, 1, "has_initial_state")):
        return None
    return wrapped(*args, **kwargs)
