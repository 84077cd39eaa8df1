"""The routed alias of one call and its tallies: where a fork's index gather/scatter meet the plan.

Mechanism. For the duration of one routed call the layer's recurrent-state cache is replaced by a
*routed alias*: ``cache.as_subclass(RoutedCache)``, a second tensor object over the same storage (no
copy, same version counter). ``RoutedCache`` overrides exactly two Python methods:

- ``alias[indices]`` with a 1-D int32/int64 index tensor is the gather. When ``indices`` *is* the call's
  own ``state_indices`` object (identity, not equality: a same-shaped different tensor never folds) and
  the seam declares a clear, the call's ``has_initial_state`` is folded into the plan's gather, and the
  packed result is a :class:`PackedStates` tagged with the route, so the fork's clear can be recognised;
- ``alias[indices] = final`` is the scatter: ``plan.scatter(cache, final, indices)``.

The two clears a fork may run after a folded gather are elided only when provably the folded one:

- ``clear_ssm_states(packed, has_initial_state)`` (vllm-ascend): ``packed`` is the tagged result (or its
  ``.transpose(-1, -2)`` / ``.contiguous()``, which :class:`PackedStates` keeps tagged: the folded zero
  rows are zero there too) and the flags argument *is* the call's flags object;
- ``packed[~flags, ...] = 0`` (upstream): during the call the metadata's flags are a
  :class:`RoutedFlags` alias whose ``~`` returns an :class:`InvertedFlags` tagged with the route, so the
  assignment's mask is known to be exactly ``~flags`` of this call without reading a device value.

The final-state cast ``alias[indices] = final.to(alias.dtype)`` is folded into the plan's scatter where the
seam declares where its final state comes from (``Seam.final``): the declared chunk callable's result element
is a :class:`FinalStates` for the call, whose ``.to(cache dtype)`` returns a :class:`PendingCast` -- an
uncomputed cast (an allocated, unwritten tensor of the cache dtype) that the routed scatter consumes by
casting inside its own copy (one pass, no separate cast kernel). Any other use of a pending cast first
computes it with torch's own cast (``copy_``), so it behaves exactly as ``.to()``'s result; that is counted
``casts_materialized``.

Every other use of these tensors is plain tensor behaviour (``__torch_function__`` is disabled on the
subclasses except :class:`PendingCast`, so nothing else pays a Python dispatch). Each call must end with
exactly one gather, one scatter and as many elided clears as folded gathers, or it is not counted as routed
(:mod:`kda_patches.routing.proof`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree

from kda_patches.ledger import get_ledger

_disabled = torch._C._disabled_torch_function_impl


class CallRoute:
    """What one routed call copies through its plan, and the per-call tallies.

    Attributes:
        seam: the :class:`~kda_patches.routing.seams.Seam` declaration.
        layer_name: the layer's name (messages, ledger).
        plan: the layer's published plan (``gather(state, indices, flags)`` / ``scatter(state, packed, indices)``).
        state: the plain cache tensor the plan copies from and into.
        indices: the call's ``state_indices`` object (the only gather key that folds the clear), or None.
        flags: the call's ``has_initial_state`` when foldable, else None.
        proxy: the routed alias standing in for ``state`` during the call.
        gathers / scatters: gathers / scatters of this cache routed to the plan.
        folded / elided: gathers that folded the clear / fork clears recognised and elided.
        finals / casts_folded: final states tagged from the declared chunk callable / scatters that cast
            a :class:`PendingCast` inside the plan's copy.
        open: False once the call returned (a leaked alias then behaves like the plain cache).
    """

    __slots__ = ("casts_folded", "elided", "finals", "flags", "folded", "gathers", "indices", "layer_name", "open",
                 "plan", "proxy", "scatters", "seam", "state")

    def __init__(self, seam: Any, layer_name: str, plan: Any, state: torch.Tensor, indices: Any = None,
                 flags: Any = None) -> None:
        self.seam = seam
        self.layer_name = layer_name
        self.plan = plan
        self.state = state
        self.indices = indices
        self.flags = flags if foldable_flags(flags, indices, state) else None
        self.proxy: RoutedCache | None = None
        self.gathers = self.scatters = self.folded = self.elided = self.finals = self.casts_folded = 0
        self.open = True

    def gather(self, indices: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
        """Gather through the plan with the fork's own flags (a gather function such as ``gather_initial_states``)."""
        packed = self.plan.gather(self.state, indices, flags)
        self.gathers += 1
        return packed

    def gather_index(self, indices: torch.Tensor) -> torch.Tensor:
        """Route ``alias[indices]``: fold the clear only when ``indices`` is the call's own ``state_indices``."""
        flags = self.flags if indices is self.indices else None
        packed = self.plan.gather(self.state, indices, flags)
        self.gathers += 1
        if flags is None:
            return packed
        self.folded += 1
        return tag_packed(packed, self)

    def scatter(self, indices: torch.Tensor, final: torch.Tensor) -> None:
        """Route ``alias[indices] = final`` (the plan casts to the cache dtype; invalid indices skipped)."""
        self.plan.scatter(self.state, final, indices)
        self.scatters += 1

    def scatter_pending(self, indices: torch.Tensor, pending: PendingCast) -> bool:
        """Route ``alias[indices] = final.to(cache dtype)`` with the cast folded into the plan's scatter.

        Returns:
            False when ``pending`` is not this call's uncomputed cast (the caller then scatters it as a tensor).
        """
        source = pending.__dict__.get("_kda_source")
        if pending.__dict__.get("_kda_route") is not self or source is None:
            return False
        self.plan.scatter(self.state, source, indices)
        self.scatters += 1
        self.casts_folded += 1
        return True

    def can_fold_cast(self, final: torch.Tensor, dtype: Any) -> bool:
        """Return whether ``final.to(dtype)`` may become a :class:`PendingCast` the plan's scatter casts.

        True only during the call, for a cast to this cache's dtype from another dtype the plan prepared a
        folded scatter for, on the cache's device.
        """
        return (self.open and dtype is self.state.dtype and final.dtype is not dtype
                and final.device == self.state.device and final.dtype in getattr(self.plan, "final_dtypes", ()))

    def elide_clear(self, states: Any, flags: Any) -> bool:
        """Return True (and count it) when ``clear_fn(states, flags)`` repeats this call's folded clear."""
        if (self.open and self.folded > self.elided and getattr(states, "_kda_route", None) is self
                and flags is not None and flags is self.flags):
            self.elided += 1
            return True
        return False

    def elide_native_clear(self, key: Any, value: Any) -> bool:
        """Return True (and count it) when ``packed[key] = value`` is ``packed[~flags, ...] = 0`` of this call."""
        mask = key[0] if isinstance(key, tuple) and len(key) == 2 and key[1] is Ellipsis else key
        if (self.open and self.folded > self.elided and type(mask) is InvertedFlags
                and mask.__dict__.get("_kda_route") is self and type(value) in (int, float) and value == 0):
            self.elided += 1
            return True
        return False

    def close(self) -> None:
        """End the call: later use of a leaked alias is plain indexing; drop references (no alias<->route cycle)."""
        self.open = False
        self.proxy = None

    def problem(self) -> str | None:
        """Return why this call does not count as routed, or None when it does."""
        if self.gathers != 1 or self.scatters != 1:
            return (f"routed {self.gathers} gather(s) and {self.scatters} scatter(s) of the recurrent-state "
                    "cache, expected exactly 1 and 1: the fork copies states another way")
        if self.folded != self.elided:
            clear = (f"{self.seam.clear_function}(gathered, flags)" if self.seam.clear_function
                     else "gathered[~flags, ...] = 0")
            return (f"the gather folded the has_initial_state clear ({self.folded}x) but {self.elided} clear(s) "
                    f"of the form {clear} on the gathered tensor followed: the fork no longer clears that way")
        return None


class RoutedCache(torch.Tensor):
    """Zero-copy alias of a layer's recurrent-state cache whose index get/set go to the call's plan."""

    __torch_function__ = _disabled

    def __getitem__(self, key: Any) -> torch.Tensor:
        route = self.__dict__.get("_kda_route")
        if route is not None and route.open and is_index_vector(key):
            return route.gather_index(key)
        return torch.Tensor.__getitem__(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        route = self.__dict__.get("_kda_route")
        if route is not None and route.open and is_index_vector(key):
            if type(value) is PendingCast and route.scatter_pending(key, value):
                return
            if isinstance(value, torch.Tensor) and value.dtype is self.dtype:
                route.scatter(key, value)
                return
        # a source of another dtype makes torch's own index_put raise (Kimi Linear scatters its final state
        # uncast): the routed scatter would cast and succeed, so the call would behave differently patched
        torch.Tensor.__setitem__(self, key, value)


class PackedStates(torch.Tensor):
    """A folded gather's result (or its transpose / contiguous copy): the fork's clear on it is recognisable."""

    __torch_function__ = _disabled

    def __setitem__(self, key: Any, value: Any) -> None:
        route = self.__dict__.get("_kda_route")
        if route is not None and route.elide_native_clear(key, value):
            return
        torch.Tensor.__setitem__(self, key, value)

    def transpose(self, dim0: int, dim1: int) -> torch.Tensor:  # the vllm-ascend GDN [.., K, V] variant
        """Keep the tag only for a swap of the last two axes: rows stay rows, so the folded zero rows are the
        clear's rows there too; any other swap moves the row axis and its result is a plain tensor."""
        result = torch.Tensor.transpose(self, dim0, dim1)
        ndim = self.dim()
        if ndim >= 2 and {dim0 % ndim, dim1 % ndim} == {ndim - 1, ndim - 2}:
            return _keep_tag(result, self)
        return torch.Tensor.as_subclass(result, torch.Tensor)

    def contiguous(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _keep_tag(torch.Tensor.contiguous(self, *args, **kwargs), self)


class RoutedFlags(torch.Tensor):
    """Zero-copy alias of the call's ``has_initial_state`` whose ``~`` result is tagged with the route."""

    __torch_function__ = _disabled

    def __invert__(self) -> torch.Tensor:
        inverted = torch.Tensor.__invert__(self)
        route = self.__dict__.get("_kda_route")
        if route is None or not route.open:
            return inverted
        inverted.__class__ = InvertedFlags  # our own fresh result: retyped in place (as_subclass costs a new alias)
        inverted._kda_route = route
        return inverted


class InvertedFlags(torch.Tensor):
    """``~flags`` of a routed call (a plain mask otherwise)."""

    __torch_function__ = _disabled


class FinalStates(torch.Tensor):
    """The final state a routed call's declared chunk callable returned: ``.to(cache dtype)`` is deferred."""

    __torch_function__ = _disabled

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        route = self.__dict__.get("_kda_route")
        if route is not None and len(args) == 1 and not kwargs and route.can_fold_cast(self, args[0]):
            return make_pending_cast(self, route)
        return torch.Tensor.to(self, *args, **kwargs)


# metadata reads that do not need a pending cast's values (a routed scatter reads its dtype)
_METADATA_ONLY = frozenset((torch.Tensor.dtype.__get__, torch.Tensor.shape.__get__, torch.Tensor.device.__get__,
                            torch.Tensor.ndim.__get__, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel,
                            torch.Tensor.is_cuda.__get__, torch.Tensor.layout.__get__))


class PendingCast(torch.Tensor):
    """``final.to(cache dtype)`` of a routed call, allocated but not computed yet.

    The call's routed scatter consumes it without computing it (the plan casts in its copy). Any other
    use -- any torch function but a metadata read -- first computes it exactly as ``.to()`` would have
    (``copy_`` from the final state: the same cast kernel), then runs as on a plain tensor.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA_ONLY:
            for leaf in _pytree.tree_leaves((args, kwargs)):
                if type(leaf) is PendingCast:
                    materialize_pending(leaf)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def make_pending_cast(final: torch.Tensor, route: CallRoute) -> PendingCast:
    """Return an uncomputed ``final.to(route.state.dtype)``: same shape and strides, the cache dtype, no kernel."""
    with torch._C.DisableTorchFunctionSubclass():
        pending = torch.empty_like(final, dtype=route.state.dtype)
    pending.__class__ = PendingCast  # a tensor made here: retyped in place
    pending._kda_route = route
    pending._kda_source = final
    return pending


def materialize_pending(pending: PendingCast) -> None:
    """Compute a pending cast in place (torch's own cast, as ``.to()``) and count it ``casts_materialized``."""
    source = pending.__dict__.pop("_kda_source", None)
    if source is None:
        return
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.copy_(pending, source)
    route = pending.__dict__.pop("_kda_route", None)
    if route is not None:
        get_ledger().count(route.seam.section, "casts_materialized")


def tag_final(result: Any, index: int, route: CallRoute) -> Any:
    """Return the chunk callable's ``result`` with element ``index`` as a :class:`FinalStates` of ``route``.

    Only the call's first final state is tagged; a result that is not a tuple/list holding a tensor there
    is returned as it is (the cast then runs unfolded, as the fork wrote it).
    """
    if not (route.open and route.finals == 0 and isinstance(result, (tuple, list)) and len(result) > index
            and type(result[index]) is torch.Tensor):
        return result
    final = result[index].as_subclass(FinalStates)
    final._kda_route = route
    route.finals += 1
    tagged = list(result)
    tagged[index] = final
    return tuple(tagged) if isinstance(result, tuple) else tagged


def _keep_tag(result: torch.Tensor, source: PackedStates) -> torch.Tensor:
    route = source.__dict__.get("_kda_route")
    if route is None or not route.open or result is source:
        return result
    return tag_packed(result, route)


def tag_packed(packed: torch.Tensor, route: CallRoute) -> PackedStates:
    """Return ``packed`` as a :class:`PackedStates` of ``route`` (same storage, no copy).

    ``packed`` is a tensor made for this call -- the plan's gather output, or a ``.transpose`` / ``.contiguous``
    result of one -- that nothing else references yet, so a plain tensor is retyped in place (``as_subclass``
    would build a second tensor object: a few µs per call on a GPU host); any other type gets a new alias.
    """
    if type(packed) is torch.Tensor:
        tagged = packed
        tagged.__class__ = PackedStates
    else:
        tagged = packed.as_subclass(PackedStates)
    tagged._kda_route = route
    return tagged


def is_index_vector(key: Any) -> bool:
    """Return whether ``key`` is a 1-D int32/int64 tensor (the gather/scatter index form)."""
    return (isinstance(key, torch.Tensor) and (key.dtype is torch.int32 or key.dtype is torch.int64)
            and key.dim() == 1)


def foldable_flags(flags: Any, indices: Any, state: torch.Tensor) -> bool:
    """Return whether ``flags`` can be handed to the plan's gather in place of the fork's clear.

    Args:
        flags: the call's ``has_initial_state``.
        indices: the call's ``state_indices``.
        state: the cache.
    Returns:
        True for a 1-D ``torch.bool`` tensor with one flag per index, on the cache's device.
    """
    return (isinstance(flags, torch.Tensor) and isinstance(indices, torch.Tensor) and flags.dtype is torch.bool
            and flags.dim() == 1 and flags.shape == indices.shape and flags.device == state.device)


def make_alias(route: CallRoute) -> RoutedCache:
    """Create this call's routed alias of ``route.state`` (a new tensor object over the same storage).

    Not cached across calls: a cached alias would keep the cache's storage alive after vLLM detaches the
    layer's caches (sleep mode, re-initialization).
    """
    proxy = route.state.as_subclass(RoutedCache)
    proxy._kda_route = route
    route.proxy = proxy
    return proxy


def make_flags_alias(route: CallRoute) -> RoutedFlags:
    """Create this call's :class:`RoutedFlags` alias of ``route.flags`` (same storage)."""
    alias = route.flags.as_subclass(RoutedFlags)
    alias._kda_route = route
    return alias
