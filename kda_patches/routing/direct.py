"""The route a rewritten seam function calls directly: the plan's copies with the per-call proof, no aliases.

A seam function rewritten at apply time (:mod:`kda_patches.routing.rewrite`) calls its
:class:`DirectRoute` where the fork gathered, cleared and scattered. Per call the route holds the plan and
the cache and counts what it copied; :func:`route_direct` runs the twin and settles the call by the alias
route's rule (:func:`~kda_patches.routing.proof.settle_route`): exactly one gather and one scatter through the
plan is ``calls_routed``, anything else ``calls_bypassed`` with the reason (raised under STRICT).

Every method checks at run time what the source cannot promise: that the tensor under the cache's name *is*
the layer's cache (the object the plan was prepared for), that the index is a 1-D int32/int64 vector, that
the flags can be folded (:func:`foldable`; the pair every layer of a step reads is checked once), and that a
folded cast's source is a dtype the plan prepared. Whatever fails a check runs exactly as the fork wrote it
(torch indexing, the fork's clear, ``.to()``) and, for a copy, is left uncounted, so the call is reported
bypassed. What the plan itself checks before it launches (the cache's signature, a source's device) it
refuses, loudly; the route does not check it twice.
"""

from __future__ import annotations

from typing import Any

import torch

from kda_patches.indexed_chunk import READY as INDEXED_READY
from kda_patches.ledger import get_ledger
from kda_patches.routing.calls import (
    CAPTURE_EAGER,
    CAPTURE_RECORDING,
    CAPTURE_RECORDING_REASON,
    active_call,
    breakable_capture_phase,
    prefill_metadata,
)
from kda_patches.routing.proof import (
    PLAN_ATTRIBUTE,
    layer_name_of,
    plan_free_by_backend,
    report_bypass,
    require_plan,
)
from kda_patches.routing.seams import KVCacheSlot, Seam

_getitem = torch.Tensor.__getitem__
_setitem = torch.Tensor.__setitem__
_Tensor, _BOOL, _INT32, _INT64 = torch.Tensor, torch.bool, torch.int32, torch.int64  # read per call: no lookups


def _is_vector(key: Any) -> bool:
    """:func:`~kda_patches.routing.alias.is_index_vector`, with the names bound here."""
    return isinstance(key, _Tensor) and ((dtype := key.dtype) is _INT32 or dtype is _INT64) and key.dim() == 1


_checked_pair: tuple[Any, Any, Any] = (None, None, None)  # see foldable()


def foldable(flags: Any, indices: torch.Tensor, state: torch.Tensor) -> bool:
    """Return whether the plan's gather can take ``flags`` for the 1-D index vector ``indices`` into ``state``.

    Foldable flags are a 1-D torch.bool tensor with one flag per index, on the cache's device (the conditions
    of :func:`~kda_patches.routing.alias.foldable_flags`). A foldable pair is remembered (strong references, so
    identity cannot be reused) with the cache's device: every layer of one step reads the same metadata
    tensors, and a tensor's dtype, length and device do not change in place (``resize_`` / ``set_`` /
    ``.data =`` on attention metadata would; the plan checks both again before it launches, and refuses).
    """
    global _checked_pair
    if (isinstance(flags, _Tensor) and flags.dtype is _BOOL and flags.dim() == 1
            and flags.numel() == indices.numel()  # both 1-D: the same shape
            and (device := flags.device) == state.device):
        _checked_pair = (indices, flags, device)
        return True
    return False


def gather_as_written(state: Any, indices: Any, flags: Any, clear: Any) -> Any:
    """``state[indices]`` and the removed clear, exactly as the fork wrote them (nothing goes to the plan)."""
    packed = _getitem(state, indices)
    if flags is not None:
        run_clear(packed, flags, clear)
    return packed


def run_clear(packed: torch.Tensor, flags: Any, clear: Any) -> None:
    """Run the fork's removed clear as written: ``clear(packed, flags)``, or ``packed[~flags, ...] = 0``."""
    if clear is not None:
        clear(packed, flags)
    else:
        _setitem(packed, (~flags, Ellipsis), 0)


class DirectRoute:
    """One rewritten call's plan, cache and tallies (same counters as :class:`~kda_patches.routing.alias.CallRoute`).

    Attributes:
        plan, state: the layer's published plan and its cache tensor.
        gathers / scatters: copies that went through the plan.
        casts_folded: scatters that cast inside the plan's copy.
        vector: the last index object found to be a 1-D int32/int64 vector (the scatter reuses the answer).
        proxy: always None (no alias exists; the module-level gather wrapper then leaves calls alone).
    """

    __slots__ = ("casts_folded", "gathers", "plan", "scatters", "state", "vector")
    proxy = None
    open = True  # only ever seen while its call runs (the module-level wrappers check it)

    def __init__(self, plan: Any, state: torch.Tensor) -> None:
        self.plan = plan
        self.state = state
        self.gathers = self.scatters = self.casts_folded = 0
        self.vector = None

    def gather(self, state: torch.Tensor, indices: Any, flags: Any, clear: Any = None) -> torch.Tensor:
        """``state[indices]`` and the removed clear: ``[~flags, ...] = 0``, or ``clear(packed, flags)`` if given.

        Args:
            state, indices: the cache and the index as the fork's gather line names them.
            flags: the removed clear's flags, or None (no clear was removed).
            clear: the fork's clear function as its own call would have found it (a function clear), or None.
        """
        if state is not self.state:
            return gather_as_written(state, indices, flags, clear)  # another tensor under the cache's name
        checked = _checked_pair  # the pair every layer of this step reads, found foldable at its first layer
        remembered = flags is not None and indices is checked[0] and flags is checked[1] and state.device == checked[2]
        if not (remembered or _is_vector(indices)):
            return gather_as_written(state, indices, flags, clear)
        self.gathers += 1
        self.vector = indices
        if remembered or (flags is not None and foldable(flags, indices, state)):
            return self.plan.gather(state, indices, flags)
        packed = self.plan.gather(state, indices, None)
        if flags is not None:
            run_clear(packed, flags, clear)
        return packed

    def gather_function(self, function: Any, state: torch.Tensor, indices: Any, flags: Any,
                        **keywords: Any) -> torch.Tensor:
        """``function(state, indices, flags)`` (the fork's ``gather_initial_states`` / ``gather_ssm_states``)
        through the plan; with ``output_dtype=`` only when that is the cache's own dtype (or None).

        Anything else -- another tensor, or a gather into another dtype (the plan gathers in the cache dtype) --
        runs the fork's function as written, uncounted, so the call is reported bypassed.
        """
        wanted = keywords.get("output_dtype")  # None: the cache's dtype, as the fork's function reads it
        if state is not self.state or (wanted is not None and wanted is not state.dtype):
            return function(state, indices, flags, **keywords)
        self.gathers += 1
        return self.plan.gather(state, indices, flags)

    def scatter_through_plan(self, state: torch.Tensor, indices: Any, value: Any, casts: bool) -> bool:
        """Scatter ``value`` through the plan when this is the prepared copy; return whether it was.

        The prepared copy: the layer's cache, a 1-D int32/int64 index vector and a tensor value in the cache's
        dtype -- or, where ``casts`` (the store folds the cast), in a dtype the plan prepared (bit for bit
        torch's ``.to()``, :mod:`~kda_patches.state_copy.casts`; counted folded). A value on another device is
        the plan's to refuse (a ``RuntimeError`` before anything is written, as torch's own index_put raises).
        """
        if state is not self.state or not (indices is self.vector or _is_vector(indices)) \
                or not isinstance(value, _Tensor):
            return False
        if value.dtype is state.dtype:
            self.plan.scatter(state, value, indices)
        elif casts and value.dtype in getattr(self.plan, "final_dtypes", ()):
            self.plan.scatter(state, value, indices)
            self.casts_folded += 1
        else:
            return False
        self.scatters += 1
        return True

    def scatter(self, state: torch.Tensor, indices: Any, value: Any) -> None:
        """``state[indices] = value`` through the plan when ``value`` already has the cache's dtype."""
        if not self.scatter_through_plan(state, indices, value, casts=False):
            # another dtype makes torch's own index_put raise (Kimi Linear scatters its final state uncast): the
            # plan would cast and succeed, so the call would behave differently patched
            _setitem(state, indices, value)

    def scatter_function(self, function: Any, state: torch.Tensor, indices: Any, value: Any) -> None:
        """``function(state, indices, value)`` (vllm-ascend 0.30's ``scatter_ssm_states_``) through the plan.

        The fork's kernel stores ``value`` into the cache dtype in the same pass, and so does the plan's where it
        prepared ``value``'s dtype. Anything else runs the fork's function as written, uncounted.
        """
        if not self.scatter_through_plan(state, indices, value, casts=True):
            function(state, indices, value)

    def scatter_function_value_first(self, function: Any, state: torch.Tensor, value: Any, indices: Any) -> None:
        """``function(state, value, indices)`` (vLLM 0.34's ``scatter_states``, cast in its store) through the plan.

        The same rules as :meth:`scatter_function`; anything else runs upstream's op as written, uncounted.
        """
        if not self.scatter_through_plan(state, indices, value, casts=True):
            function(state, value, indices)

    def scatter_cast(self, state: torch.Tensor, indices: Any, final: Any) -> None:
        """``state[indices] = final.to(state.dtype)`` with the cast inside the plan's copy where it prepared one."""
        if not self.scatter_through_plan(state, indices, final, casts=True):
            self.scatter(state, indices, final.to(state.dtype))

    def elide_clear(self, states: Any, flags: Any) -> bool:
        """A module-level clear reached inside this call is never a folded one (those were removed)."""
        return False

    def problem(self) -> str | None:
        """Return why this call does not count as routed, or None when it does."""
        if self.gathers != 1 or self.scatters != 1:
            return (f"routed {self.gathers} gather(s) and {self.scatters} scatter(s) of the recurrent-state "
                    "cache through the rewritten seam, expected exactly 1 and 1: the call copied states another "
                    "way (another tensor under the cache's name, a non-vector index, or a branch without the copy)")
        return None


def read_cache(seam: Seam, layer: Any, args: tuple, kwargs: dict) -> Any:
    """Return the declared cache (``layer.kv_cache[slot]`` or the declared argument), or None."""
    where = seam.state
    if type(where) is KVCacheSlot:
        cache = layer.__dict__.get("kv_cache")
        if cache is None:
            cache = getattr(layer, "kv_cache", None)
        slot = where.slot
        return cache[slot] if isinstance(cache, (tuple, list)) and len(cache) > slot else None
    return args[where.position] if len(args) > where.position else kwargs.get(where.name)


_indexed: Any = None  # kda_patches.indexed_chunk.route, imported when a seam with an indexed twin is first routed


def indexed_route(indexed: Any, plan: Any, state: torch.Tensor, layer: Any) -> DirectRoute:
    """Return the :class:`~kda_patches.indexed_chunk.route.IndexedRoute` of a seam whose host function
    (``Seam.indexed``) has an indexed twin in this process (``KDA_PATCHES_STATE_IO`` wrapped it) for this seam (under
    ``measured`` only a seam whose ``IndexedChunk.measured`` is set), else the copy route."""
    global _indexed
    ready = INDEXED_READY.get(indexed.key) if INDEXED_READY else None
    if ready is None or (ready.measured_only and not indexed.measured):
        return DirectRoute(plan, state)
    if _indexed is None:
        from kda_patches.indexed_chunk import route as module  # deferred: imports triton

        _indexed = module
    return _indexed.IndexedRoute(plan, state, ready.derived, layer, indexed.backend, ready.min_sequences)


def route_direct(seam: Seam, twin: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Run one call of a rewritten seam function: the twin with this call's :class:`DirectRoute`.

    The prefill gate is read only when it decides something: before the call when the layer has no plan
    (a prefill call is refused before any of it runs, a decode call runs as written) or the call cannot be
    routed (no 4-D cache, a breakable CUDA-graph segment recording), and after a call that copied nothing through the
    plan (decode-only: uncounted; a prefill: bypassed). A call that routed exactly one gather and one
    scatter copied its states in the prefill branch, which is the gate's answer already.

    Args:
        seam: the declaration.
        twin: the rewritten function (``twin(route, instance, *args, **kwargs)``).
        wrapped: the original bound function (nested, unpublished and unroutable calls run it as they are).
        instance: the layer.
        args, kwargs: the call's arguments (``self`` excluded).
    Returns:
        The original's return value.
    Raises:
        PlanNotPublished: a prefill call of a layer with no published plan.
        StateCopyBypassed: under STRICT, when a prefill call did not route exactly one gather and one scatter.
    """
    active = active_call
    if getattr(active, "route", None) is not None:  # a nested seam call: the outer call routes
        return wrapped(*args, **kwargs)
    plan = getattr(instance, PLAN_ATTRIBUTE, None)
    if plan is None:
        state = None
    elif type(seam.state) is KVCacheSlot and type(cache := instance.__dict__.get("kv_cache")) is tuple:
        state = cache[seam.state.slot] if len(cache) > seam.state.slot else None  # the common case, inline
    else:
        state = read_cache(seam, instance, args, kwargs)
    phase = breakable_capture_phase()
    if phase == CAPTURE_EAGER:
        seam = seam.at_capture  # a capture's dummy batch: routed, counted apart from the requests
    if plan is None or not isinstance(state, torch.Tensor) or state.dim() != 4 or (
            phase == CAPTURE_RECORDING and seam.prefill_gated):
        return run_unroutable(seam, wrapped, instance, args, kwargs, state)
    indexed = seam.indexed
    route = DirectRoute(plan, state) if indexed is None else indexed_route(indexed, plan, state, instance)
    active.route = route
    try:
        result = twin(route, instance, *args, **kwargs)
    except BaseException:
        active.route = None
        if route.gathers or route.scatters or not seam.prefill_gated or prefill_metadata(instance) is not None:
            get_ledger().count_each(seam.section, ("calls_seen", "calls_failed"))
        raise
    active.route = None
    if route.gathers == 1 and route.scatters == 1:
        ledger = get_ledger()
        ledger.count_routed(seam.section, route.casts_folded)
        if getattr(route, "consumed", False):
            ledger.count(seam.section, "calls_indexed")
        return result
    if not (route.gathers or route.scatters) and seam.prefill_gated and prefill_metadata(instance) is None:
        return result  # decode-only, speculative-only or no forward context: the copy lines did not run
    get_ledger().count(seam.section, "calls_seen")
    report_bypass(seam.section, layer_name_of(instance), route.problem() or "unknown")
    return result


def run_unroutable(seam: Seam, wrapped: Any, instance: Any, args: tuple, kwargs: dict, state: Any) -> Any:
    """A call with no plan, no 4-D cache or inside a recording graph segment: refuse or report a prefill, run the
    rest. A layer standing aside on its backend runs as written (counted ``calls_upstream``).

    Raises:
        PlanNotPublished: a prefill call (or any call of a seam that is not prefill-gated) without a plan.
    """
    if seam.prefill_gated and prefill_metadata(instance) is None:
        return wrapped(*args, **kwargs)  # decode-only, speculative-only or no forward context: untouched
    section = seam.section
    if plan_free_by_backend(instance, section):
        return wrapped(*args, **kwargs)
    get_ledger().count(section, "calls_seen")
    require_plan(instance, section)
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        report_bypass(section, layer_name_of(instance), f"the declared state {seam.state!r} is not a "
                      "[N, H, V, K] tensor")
    else:
        report_bypass(section, layer_name_of(instance), CAPTURE_RECORDING_REASON)
    return wrapped(*args, **kwargs)
