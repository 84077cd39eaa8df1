"""Worker-level plan initialization and the per-layer bindings the Kimi prefill wrapper calls.

:func:`initialize` prepares one compiled plan per distinct ``(plan kind, cache signature, final-dtype
set)``, seals them all, and only then creates one :class:`LayerStatePlan` binding per layer. Any failure raises a
``RuntimeError`` that names the layer and the reason, and no binding exists (the caller publishes
the returned bindings to its layers all at once). Nothing is registered globally: two workers in one
process initialize independently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kda_patches.ledger import get_ledger
from kda_patches.state_copy import ops as _ops  # noqa: F401  (registers the custom ops before any trace)
from kda_patches.state_copy.casts import dtype_name, normalize_final_dtypes
from kda_patches.state_copy.device import PDL_WHERE_AVAILABLE, route_plan
from kda_patches.state_copy.errors import LEDGER_SECTION, LayoutError, refuse
from kda_patches.state_copy.layout import cache_signature, describe_layout
from kda_patches.state_copy.plan import PLAN_CLASSES, StateCopyPlan

FinalDtypes = tuple[torch.dtype, ...] | Mapping[str, tuple[torch.dtype, ...]] | None


class LayerStatePlan:
    """One layer's binding to a sealed, possibly shared, compiled plan.

    Attributes:
        layer_name: the layer's name (the key of vLLM's ``no_compile_layers``).
        kind: ``"fused"`` or ``"fallback"``.
        plan: the shared :class:`~kda_patches.state_copy.plan.StateCopyPlan`.
    """

    __slots__ = ("kind", "layer_name", "plan")

    def __init__(self, layer_name: str, plan: StateCopyPlan) -> None:
        self.layer_name = layer_name
        self.kind = plan.kind
        self.plan = plan

    def __repr__(self) -> str:
        return f"LayerStatePlan({self.layer_name!r}, kind={self.kind!r}, sealed={self.plan.sealed})"

    @property
    def final_dtypes(self) -> tuple[torch.dtype, ...]:
        """The final-state dtypes the scatter accepts (decided at startup; others are refused)."""
        return self.plan.final_dtypes

    def gather(self, state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None = None) -> torch.Tensor:
        """Gather initial states: packed row ``s`` = cache row ``indices[s]``, zero when invalid or flag false.

        Args:
            state: this layer's recurrent-state cache ``[N, H, V, K]``.
            indices: ``[S]`` int32/int64 cache rows on the cache's device.
            flags: optional ``[S]`` torch.bool (``has_initial_state``).
        Returns:
            ``[S, H, V, K]`` in the cache dtype. Under ``torch.compile`` this is the opaque custom op
            ``kda_patches::state_gather``.
        Raises:
            StateCopyRefused / LayoutError: the call breaks the plan contract (nothing is launched).
        """
        if torch.compiler.is_compiling():
            return torch.ops.kda_patches.state_gather(state, indices, flags, self.layer_name)
        return self.plan.gather_eager(state, indices, flags, self.layer_name)

    def scatter(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
        """Scatter final states into the cache, cast to its dtype in the same kernel; invalid indices are skipped.

        Args:
            state: this layer's recurrent-state cache, modified in place.
            packed: ``[S, H, V, K]`` final states in one of the layer's prepared final dtypes (read in
                that dtype; the cache gets bit for bit ``packed.to(state.dtype)``).
            indices: ``[S]`` int32/int64 destination rows (valid ones unique).
        Raises:
            StateCopyRefused / LayoutError: the call breaks the plan contract, e.g. ``final_dtype``: a
                final dtype not prepared at startup (nothing is launched).
        """
        if torch.compiler.is_compiling():
            torch.ops.kda_patches.state_scatter(state, packed, indices, self.layer_name)
            return
        self.plan.scatter_eager(state, packed, indices, self.layer_name)


def _fail(layer: str, exc: BaseException, stage: str) -> RuntimeError:
    """Record a failed initialization in the ledger and build the error naming the layer."""
    reason = getattr(exc, "reason", type(exc).__name__)
    message = (f"state-copy plan initialization failed at {stage} for layer {layer!r} ({reason}): {exc}; "
               "no plan was published")
    get_ledger().set_fact(LEDGER_SECTION, "initialization", {"ok": False, "layer": layer, "stage": stage,
                                                             "reason": str(reason), "message": message})
    return RuntimeError(message)


def prepare_sealed(plan_class: type[StateCopyPlan], state: torch.Tensor, max_selected: int, layer: str,
                   final_dtypes: tuple[torch.dtype, ...], target: Any, pdl: bool | str, stage: list[str]
                   ) -> StateCopyPlan:
    """Prepare and seal one table's plan; ``stage[0]`` names the step running (``prepare`` / ``seal``) if it raises."""
    stage[0] = "prepare"
    plan = plan_class.prepare(state, max_selected, layer=layer, final_dtypes=final_dtypes, target=target, pdl=pdl)
    stage[0] = "seal"
    plan.seal()
    return plan


def resolve_final_dtypes(states: Mapping[str, torch.Tensor], final_dtypes: FinalDtypes
                         ) -> dict[str, tuple[torch.dtype, ...]]:
    """Return each layer's final-state dtypes (deduplicated, in order) from ``initialize``'s argument.

    Raises:
        RuntimeError: a mapping key that names no layer, or a bad dtype (naming the layer).
    """
    if isinstance(final_dtypes, Mapping):
        unknown = sorted(set(final_dtypes) - set(states))
        if unknown:
            try:
                refuse("final_dtype", f"final_dtypes names layers that have no state: {unknown}; key it by the "
                       "names of the states passed to initialize()", unknown[0], LayoutError)
            except LayoutError as exc:
                raise _fail(unknown[0], exc, "routing") from exc
    resolved = {}
    for name, state in states.items():
        wanted = final_dtypes.get(name) if isinstance(final_dtypes, Mapping) else final_dtypes
        try:
            resolved[name] = normalize_final_dtypes(wanted, state.dtype, name)
        except Exception as exc:
            raise _fail(name, exc, "routing") from exc
    return resolved


def initialize(states: Mapping[str, torch.Tensor], max_selected: int, soc: int | str | None = None,
               final_dtypes: FinalDtypes = None, pdl: bool | str = False) -> dict[str, LayerStatePlan]:
    """Prepare and seal the plans of a worker's layers; return one binding per layer.

    Args:
        states: layer name -> that layer's recurrent-state cache ``[N, H, V, K]`` (bound, final layout).
        max_selected: the most rows one call may select (``scheduler_config.max_num_seqs``).
        soc: Ascend SoC version for NPU caches (probed from torch_npu when None).
        final_dtypes: the dtypes the layers' final states (the scatter's input) may have, decided
            here at startup: a tuple of torch dtypes (FP32, BF16, FP16) for every layer, or a mapping
            layer name -> tuple (layers it leaves out, and ``None``, get the default); default
            ``(cache dtype, torch.float32)`` deduplicated. Each plan compiles exactly
            ``2 + 2 * F`` variants for its ``F`` final dtypes (two gathers, INT32/INT64, and two
            scatters per final dtype: the issue's "four per final dtype"), all on scratch before
            seal; a scatter of any other dtype is refused before launch.
        pdl: programmatic dependent launch for the fused plans, as :meth:`StateCopyPlan.prepare` takes it:
            ``True``, ``False`` or ``"auto"`` (where the target has it: NVIDIA SM90+). Serving passes
            ``KDA_PATCHES_PDL``'s choice (:meth:`kda_patches.flags.Flags.pdl_request`; ``auto`` by default).
            With ``auto``, a table whose PDL plan fails to prepare or seal (a compile, the scratch launch) is
            prepared again with plain launches and its layers' facts say why (``pdl_dropped``); an explicit
            ``True`` fails as any other preparation does.
    Returns:
        ``{layer_name: LayerStatePlan}``; layers with the same plan kind, cache signature and
        final-dtype set share one compiled plan. Nothing is published anywhere: the caller attaches
        them all at once. The ledger fact of each layer records its ``final_dtypes`` and casts.
    Raises:
        RuntimeError: naming the first layer that failed (layout, routing, final dtypes, compile,
            scratch run or seal) and why; no binding is returned.
    """
    from kda_patches import current_flags

    force_triton = current_flags().force_triton
    finals = resolve_final_dtypes(states, final_dtypes)
    groups: dict[tuple[Any, ...], list[str]] = {}
    routes = {}
    for name, state in states.items():
        try:
            describe_layout(state, name)
            routes[name] = route_plan(state.device, state.dtype, soc, name)
        except Exception as exc:
            raise _fail(name, exc, "routing") from exc
        final_set = tuple(sorted(finals[name], key=str))  # a set: the order given does not split tables
        groups.setdefault((routes[name].kind, cache_signature(state), final_set, routes[name].target.name),
                          []).append(name)

    plans: dict[tuple[Any, ...], StateCopyPlan] = {}
    pdl_dropped: dict[tuple[Any, ...], str] = {}
    for key, names in groups.items():
        first = names[0]
        stage = ["prepare"]  # where a failure happened: prepare_sealed moves it on
        arguments = (PLAN_CLASSES[key[0]], states[first], max_selected, first, finals[first], routes[first].target)
        try:
            try:
                plans[key] = prepare_sealed(*arguments, pdl, stage)
            except Exception as exc:
                if pdl != PDL_WHERE_AVAILABLE:  # PDL asked for explicitly (or off): its failure is the failure
                    raise
                # auto: PDL is an optimization the target offered; its compile or scratch launch failing must not
                # cost the worker its startup -- plain launches, and the ledger says why
                pdl_dropped[key] = (f"PDL plan failed at {stage[0]} ({type(exc).__name__}: {exc}); prepared "
                                    "with plain launches (KDA_PATCHES_PDL=auto)")
                plans[key] = prepare_sealed(*arguments, False, stage)
        except Exception as exc:
            raise _fail(first, exc, stage[0]) from exc

    bindings = {name: LayerStatePlan(name, plans[key]) for key, names in groups.items() for name in names}
    ledger = get_ledger()
    tables = {key: f"{key[0]}#{number}" for number, key in enumerate(plans)}
    for key, names in groups.items():
        described = plans[key].describe()
        for name in names:
            ledger.set_fact(LEDGER_SECTION, name, {
                **routes[name].as_dict(), "table": tables[key], "shared_by": len(names),
                "signature": [str(part) for part in key[1]], "max_selected": int(max_selected),
                "final_dtypes": [dtype_name(dtype) for dtype in finals[name]], "casts": described["casts"],
                "variants": len(described["variants"]), "launch_entry": described["launch_entry"],
                "scatter_evict_first": described["scatter_evict_first"], "block": described["block"],
                "block_limited_by": described["block_limited_by"], "memory_hints": described["memory_hints"],
                "pdl": described["pdl"], **({"pdl_dropped": pdl_dropped[key]} if key in pdl_dropped else {}),
                "native_op": "never (KDA_PATCHES_FORCE_TRITON=1)" if force_triton else "none available"})
    ledger.count(LEDGER_SECTION, "tables_prepared", len(plans))
    ledger.set_fact(LEDGER_SECTION, "initialization", {"ok": True, "layers": len(bindings), "tables": len(plans)})
    return bindings
