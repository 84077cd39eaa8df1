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

Every other use of these tensors is plain tensor behaviour (``__torch_function__`` is disabled on all
four subclasses, so nothing else pays a Python dispatch). Each call must end with exactly one gather,
one scatter and as many elided clears as folded gathers, or it is not counted as routed
(:mod:`kda_patches.routing.proof`).
"""

from __future__ import annotations

from typing import Any

import torch

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
        open: False once the call returned (a leaked alias then behaves like the plain cache).
    """

    __slots__ = ("elided", "flags", "folded", "gathers", "indices", "layer_name", "open", "plan", "proxy",
                 "scatters", "seam", "state")

    def __init__(self, seam: Any, layer_name: str, plan: Any, state: torch.Tensor, indices: Any = None,
                 flags: Any = None) -> None:
        self.seam = seam
        self.layer_name = layer_name
        self.plan = plan
        self.state = state
        self.indices = indices
        self.flags = flags if foldable_flags(flags, indices, state) else None
        self.proxy: RoutedCache | None = None
        self.gathers = self.scatters = self.folded = self.elided = 0
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
        if route is not None and route.open and is_index_vector(key) and isinstance(value, torch.Tensor) \
                and value.dtype is self.dtype:
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
        return _keep_tag(torch.Tensor.transpose(self, dim0, dim1), self)

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
        inverted = inverted.as_subclass(InvertedFlags)
        inverted._kda_route = route
        return inverted


class InvertedFlags(torch.Tensor):
    """``~flags`` of a routed call (a plain mask otherwise)."""

    __torch_function__ = _disabled


def _keep_tag(result: torch.Tensor, source: PackedStates) -> torch.Tensor:
    route = source.__dict__.get("_kda_route")
    if route is None or not route.open or result is source:
        return result
    return tag_packed(result, route)


def tag_packed(packed: torch.Tensor, route: CallRoute) -> PackedStates:
    """Return ``packed`` as a :class:`PackedStates` of ``route`` (same storage, no copy)."""
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
