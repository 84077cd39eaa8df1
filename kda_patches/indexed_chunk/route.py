"""Route a seam's prefill through the indexed twin: the gather binds the cache rows, the chunk call stores in place.

With ``KDA_PATCHES_STATE_IO=indexed`` the release's chunk-state host function (``Seam.indexed``, e.g. vLLM's vendored
FLA ``chunk_gated_delta_rule_fwd_h``) is wrapped (:class:`~kda_patches.routing.wrappers.IndexedHostWrapper`); when it
is applied, its module's kernel is derived into the indexed twin (:func:`prepare_host`; a refusal is recorded and
the seam keeps copying). A routed call of such a seam then runs with an :class:`IndexedRoute`:

- the seam's gather (``X = S[I]`` with its folded clear, or ``gather_initial_states(S, I, F)``) binds ``S``'s rows
  ``I`` and flags ``F`` and gives ``None`` as the initial state -- nothing is copied;
- the chunk call reaches the wrapped host function with ``initial_state=None`` inside that call
  (:func:`route_host`): the twin reads ``S[I[n]]`` where ``F[n]`` (zeros otherwise) and stores the final states into
  ``S[I[n]]`` in the cache dtype, and the host returns ``None`` as the final state;
- the seam's scatter of that ``None`` to the same rows is then already done.

Anything the route cannot bind exactly (another tensor under the cache's name, flags the plan could not fold, a gather
into another dtype) copies through the plan as the copy route does. A bound call whose chunk call did not consume the
binding, or whose scatter names other rows, raises :class:`IndexedStateLost` at the scatter: its initial states were
never read, so its outputs are wrong, and it must not pass silently.
"""

from __future__ import annotations

from typing import Any

import torch

from kda_patches.indexed_chunk.derive import DerivationRefused, DerivedKernel, KernelDeclaration, derive_indexed_kernel
from kda_patches.indexed_chunk.launch import bind_host_call, indexed_fwd_h
from kda_patches.ledger import get_ledger
from kda_patches.routing.calls import active_call
from kda_patches.routing.direct import DirectRoute, _is_vector, foldable

SECTION = "indexed_chunk"
READY: dict[str, DerivedKernel] = {}  # IndexedChunk.key -> its derived twin, for every host wrapped in this process


class IndexedStateLost(RuntimeError):
    """A bound prefill's chunk call did not run the indexed twin (or its scatter names other rows)."""


def prepare_host(key: str, host: Any, kernel: str) -> str:
    """Derive the indexed twin of ``host``'s module kernel; record it under ``key`` (or why it was refused).

    Args:
        key: the wrapped target's ``module:qualname``.
        host: the release's host function just wrapped (its globals hold the kernel).
        kernel: the kernel's name in that module.
    Returns:
        ``"indexed"`` when the twin was built, else ``"copy"`` (the refusal's reason is the ledger fact).
    """
    module = __import__(host.__module__, fromlist=["_"])
    declaration = KernelDeclaration(module=host.__module__, kernel=kernel, host=host.__name__)
    try:
        derived = derive_indexed_kernel(module, declaration, host=host)
    except DerivationRefused as refusal:
        READY.pop(key, None)
        get_ledger().set_fact(SECTION, key, {"decision": "copy", "reason": str(refusal)})
        return "copy"
    READY[key] = derived
    get_ledger().set_fact(SECTION, key, {"decision": "indexed", "kernel": f"{declaration.module}.{kernel}",
                                         "source_sha256": derived.source_sha256,
                                         "compiled": "at the first prefill that reaches it (not sealed at start-up)"})
    return "indexed"


def forget_host(key: str) -> None:
    """Drop the twin of a host whose wrapper was removed."""
    READY.pop(key, None)


class IndexedRoute(DirectRoute):
    """A :class:`~kda_patches.routing.direct.DirectRoute` whose gather binds rows instead of copying them.

    Attributes (beyond the copy route's):
        derived: the indexed twin the chunk call launches.
        rows, flags: the bound rows and flags (None until the gather binds).
        consumed: whether the chunk call ran the twin on the binding.
    """

    __slots__ = ("consumed", "derived", "flags", "rows")

    def __init__(self, plan: Any, state: torch.Tensor, derived: DerivedKernel) -> None:
        super().__init__(plan, state)
        self.derived = derived
        self.rows = self.flags = None
        self.consumed = False

    def _bind(self, state: torch.Tensor, indices: Any, flags: Any) -> bool:
        if state is not self.state or self.rows is not None or not _is_vector(indices):
            return False
        if flags is not None and not foldable(flags, indices, state):
            return False
        self.rows, self.flags = indices, flags
        self.gathers += 1
        self.vector = indices
        return True

    def gather(self, state: torch.Tensor, indices: Any, flags: Any, clear: Any = None) -> Any:
        """Bind ``state``'s rows ``indices`` (flags folded) and give None; else copy as the copy route does."""
        if self._bind(state, indices, flags):
            return None
        return super().gather(state, indices, flags, clear)

    def gather_function(self, function: Any, state: torch.Tensor, indices: Any, flags: Any, **keywords: Any) -> Any:
        """Bind ``function(state, indices, flags)``'s rows and give None (only into the cache's own dtype)."""
        wanted = keywords.get("output_dtype")
        if (wanted is None or wanted is state.dtype) and self._bind(state, indices, flags):
            return None
        return super().gather_function(function, state, indices, flags, **keywords)

    def scatter_through_plan(self, state: torch.Tensor, indices: Any, value: Any, casts: bool) -> bool:
        """A bound call's scatter of None: the twin already stored it; anything else as the copy route does.

        Raises:
            IndexedStateLost: a scatter of None whose binding the chunk call did not consume, or of other rows.
        """
        if value is not None or self.rows is None:
            return super().scatter_through_plan(state, indices, value, casts)
        if not self.consumed:
            raise IndexedStateLost(
                "the prefill's chunk call did not run the indexed twin on the bound rows, so its initial states "
                f"were never read ({self.derived.declaration.module}.{self.derived.declaration.host} was not reached "
                "with initial_state=None); set KDA_PATCHES_STATE_IO=copy")
        if state is not self.state or indices is not self.rows:
            raise IndexedStateLost("the seam scatters its final states to other rows than it gathered: the indexed "
                                   "twin stored them at the gathered rows; set KDA_PATCHES_STATE_IO=copy")
        self.scatters += 1
        return True

    def problem(self) -> str | None:
        """Return why this call does not count as routed, or None when it does."""
        if self.rows is not None and not self.consumed:
            return "the gather bound the cache rows but the chunk call never ran the indexed twin"
        return super().problem()


def route_host(wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """One call of the wrapped host function: the indexed twin inside a bound routed call, else the release's own.

    The twin runs when the active route is an :class:`IndexedRoute` with unconsumed rows and the call passes no
    initial state of its own (the seam's gather gave None); the call's ``(h, v_new, final_state)`` comes back with
    ``final_state`` None (it is in the cache).
    """
    route = getattr(active_call, "route", None)
    if type(route) is not IndexedRoute or route.rows is None or route.consumed:
        return wrapped(*args, **kwargs)
    if bind_host_call(route.derived.host, args, kwargs)["initial_state"] is not None:
        return wrapped(*args, **kwargs)
    result = indexed_fwd_h(route.derived, route.state, route.rows, route.flags, *args, **kwargs)
    route.consumed = True
    return result
