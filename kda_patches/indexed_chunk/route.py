"""Route a seam's prefill through the indexed twin: the gather binds the cache rows, the chunk call stores in place.

With ``KDA_PATCHES_STATE_IO=indexed`` the release's chunk-state host function (``Seam.indexed``, e.g. vLLM's vendored
FLA ``chunk_gated_delta_rule_fwd_h``) is wrapped (:class:`~kda_patches.routing.wrappers.IndexedHostWrapper`); when it
is applied, its module's kernel is derived into the indexed twin (:func:`prepare_host`; a refusal is recorded and
the seam keeps copying). A routed call of such a seam then runs with an :class:`IndexedRoute`:

- the seam's gather (``X = S[I]`` with its folded clear, or ``gather_initial_states(S, I, F)``) binds ``S``'s rows
  ``I`` and flags ``F`` and gives an uninitialized placeholder as the initial state -- nothing is copied;
- the chunk call reaches the wrapped host function with that placeholder (:func:`route_host`): the twin reads
  ``S[I[n]]`` where ``F[n]`` (zeros otherwise) and stores the final states into ``S[I[n]]`` in the cache dtype, and
  the host returns another placeholder as the final state;
- the seam's scatter of that placeholder to the same rows is then already done.

A seam whose layer may prefill on another backend (Kimi K3's FlashKDA, a pre-0.34 Qwen layer on FlashInfer) declares
the layers the twin serves (``IndexedChunk.backend``: a :class:`~kda_patches.routing.seams.BackendGate`, or
:class:`~kda_patches.routing.eras.UncastFinalGate` for a seam whose scatter stores the FP32 final states uncast); any
other layer only copies, visibly: each such prefill call counts ``calls_copied`` in the ``indexed_chunk`` section and
the layer's fact ``copies <layer>`` there says why (its seam's ``calls_routed`` counts it, its ``calls_indexed`` not).

Anything the route cannot bind exactly (another tensor under the cache's name, flags the plan could not fold, a gather
into another dtype) copies through the plan as the copy route does. A bound call whose chunk call did not consume the
binding, or whose scatter names other rows, raises :class:`IndexedStateLost` at the scatter: its initial states were
never read, so its outputs are wrong, and it must not pass silently.
"""

from __future__ import annotations

from typing import Any

import torch

from kda_patches.indexed_chunk import AUTO_MIN_SEQUENCES, READY, ReadyHost
from kda_patches.indexed_chunk.derive import DerivationRefused, DerivedKernel, KernelDeclaration, derive_indexed_kernel
from kda_patches.indexed_chunk.launch import bind_host_call, run_bound
from kda_patches.ledger import get_ledger
from kda_patches.routing.calls import active_call
from kda_patches.routing.direct import DirectRoute, _is_vector, foldable
from kda_patches.routing.proof import layer_name_of

SECTION = "indexed_chunk"


class IndexedStateLost(RuntimeError):
    """A bound prefill's chunk call did not run the indexed twin (or its scatter names other rows)."""


def prepare_host(key: str, host: Any, kernel: str, state_io: str = "indexed") -> str:
    """Derive the indexed twin of ``host``'s module kernel; record it under ``key`` (or why it was refused).

    Args:
        key: the wrapped target's ``module:qualname``.
        host: the release's host function just wrapped (its globals hold the kernel).
        kernel: the kernel's name in that module.
        state_io: ``KDA_PATCHES_STATE_IO``: ``indexed`` (every bound call runs the twin), ``auto`` (only calls of
            at least :data:`~kda_patches.indexed_chunk.AUTO_MIN_SEQUENCES` sequences; fewer copy through the plan)
            or ``measured`` (as ``auto``, in the seams whose ``IndexedChunk.measured`` is set; others copy).
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
    ready = READY[key] = ReadyHost(derived, AUTO_MIN_SEQUENCES if state_io in ("auto", "measured") else 0,
                                   state_io == "measured")
    calls = (f"prefill calls of at least {ready.min_sequences} sequences; fewer copy through the plan"
             if ready.min_sequences else "every routed prefill call")
    if ready.measured_only:
        calls += ("; only in the seams measured at least as fast with it (docs/results/no-copy), the others copy "
                  "through the plan")
    get_ledger().set_fact(SECTION, key, {
        "decision": "indexed", "kernel": f"{declaration.module}.{kernel}", "source_sha256": derived.source_sha256,
        "state_io": state_io, "indexed_calls": calls,
        "compiled": ("at the first routed prefill that reaches the host: bound, or, when it copies, warmed with "
                     "every row invalid (vLLM's start-up runs such prefills)")})
    return "indexed"


def forget_host(key: str) -> None:
    """Drop the twin of a host whose wrapper was removed."""
    READY.pop(key, None)


class IndexedRoute(DirectRoute):
    """A :class:`~kda_patches.routing.direct.DirectRoute` whose gather binds rows instead of copying them.

    The gather gives a *placeholder*: an uninitialized ``[S, H, V, K]`` tensor of the cache's dtype, which the chunk
    chain passes on unread (``.contiguous()`` of it is itself) until the wrapped host function recognises it and runs
    the twin, which gives another placeholder as the final state (``.to(cache dtype)`` of it is itself); the seam's
    scatter of that final placeholder to the bound rows is then already done.

    Attributes (beyond the copy route's):
        derived: the indexed twin the chunk call launches.
        layer: the layer of the call, or a ``_CopyOnly`` holding it where the seam's ``IndexedChunk.backend`` stands
            aside on it (its backend, or its cache dtype under an uncast scatter): the route then only copies.
        min_sequences: a call binds only when it gathers at least this many rows (``KDA_PATCHES_STATE_IO=auto``);
            a smaller one copies through the plan.
        rows, flags: the bound rows and flags (None until the gather binds).
        initial, final: the placeholders of the bound call (None until the gather binds / the twin runs).
        consumed: whether the chunk call ran the twin on the binding.
        seen: the dtype of the indices and whether flags came with them, from the gather of the cache (bound or
            not), so a call copied below ``min_sequences`` can warm the twin with the indices a bound call passes
            (:func:`warm_twin`); None before that gather.
    """

    __slots__ = ("consumed", "derived", "final", "flags", "initial", "layer", "min_sequences", "rows", "seen")

    def __init__(self, plan: Any, state: torch.Tensor, derived: DerivedKernel, layer: Any = None,
                 gate: Any = None, min_sequences: int = 0) -> None:
        super().__init__(plan, state)
        self.derived = derived
        self.min_sequences = min_sequences
        why = None if gate is None else gate.stands_aside_on(layer)
        self.layer = layer if why is None else _CopyOnly(layer, why)
        self.rows = self.flags = self.initial = self.final = self.seen = None
        self.consumed = False

    def _bind(self, state: torch.Tensor, indices: Any, flags: Any) -> bool:
        if type(self.layer) is _CopyOnly and state is self.state:
            self.layer.note()  # a layer the twin does not serve: the plan copies, counted and explained
            return False
        if state is not self.state or self.rows is not None or not _is_vector(indices):
            return False
        self.seen = (indices.dtype, flags is not None)
        if indices.shape[0] < self.min_sequences:
            return False
        if flags is not None and not foldable(flags, indices, state):
            return False
        self.rows, self.flags = indices, flags
        self.initial = torch.empty((indices.shape[0], *state.shape[1:]), dtype=state.dtype, device=state.device)
        self.gathers += 1
        self.vector = indices
        return True

    def gather(self, state: torch.Tensor, indices: Any, flags: Any, clear: Any = None) -> Any:
        """Bind ``state``'s rows ``indices`` (flags folded), giving the placeholder; else copy as the copy route."""
        if self._bind(state, indices, flags):
            return self.initial
        return super().gather(state, indices, flags, clear)

    def gather_function(self, function: Any, state: torch.Tensor, indices: Any, flags: Any, **keywords: Any) -> Any:
        """Bind ``function(state, indices, flags)``'s rows, giving the placeholder (only into the cache's dtype)."""
        wanted = keywords.get("output_dtype")
        if (wanted is None or wanted is state.dtype) and self._bind(state, indices, flags):
            return self.initial
        return super().gather_function(function, state, indices, flags, **keywords)

    def scatter_through_plan(self, state: torch.Tensor, indices: Any, value: Any, casts: bool) -> bool:
        """A bound call's scatter: the twin already stored its final states; an unbound one as the copy route does.

        Raises:
            IndexedStateLost: in a bound call, the chunk call never ran the twin (whatever is scattered was computed
                from the unread placeholder), or the seam scatters something else or to other rows.
        """
        if self.rows is None:
            return super().scatter_through_plan(state, indices, value, casts)
        if not self.consumed:
            raise IndexedStateLost(
                "the prefill's chunk call did not run the indexed twin on the bound rows, so its initial states "
                f"were never read ({self.derived.declaration.module}.{self.derived.declaration.host} was not reached "
                "with the bound placeholder); set KDA_PATCHES_STATE_IO=copy")
        if value is not self.final or state is not self.state or indices is not self.rows:
            raise IndexedStateLost("the seam scatters other final states or to other rows than it gathered: the "
                                   "indexed twin stored its own at the gathered rows; set KDA_PATCHES_STATE_IO=copy")
        self.scatters += 1
        return True

    def problem(self) -> str | None:
        """Return why this call does not count as routed, or None when it does."""
        if self.rows is not None and not self.consumed:
            return "the gather bound the cache rows but the chunk call never ran the indexed twin"
        return super().problem()


class _CopyOnly:
    """``IndexedRoute.layer`` of a layer the twin does not serve (its seam's ``IndexedChunk.backend`` stands aside on
    it): the route only copies, and each of its gathers of the cache is counted with the reason."""

    __slots__ = ("layer", "reason")

    def __init__(self, layer: Any, reason: str) -> None:
        self.layer, self.reason = layer, reason

    def note(self) -> None:
        """Count one copied prefill call (``indexed_chunk`` / ``calls_copied``) and record why for its layer."""
        ledger = get_ledger()
        ledger.count(SECTION, "calls_copied")
        ledger.set_fact(SECTION, f"copies {layer_name_of(self.layer)}",
                        {"decision": "copy", "reason": self.reason})


def route_host(wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """One call of the wrapped host function: the indexed twin inside a bound routed call, else the release's own.

    The twin runs when the active route is an :class:`IndexedRoute` with unconsumed rows and the call's initial
    state is the route's placeholder (the seam's gather gave it); the call's ``(h, v_new, final_state)`` comes back
    with ``final_state`` a placeholder of the cache's dtype (the final states are in the cache already), or None
    where the call asked for none.
    """
    route = getattr(active_call, "route", None)
    if type(route) is not IndexedRoute or route.rows is None or route.consumed:
        if type(route) is IndexedRoute and route.rows is None and route.seen is not None:
            warm_twin(route, args, kwargs)
        return wrapped(*args, **kwargs)
    call = bind_host_call(route.derived.host, args, kwargs)
    if call["initial_state"] is not route.initial:
        return wrapped(*args, **kwargs)
    call.arguments["initial_state"] = None  # the binding is this call's own dict
    states, new_values, _ = run_bound(route.derived, route.state, route.rows, route.flags, call)
    route.consumed = True
    if call["output_final_state"]:
        route.final = torch.empty_like(route.initial)
    return states, new_values, route.final


# the launch signatures the twin was warmed for in this process, and the (twin, cache) pairs already looked at: a
# copied call of a layer seen before costs one set lookup (:func:`warm_twin`)
WARMED: set[tuple[Any, ...]] = set()
LOOKED_AT: set[tuple[int, int, int]] = set()


def capturing(tensor: torch.Tensor) -> bool:
    """Return whether ``tensor``'s device stream is recording a CUDA graph."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def compiles(tensor: torch.Tensor) -> bool:
    """Return whether a Triton launch on ``tensor``'s device compiles (a GPU or NPU; on the CPU only the interpreter
    runs Triton, which compiles nothing, so there is nothing to warm)."""
    return tensor.device.type != "cpu"


def warm_twin(route: IndexedRoute, args: tuple, kwargs: dict) -> bool:
    """Compile the twin for a routed call that copies (fewer sequences than ``auto``'s crossover), once per launch
    signature (looked at once per twin and cache), by launching it on this call's tensors with every row invalid:
    it reads zeros, stores nothing, and its outputs are dropped. vLLM's start-up runs routed prefills of few
    sequences (warm-up, graph capture), so the first wide prefill while serving finds the twin compiled (the JIT
    watch of the engine check judges it). Not inside a CUDA-graph capture (the launch would be replayed with the
    graph), and not where nothing compiles (:func:`compiles`: the CPU).

    Returns:
        Whether the twin was launched (counted ``twin_warmups`` in the ``indexed_chunk`` section).
    """
    cache = route.state
    pair = (id(route.derived), cache.data_ptr(), cache.shape[0])
    if pair in LOOKED_AT or capturing(cache):  # a capture: looked at again after it
        return False
    LOOKED_AT.add(pair)
    if not compiles(cache):
        return False
    call = bind_host_call(route.derived.host, args, kwargs)
    k, u, g = call["k"], call["u"], call["g"]
    index_dtype, flagged = route.seen
    signature = (id(route.derived), cache.dtype, cache.device, k.dtype, tuple(k.shape[2:]), tuple(u.shape[2:]),
                 None if g is None else g.dtype, call["gk"] is None, call["chunk_size"], bool(call["use_exp2"]),
                 call["save_new_value"], call["cu_seqlens"] is None, index_dtype, flagged)
    if signature in WARMED:
        return False
    WARMED.add(signature)
    warm = type(call)(dict(call.arguments))
    warm.arguments["initial_state"] = None
    bounds = call["cu_seqlens"]
    sequences = k.shape[0] if bounds is None else bounds.shape[0] - 1
    rows = torch.full((sequences,), -1, dtype=index_dtype, device=cache.device)
    flags = torch.zeros(sequences, dtype=torch.bool, device=cache.device) if flagged else None
    run_bound(route.derived, cache, rows, flags, warm)
    get_ledger().count(SECTION, "twin_warmups")
    return True
