"""The wrapt wrappers patch records install: the entry from a wrapped fork function into the routing core.

Each wrapper holds only its declaration (a :class:`~kda_patches.routing.seams.Seam` or a ledger section)
and hands the call to the mechanism -- :mod:`~kda_patches.routing.calls` (a seam call, a module-level
clear / gather / chunk callable), :mod:`~kda_patches.routing.startup` (a runner's ``initialize_kv_cache``)
or :mod:`~kda_patches.routing.fork_native` (a fork's own plan initialization) -- imported on first use
(they import torch). Nothing in the mechanism imports this module, so the routing core has no import
circle: ``wrappers`` -> mechanism -> ``seams`` (data). The startup hook recognises a seam layer by the
:class:`~kda_patches.routing.seams.Seam` its wrapper carries (``wrapper.seam``), not by this module's classes.
"""

from __future__ import annotations

import types

from kda_patches.routing.seams import IndexedChunk, Seam

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any


_calls: Any = None
_route_direct: Any = None


def _load_calls() -> Any:
    global _calls
    from kda_patches.routing import calls  # deferred: imports torch

    _calls = calls
    return calls


def _load_direct() -> Any:
    global _route_direct
    from kda_patches.routing.direct import route_direct  # deferred: imports torch

    _route_direct = route_direct
    return route_direct


class SeamWrapper:
    """wrapt wrapper of a seam function: routes its state copy as its :class:`Seam` declares.

    When the registry wraps a function it calls :meth:`on_apply`, which compiles the function's rewritten
    twin (:mod:`kda_patches.routing.rewrite`); calls of a function with a twin run the twin with a direct
    route (:mod:`kda_patches.routing.direct`), any other call routes through the alias
    (:mod:`kda_patches.routing.calls`). A function an eager-break decorator returned (vLLM's
    ``eager_break_during_capture``, :func:`~kda_patches.routing.rewrite.find_eager_break`) is called through
    that decorator re-applied to this wrapper's routed entry: outside a capture the decorator calls the entry,
    and a breakable CUDA-graph capture records the entry -- so its replays are routed and counted too. The worker
    startup hook recognises a seam layer by this wrapper type on its class's method.
    """

    __slots__ = ("breaks", "rewrites", "seam", "unfolded")

    def __init__(self, seam: Seam) -> None:
        self.seam = seam
        self.rewrites: dict[Any, Any] = {}  # original (undecorated) function -> its rewritten twin
        self.unfolded: set[Any] = set()  # originals whose source shows no foldable clear: the alias must not fold
        self.breaks: dict[Any, Any] = {}  # eager-break wrapper -> its decorator applied to the routed entry

    def __repr__(self) -> str:
        return f"SeamWrapper({self.seam.name!r})"

    def on_apply(self, key: str, original: Any) -> str:
        """Prepare the twin of ``original`` (just wrapped as ``key``); return the mechanism its calls use."""
        from kda_patches.routing.rewrite import find_eager_break, prepare_rewrite  # deferred: ast/inspect

        found = find_eager_break(original)
        if found is None:
            return prepare_rewrite(self.rewrites, self.unfolded, self.seam, key, original)
        mechanism = prepare_rewrite(self.rewrites, self.unfolded, self.seam, key, found.inner, found.name)
        self.breaks[original] = found.decorator(self.routed_entry(found.inner))
        return mechanism

    def on_revert(self, key: str, original: Any) -> None:
        """Forget the twin of ``original`` (its wrapper was removed)."""
        for function in (original, getattr(original, "__wrapped__", None) if original in self.breaks else None):
            self.rewrites.pop(function, None)
            self.unfolded.discard(function)
        self.breaks.pop(original, None)

    def routed_entry(self, function: Any) -> Any:
        """Return ``entry(layer, *args, **kwargs)``: one routed call of the plain ``function`` on ``layer``."""
        route = self.route
        method = types.MethodType

        def entry(layer: Any, *args: Any, **kwargs: Any) -> Any:
            return route(function, method(function, layer), layer, args, kwargs)

        entry.__name__, entry.__qualname__ = function.__name__, f"{function.__qualname__} (kda_patches routed)"
        return entry

    def route(self, function: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        """Route one call of the plain ``function`` (bound as ``wrapped``): its twin if it has one, else the alias."""
        twin = self.rewrites.get(function) if self.rewrites else None
        if twin is not None:
            return (_route_direct or _load_direct())(self.seam, twin, wrapped, instance, args, kwargs)
        fold = not self.unfolded or function not in self.unfolded
        return (_calls or _load_calls()).route_call(self.seam, wrapped, instance, args, kwargs, fold)

    def __call__(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        # a bound method, or (a call through the class) wrapt's partial proxy binding the instance
        function = getattr(wrapped, "__func__", None) or getattr(wrapped, "__wrapped__", None)
        if self.breaks:
            entry = self.breaks.get(function)
            if entry is not None:
                return entry(instance, *args, **kwargs)
        return self.route(function, wrapped, instance, args, kwargs)


class ClearWrapper:
    """wrapt wrapper of a module-level ``clear_ssm_states``: elided when it repeats a folded clear."""

    __slots__ = ()

    def __call__(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        return (_calls or _load_calls()).route_clear(wrapped, args, kwargs)


class GatherWrapper:
    """wrapt wrapper of a module-level ``gather_initial_states(state, indices, flags)``."""

    __slots__ = ()

    def __call__(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        return (_calls or _load_calls()).route_gather(wrapped, args, kwargs)


class FinalWrapper:
    """wrapt wrapper of a seam's module-level chunk callable (``FinalFrom(function=...)``): inside a routed
    call whose seam declares it, its final-state result is tagged so ``.to(cache dtype)`` folds into the scatter."""

    __slots__ = ()

    def __call__(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        return (_calls or _load_calls()).route_final(wrapped, args, kwargs)


class IndexedHostWrapper:
    """wrapt wrapper of a release's chunk-state host function (``Seam.indexed``, ``KDA_PATCHES_STATE_IO=indexed``).

    When the registry wraps it, :meth:`on_apply` derives the indexed twin of its module's kernel
    (:func:`kda_patches.indexed_chunk.route.prepare_host`); inside a routed call whose gather bound the cache rows
    the call runs the twin, every other call runs the release's function
    (:func:`~kda_patches.indexed_chunk.route.route_host`).
    """

    __slots__ = ("indexed",)

    def __init__(self, indexed: IndexedChunk) -> None:
        self.indexed = indexed

    def __repr__(self) -> str:
        return f"IndexedHostWrapper({self.indexed.key!r})"

    def on_apply(self, key: str, original: Any) -> str:
        """Derive the twin of ``original``'s module kernel; return ``indexed`` or ``copy`` (refused)."""
        from kda_patches import current_flags
        from kda_patches.indexed_chunk.route import prepare_host  # deferred: imports torch and triton

        return prepare_host(self.indexed.key, original, self.indexed.kernel, current_flags().state_io)

    def on_revert(self, key: str, original: Any) -> None:
        """Forget the twin (its wrapper was removed)."""
        from kda_patches.indexed_chunk.route import forget_host

        forget_host(self.indexed.key)

    def __call__(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        from kda_patches.indexed_chunk.route import route_host  # deferred; a sys.modules hit after the first call

        return route_host(wrapped, args, kwargs)


class StartupWrapper:
    """wrapt wrapper of a model runner's ``initialize_kv_cache``: prepare and publish every seam layer's plan.

    One instance per patch (``section``); stacked instances share one outermost-call guard, so one startup
    serves the seam layers of every patch.
    """

    __slots__ = ("section",)

    def __init__(self, section: str) -> None:
        self.section = section

    def __repr__(self) -> str:
        return f"StartupWrapper({self.section!r})"

    def __call__(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        from kda_patches.routing import startup  # deferred: imports torch

        return startup.route_initialize_kv_cache(wrapped, instance, args, kwargs, self.section)


class RebindWrapper:
    """wrapt wrapper of vLLM >= 0.34's ``extend_kv_cache(runner, kv_cache_config, num_blocks)``: after the
    extensible KV cache rebinds every layer's views, re-validate and republish the seam layers' plans.

    One instance per patch (``section``); stacked instances share one outermost-call guard.
    """

    __slots__ = ("section",)

    def __init__(self, section: str) -> None:
        self.section = section

    def __repr__(self) -> str:
        return f"RebindWrapper({self.section!r})"

    def __call__(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        from kda_patches.routing import rebind  # deferred: imports torch

        return rebind.route_extend_kv_cache(wrapped, args, kwargs, self.section)


class ForkPlanWrapper:
    """wrapt wrapper of a fork's own plan initialization (vllm-ascend ``initialize_kda_state_copy``).

    Observes the fork's plans (``KDA_PATCHES_KIMI_PLAN=fork``) or publishes the overlay's into the fork's
    seam after the fork's own initialization (``overlay``); see :mod:`kda_patches.routing.fork_native`.
    """

    __slots__ = ("section",)

    def __init__(self, section: str) -> None:
        self.section = section

    def __call__(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        from kda_patches.routing import fork_native  # deferred: imports torch

        return fork_native.route_fork_initialize(wrapped, args, kwargs, self.section)


wrap_clear = ClearWrapper()
wrap_gather = GatherWrapper()
wrap_final = FinalWrapper()
