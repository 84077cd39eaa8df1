"""Per-storage layout decisions: upstream vs dense state views vs separate states vs contiguous KV.

The era adapters (:mod:`.era013`, :mod:`.era032`) describe each layer's views as :class:`LayerEntry`
records; :func:`plan_layouts` groups them by raw storage and, storage by storage:

1. proves upstream's own layout (if even that fails, the checker's model does not match the fork: change
   nothing there and say so);
2. proposes dense per-state views for the state (mamba/GDN/KDA) layers, regrouped inside the layer's own
   region; accepted only with a proof; otherwise the opt-in separate mode (dense tensors outside the pool,
   only when the engine reserved their memory) or upstream's layout;
3. proposes contiguous ``(2, num_blocks, ...)`` KV for re-strided attention layers, proven against the
   final state layout of the same storage.

Every decision is one ledger fact under section ``kv_cache_layout``, keyed by layer name.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from kda_patches.kv_layout.checker import CheckerCache, Footprint, Verdict
from kda_patches.ledger import get_ledger

SECTION = "kv_cache_layout"


class LayerEntry:
    """One layer's views as the adapters see them.

    Attributes:
        name: layer name; group: its KV-cache group id; kind: ``state`` or ``attention`` or ``other``.
        storage: key of the raw storage the views live on (None when unknown).
        storage_nbytes: size of that storage.
        footprints: upstream footprints of its views (None: the views could not be described).
        dense_proposal: for state layers not already dense: footprints of the in-place dense layout.
        make_dense: builds the dense in-place views (called only after acceptance).
        make_separate: allocates dense states outside the pool (called only in separate mode).
        separate_nbytes: bytes the separate mode allocates for this layer.
        contiguous_proposal: for re-strided attention: footprints of the contiguous layout.
        make_contiguous: builds the contiguous view (called only after acceptance).
        apply: stores the chosen views back where the runner reads them (``apply(kind, views)``).
        note: reason recorded for a state layer that has no dense proposal.
    """

    def __init__(self, name: str, group: int, kind: str, storage: Any, storage_nbytes: int | None,
                 footprints: list[Footprint] | None) -> None:
        self.name = name
        self.group = group
        self.kind = kind
        self.storage = storage
        self.storage_nbytes = storage_nbytes
        self.footprints = footprints
        self.dense_proposal: list[Footprint] | None = None
        self.make_dense: Callable[[], Any] | None = None
        self.make_separate: Callable[[], Any] | None = None
        self.separate_nbytes = 0
        self.contiguous_proposal: list[Footprint] | None = None
        self.make_contiguous: Callable[[], Any] | None = None
        self.apply: Callable[[str, Any], None] = lambda kind, views: None
        self.note = "state views already dense"


def layer_specs(kv_cache_config: Any) -> dict[str, tuple[int, Any]]:
    """Return ``{layer: (group id, spec)}``; ``UniformTypeKVCacheSpecs`` resolve to the layer's own spec."""
    specs = {}
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        for name in group.layer_names:
            specs[name] = (group_id, per_layer[name] if per_layer is not None and name in per_layer else spec)
    return specs


def _record(entry: LayerEntry, decision: str, verdict: Verdict | None, reason: str, **extra: Any) -> None:
    fact: dict[str, Any] = {"kind": entry.kind, "decision": decision, "group": entry.group}
    if verdict is not None:
        fact.update(verdict.as_fact())
        fact["reason"] = reason or verdict.reason
    else:
        fact.update({"verdict": "not-checked", "reason": reason})
    fact.update(extra)
    get_ledger().set_fact(SECTION, entry.name, fact)


class NotInEffect(RuntimeError):
    """Raised under ``KDA_PATCHES_STRICT=1`` when a requested layout would silently not take effect."""


def refuse_not_in_effect(layer: str, why: str) -> None:
    """Separate mode was requested but ``layer`` would be bound upstream (no reservation): raise under STRICT.

    Without STRICT the layer keeps upstream's layout and the ledger says why (``status``/``regress`` then show
    ``kv_cache_layout`` as applied but not in effect).
    """
    from kda_patches import current_flags

    if current_flags().strict:
        raise NotInEffect(f"kv_cache_layout: KDA_PATCHES_KV_STATE_MODE=separate was requested but {layer} would be "
                          f"bound upstream: in-place regrouping is refused ({why}) and the engine reserved no "
                          "separate-state memory for it. Activate kda_patches in the engine-core process too "
                          "(the vLLM plugin entry point, the .pth file or kda-run), or unset the mode; "
                          "KDA_PATCHES_STRICT=1 refuses to serve with the mode silently not in effect")


def _footprints(entries: list[LayerEntry], chosen: dict[str, list[Footprint]]) -> list[Footprint]:
    return [fp for entry in entries for fp in chosen.get(entry.name, entry.footprints or [])]


def plan_storage(entries: list[LayerEntry], mode: str, reserved: set[str] | None, cache: CheckerCache,
                 actions: list[tuple[LayerEntry, str, Any]]) -> int:
    """Decide the layout of one raw storage; return the bytes allocated by the separate mode.

    The chosen views are appended to ``actions`` as ``(entry, kind, views)``; nothing is published here.

    Args:
        entries: every layer whose views live on this storage.
        mode: ``auto`` or ``separate`` (``KDA_PATCHES_KV_STATE_MODE``).
        reserved: layers the engine reserved separate-state memory for (None: no reservation was made).
        cache: verdict cache shared by the storages of one runner.
        actions: receives the views to publish once every storage is decided.
    """
    nbytes = entries[0].storage_nbytes
    if any(entry.footprints is None for entry in entries):
        unknown = [entry.name for entry in entries if entry.footprints is None]
        for entry in entries:
            _record(entry, "upstream", None, f"views of {unknown} on this storage cannot be described; "
                                             "nothing on it is changed")
        return 0
    upstream = cache.check(_footprints(entries, {}), nbytes)
    if not upstream.safe:
        for entry in entries:
            _record(entry, "upstream", upstream, "upstream layout not provable by the checker "
                                                 f"({upstream.reason}); nothing on this storage is changed")
        return 0
    chosen: dict[str, list[Footprint]] = {}
    separate_bytes = 0
    states = [entry for entry in entries if entry.kind == "state" and entry.dense_proposal is not None]
    if states:
        proposal = {entry.name: entry.dense_proposal for entry in states}
        verdict = cache.check(_footprints(entries, proposal), nbytes)
        for entry in states:
            if verdict.safe:
                actions.append((entry, "state", entry.make_dense()))
                chosen[entry.name] = proposal[entry.name]
                _record(entry, "dense-in-place", verdict, "")
            elif mode == "separate" and reserved is not None and entry.name in reserved:
                actions.append((entry, "state", entry.make_separate()))
                chosen[entry.name] = []
                separate_bytes += entry.separate_nbytes
                _record(entry, "separate", verdict, f"in-place regrouping refused ({verdict.reason}); dense "
                                                    f"states allocated outside the pool",
                        separate_bytes=entry.separate_nbytes)
            else:
                hint = ("the engine reserved no separate-state memory for it (kda_patches inactive in the "
                        "engine-core process?)" if mode == "separate" else
                        "KDA_PATCHES_KV_STATE_MODE=separate gives dense states outside the pool")
                if mode == "separate":
                    refuse_not_in_effect(entry.name, verdict.reason)
                _record(entry, "upstream", verdict, f"in-place regrouping refused ({verdict.reason}); {hint}")
    for entry in entries:
        if entry.kind == "state" and entry.dense_proposal is None:
            _record(entry, "upstream", upstream, entry.note)
    attention = [entry for entry in entries if entry.kind == "attention"]
    for entry in attention:
        if entry.contiguous_proposal is None:
            _record(entry, "upstream", upstream, "attention KV already has no per-block K/V re-stride")
            continue
        proposal = dict(chosen)
        proposal[entry.name] = entry.contiguous_proposal
        verdict = cache.check(_footprints(entries, proposal), nbytes)
        if verdict.safe:
            actions.append((entry, "attention", entry.make_contiguous()))
            chosen[entry.name] = entry.contiguous_proposal
            _record(entry, "contiguous", verdict, "")
        else:
            _record(entry, "upstream", verdict, f"skipping the K/V re-stride refused ({verdict.reason}); "
                                                "attention keeps upstream's interleaved layout")
    return separate_bytes


def plan_layouts(entries: list[LayerEntry], mode: str, reserved: set[str] | None, era: str) -> dict[str, Any]:
    """Group ``entries`` by storage, decide each storage, then publish all chosen views at once.

    A failure while deciding publishes nothing (the caller aborts startup with the error).

    Returns:
        The summary recorded in the ledger: storages, layers, decisions by kind, separate bytes, checker time.
    """
    began = time.perf_counter()
    cache = CheckerCache()
    storages: dict[Any, list[LayerEntry]] = {}
    for entry in entries:
        storages.setdefault(entry.storage if entry.storage is not None else ("unknown", entry.name), []).append(entry)
    actions: list[tuple[LayerEntry, str, Any]] = []
    separate = sum(plan_storage(group, mode, reserved, cache, actions) for group in storages.values())
    for entry, kind, views in actions:
        entry.apply(kind, views)
    facts = get_ledger().snapshot()["facts"].get(SECTION, {})
    decisions: dict[str, int] = {}
    for entry in entries:
        decision = facts.get(entry.name, {}).get("decision", "unknown")
        decisions[decision] = decisions.get(decision, 0) + 1
    summary = {"era": era, "mode": mode, "storages": len(storages), "layers": len(entries),
               "decisions": decisions, "separate_bytes": separate,
               "checker_ms": round(cache.seconds * 1e3, 3), "checker_cache_hits": cache.hits,
               "plan_ms": round((time.perf_counter() - began) * 1e3, 3)}
    get_ledger().set_fact(SECTION, "summary", summary)
    return summary
