"""State-copy seam declarations: where a layer's prefill keeps its state, indices and flags (data only).

Every state-copy seam -- vllm-ascend's Kimi ``_run_prefill``, upstream Kimi K3 ``_forward``, the GDN
layers' ``_forward_core`` / ``_forward`` of upstream vLLM and vllm-ascend -- does the same three steps:
gather the initial states of the batch's cache rows, clear the rows without an initial state, scatter
the final states back. They differ only in *where* things are. A :class:`Seam` says that as data:

- ``state``: the recurrent-state cache -- an :class:`Argument` of the call or a :class:`KVCacheSlot` of
  ``self.kv_cache`` (the router swaps that one object for a routed alias during the call);
- ``indices`` / ``flags``: where the call's ``state_indices`` / ``has_initial_state`` live -- an
  :class:`Argument` or a :class:`MetadataField` of the layer's forward-context attention metadata;
- ``clear``: how the fork clears: :data:`CLEAR_NATIVE` (``initial[~flags, ...] = 0`` on the gathered
  tensor), :data:`CLEAR_FUNCTION` (the module-level ``clear_function(initial, flags)``), or
  :data:`CLEAR_NONE` (the gather function takes the flags itself, e.g. ``gather_initial_states``);
- ``gather_function``: module-level name the fork gathers through instead of indexing, if any;
- ``prefill_gated``: the seam is a whole forward: only calls whose forward-context metadata has
  ``num_prefills > 0`` are routed; decode-only and speculative-only calls pass through uncounted;
- ``final``: a :class:`FinalFrom` -- which callable returns the final state the seam scatters as
  ``state[indices] = final.to(state.dtype)``, so that cast is folded into the plan's scatter -- or None
  (the scatter then gets what the fork computed).

The mechanism that reads these declarations lives in :mod:`kda_patches.routing.calls` (it imports torch),
entered through the wrapt wrappers of :mod:`kda_patches.routing.wrappers`; this module imports nothing of
either (standard library only), so patch records can build seams at ``import kda_patches`` and the
mechanism modules can import the declarations without an import circle.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any

CLEAR_NATIVE = "native"
CLEAR_FUNCTION = "function"
CLEAR_NONE = "none"
_CLEARS = (CLEAR_NATIVE, CLEAR_FUNCTION, CLEAR_NONE)


class Argument:
    """A call argument: ``position`` among the arguments after ``self``, or keyword ``name``."""

    __slots__ = ("name", "position")

    def __init__(self, position: int, name: str) -> None:
        self.position = position
        self.name = name

    def __repr__(self) -> str:
        return f"Argument({self.position}, {self.name!r})"


class KVCacheSlot:
    """Entry ``slot`` of the layer's ``self.kv_cache`` tuple/list (e.g. 1: the recurrent state)."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def __repr__(self) -> str:
        return f"KVCacheSlot({self.slot})"


class MetadataField:
    """Attribute ``name`` of the layer's entry in vLLM's forward-context ``attn_metadata[self.prefix]``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"MetadataField({self.name!r})"


class FinalFrom:
    """Where a seam's final state comes from: element ``index`` of what its chunk callable returns.

    Exactly one of:

    - ``attribute``: the seam calls ``self.<attribute>(...)`` (a layer attribute: a CustomOp module, a bound
      method); the router shadows that attribute on the layer instance for the call;
    - ``function``: the seam calls a module-level (or ``Class.static``) name; the patch record wraps that
      name with :data:`wrap_final` as a target of the seam's group.
    """

    __slots__ = ("attribute", "function", "index")

    def __init__(self, index: int, attribute: str | None = None, function: str | None = None) -> None:
        if (attribute is None) == (function is None):
            raise ValueError(f"FinalFrom needs exactly one of attribute / function, got {attribute!r} / {function!r}")
        self.index = index
        self.attribute = attribute
        self.function = function

    def __repr__(self) -> str:
        where = f"self.{self.attribute}" if self.attribute else self.function
        return f"FinalFrom({where}()[{self.index}])"


class BackendGate:
    """Which of a layer's prefill backends the seam routes: the others keep the fork's copies (stand aside).

    A seam whose copies change owner with the layer's backend -- vLLM 0.34's Qwen ``_forward_core`` gathers
    inside ``_forward_flashinfer_prefill`` on its FlashInfer branch but scatters in the seam itself -- routes only
    where both copies are the seam's lines and routing was measured; a layer on any other backend gets no plan
    and its calls run the fork's function as written (counted ``calls_upstream``), so one call's gather and
    scatter never have two owners.

    Attributes:
        attribute: the layer attribute naming its backend (``gdn_prefill_backend``).
        routed: the backend values the seam routes.
        reason: why the others stand aside (status, conformance).
    """

    __slots__ = ("attribute", "reason", "routed")

    def __init__(self, attribute: str, routed: tuple[str, ...], reason: str) -> None:
        if not routed:
            raise ValueError(f"backend gate on {attribute!r}: name at least one routed backend")
        self.attribute = attribute
        self.routed = tuple(routed)
        self.reason = reason

    def __repr__(self) -> str:
        return f"BackendGate({self.attribute!r}, routed={self.routed!r})"

    def stands_aside_on(self, layer: Any) -> str | None:
        """Return why ``layer``'s backend is not routed (its value named), or None when it is."""
        value = getattr(layer, self.attribute, None)
        if value in self.routed:
            return None
        return f"{self.attribute}={value!r} (routed only on {', '.join(self.routed)}): {self.reason}"


class IndexedChunk:
    """A seam's chunk-state kernel that has an indexed twin (``KDA_PATCHES_STATE_IO=indexed``,
    :mod:`kda_patches.indexed_chunk`): the kernel reads the initial states from the cache rows and stores the final
    states into them, so the seam's gather and scatter copy nothing.

    Attributes:
        module: the module that defines the release's chunk-state host function and its kernel.
        host: the host function the seam's chunk call reaches (``chunk_gated_delta_rule_fwd_h``); its wrapper
            derives the twin when it is applied and launches it inside a routed call.
        kernel: the kernel's name in ``module``.
        backend: a :class:`BackendGate` naming the layer backends whose chunk call reaches ``host`` (Kimi K3's
            ``triton``, not FlashKDA), or None (every call of the seam does).
        measured: the seam's own layer was measured at least as fast with no copy (``auto``) at every batch size
            as unpatched and as the plan's copy (docs/results/no-copy): ``KDA_PATCHES_STATE_IO=measured``, the
            default, runs it as ``auto``; a seam without it copies there.
    """

    __slots__ = ("backend", "host", "kernel", "measured", "module")

    def __init__(self, module: str, host: str, kernel: str, backend: BackendGate | None = None,
                 measured: bool = False) -> None:
        self.module, self.host, self.kernel, self.backend = module, host, kernel, backend
        self.measured = measured

    @property
    def key(self) -> str:
        """``module:host``, the key the wrapped host function is registered under."""
        return f"{self.module}:{self.host}"

    def __repr__(self) -> str:
        return f"IndexedChunk({self.key!r}, kernel={self.kernel!r})"


def capture_section(section: str) -> str:
    """Return the ledger section that counts ``section``'s calls made while a breakable capture records."""
    return f"{section}:capture"


class Seam:
    """One state-copy seam of one fork function (see the module docstring).

    Attributes:
        name: short label for messages (``"vllm-ascend GDN _forward_core"``).
        section: ledger section of the patch that owns it (``kimi_prefill`` / ``gdn_state_copy``).
        state: :class:`Argument` or :class:`KVCacheSlot` holding the ``[N, H, V, K]`` cache.
        indices: where ``state_indices`` is (:class:`Argument` / :class:`MetadataField`), or None when
            only the gather function's own argument carries it.
        flags: where ``has_initial_state`` is, or None.
        clear: :data:`CLEAR_NATIVE`, :data:`CLEAR_FUNCTION` or :data:`CLEAR_NONE`.
        clear_function: module-level clear name (with :data:`CLEAR_FUNCTION`), e.g. ``clear_ssm_states``.
        gather_function: module-level gather name, e.g. ``gather_initial_states``, or None.
        scatter_function: module-level scatter name ``F(S, J, V)``, e.g. vllm-ascend 0.30's
            ``scatter_ssm_states_``, or ``F(S, V, J)`` with ``scatter_value_first``
            (vLLM 0.34's ``scatter_states(state, src, indices)``), or None. Such a seam is routed by the
            rewritten twin only (no alias wraps
            the function), and its body may also gather and scatter by indexing (the fork's CPU branch).
        prefill_gated: route only calls whose metadata has ``num_prefills > 0``.
        cache_slot: ``layer.kv_cache`` entry the worker startup prepares the plan for.
        final: :class:`FinalFrom` (the folded final-state cast) or None.
        scatter_value_first: the scatter function takes ``(state, values, indices)`` (vLLM >= 0.34's
            ``scatter_states``), not ``(state, indices, values)``.
        backend: a :class:`BackendGate` (the seam routes only some of the layer's prefill backends), or None.
        indexed: the :class:`IndexedChunk` the seam's chunk call reaches, or None (its states are always copied).
    """

    __slots__ = ("_at_capture", "backend", "cache_slot", "clear", "clear_function", "final", "flags",
                 "gather_function", "indexed", "indices", "name", "prefill_gated", "scatter_function",
                 "scatter_value_first", "section", "state")

    def __init__(self, name: str, section: str, state: Argument | KVCacheSlot, indices: Any = None,
                 flags: Any = None, clear: str = CLEAR_NATIVE, clear_function: str | None = None,
                 gather_function: str | None = None, prefill_gated: bool = False, cache_slot: int = 1,
                 final: FinalFrom | None = None, scatter_function: str | None = None,
                 scatter_value_first: bool = False, backend: BackendGate | None = None,
                 indexed: IndexedChunk | None = None) -> None:
        if clear not in _CLEARS:
            raise ValueError(f"seam {name!r}: clear must be one of {_CLEARS}, got {clear!r}")
        if (clear == CLEAR_FUNCTION) != (clear_function is not None):
            raise ValueError(f"seam {name!r}: clear={clear!r} and clear_function={clear_function!r} disagree "
                             "(a function clear names its function, and only it)")
        if not isinstance(state, (Argument, KVCacheSlot)):
            raise TypeError(f"seam {name!r}: state must be an Argument or a KVCacheSlot, got {state!r}")
        for label, where in (("indices", indices), ("flags", flags)):
            if where is not None and not isinstance(where, (Argument, MetadataField)):
                raise TypeError(f"seam {name!r}: {label} must be an Argument, a MetadataField or None")
        if (isinstance(indices, MetadataField) or isinstance(flags, MetadataField)) and not prefill_gated:
            raise ValueError(f"seam {name!r}: metadata fields are read from the forward context; "
                             "declare prefill_gated=True")
        self.name = name
        self.section = section
        self.state = state
        self.indices = indices
        self.flags = flags
        self.clear = clear
        self.clear_function = clear_function
        self.gather_function = gather_function
        self.scatter_function = scatter_function
        if scatter_value_first and scatter_function is None:
            raise ValueError(f"seam {name!r}: scatter_value_first describes a scatter function; name it")
        self.scatter_value_first = bool(scatter_value_first)
        self.prefill_gated = prefill_gated
        self.cache_slot = cache_slot
        if final is not None and not isinstance(final, FinalFrom):
            raise TypeError(f"seam {name!r}: final must be a FinalFrom or None, got {final!r}")
        self.final = final
        if backend is not None and not isinstance(backend, BackendGate):
            raise TypeError(f"seam {name!r}: backend must be a BackendGate or None, got {backend!r}")
        self.backend = backend
        if indexed is not None and not isinstance(indexed, IndexedChunk):
            raise TypeError(f"seam {name!r}: indexed must be an IndexedChunk or None, got {indexed!r}")
        self.indexed = indexed
        self._at_capture: Seam | None = None

    def __repr__(self) -> str:
        return f"Seam({self.name!r}, section={self.section!r})"

    @property
    def at_capture(self) -> Seam:
        """This declaration counted in its capture section (:func:`capture_section`): the calls a breakable
        CUDA-graph capture runs eagerly while recording (dummy batches, not requests) are routed like any
        other but kept out of ``calls_seen``."""
        twin = self._at_capture
        if twin is None:
            twin = object.__new__(Seam)
            for name in Seam.__slots__:
                setattr(twin, name, getattr(self, name))
            twin.section = capture_section(self.section)
            twin._at_capture = self._at_capture = twin
        return twin

    def describe(self) -> dict[str, Any]:
        """Return the declaration as a JSON-serialisable dict (ledger, doctor)."""
        return {"name": self.name, "state": repr(self.state), "indices": repr(self.indices),
                "flags": repr(self.flags), "clear": self.clear, "clear_function": self.clear_function,
                "gather_function": self.gather_function, "scatter_function": self.scatter_function,
                "scatter_value_first": self.scatter_value_first,
                "prefill_gated": self.prefill_gated,
                "final": repr(self.final) if self.final is not None else None,
                "backend": None if self.backend is None else {
                    "attribute": self.backend.attribute, "routed": list(self.backend.routed),
                    "reason": self.backend.reason},
                "indexed": None if self.indexed is None else self.indexed.key}
