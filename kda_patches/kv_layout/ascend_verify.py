"""Startup verifier of vllm-ascend 0.26-0.30's own KV-cache layout: prove it, or refuse to start.

vllm-ascend lays out its KV cache itself (``NPUModelRunner._reshape_kv_cache_tensors``); the overlay changes nothing
there. ``kv_cache_layout`` wraps that method and, as soon as it returns, :func:`verify` hands every view it built --
this process's real tensors, before anything is bound or served -- to the aliasing checker, described and ranked
exactly as the CPU proof of the released code does (:func:`~kda_patches.kv_layout.ascend_verdict.describe_views`,
:func:`~kda_patches.kv_layout.ascend_verdict.ranked_verdict`; table in ``docs/results/ascend-kv-layout``). The
verdict alone decides (:func:`action_for`), never a list of releases or models:

- ``proven``: the patch is a read-only verifier. The views go back untouched; the ledger says "upstream layout
  proven" and what was checked (fact ``ascend_layout``, and the ``summary`` in mode ``verify``).
- ``overlap found`` or ``out of storage``: startup stops with :class:`LayoutRefused`, naming the release, the model,
  the two views, the shared byte, how far each view advances per block id, and the fix.
- ``not checkable`` (a view the checker cannot describe, or the checker gave up): the fork's layout is kept, with
  one WARNING and the fact saying "upstream layout not proven"; under ``KDA_PATCHES_STRICT=1`` startup stops
  with :class:`LayoutRefused` instead.

Why refuse rather than move the states to a proven layout (the separate mode of the upstream eras): on vllm-ascend
that needs the engine core's KV budget shrunk by the states' bytes through the fork's own planner (its
``patch_kv_cache_utils`` replaces the planner functions the upstream budget wrapper calls again), and every consumer
the fork binds to the states rebound -- its state-copy plans are prepared from the bound states right after this
reshape, and its convolution and recurrent kernels read them through ``fla_npu``. None of that can be executed here
without an NPU, so no such mode is offered: the refusal names what avoids the overlap instead.

Imports torch (through the view descriptions); imported by the wrapper at startup only.
"""

from __future__ import annotations

import logging
from typing import Any

from kda_patches.kv_layout.ascend_verdict import describe_views, ranked_verdict
from kda_patches.kv_layout.checker import Footprint
from kda_patches.ledger import get_ledger

SECTION = "kv_cache_layout"
FACT = "ascend_layout"
TABLE = "docs/results/ascend-kv-layout/README.md"
PROVEN = "upstream layout proven"
NOT_PROVEN = "upstream layout not proven"
REFUSED_VERDICTS = ("overlap found", "out of storage")
FIX = (f"serve this model with a vllm-ascend release whose own layout the CPU proof finds memory-safe for it ({TABLE} "
       "lists the verdict per release, model and TP, e.g. Kimi K3 proven on 0.29.0rc1 with vLLM 0.29.0; "
       "`python -m kda_patches.kv_layout.ascend_proof` regenerates it), or a fork build that addresses this "
       "attention cache by the page stride as it does the state caches; no overlay mode moves the states within "
       "the fork's budget. KDA_PATCHES_DISABLE=kv_cache_layout starts the fork's layout unchecked, overlap included")


class LayoutRefused(RuntimeError):
    """The fork's own KV-cache layout lets two requests' cache bytes collide (or could not be proven under STRICT):
    startup stops before any request is served."""


def action_for(verdict: str, strict: bool) -> str:
    """What startup does with a verdict: ``refuse``, ``warn`` (keep the fork's layout, unproven) or ``verified``.

    Args:
        verdict: the ranked verdict (``proven``, ``overlap found``, ``out of storage``, ``not checkable``).
        strict: ``KDA_PATCHES_STRICT=1`` in this process.
    """
    if verdict in REFUSED_VERDICTS:
        return "refuse"
    if verdict == "proven":
        return "verified"
    return "refuse" if strict else "warn"


def model_name(runner: Any) -> str:
    """The model a runner serves, as its ``model_config`` names it (architecture, then the model path if any)."""
    config = getattr(runner, "model_config", None)
    architecture = getattr(config, "architecture", None)
    if architecture is None:
        architectures = getattr(getattr(config, "hf_config", None), "architectures", None) or [None]
        architecture = architectures[0]
    path = getattr(config, "model", None)
    parts = [str(architecture or "unknown architecture")] + ([f"({path})"] if isinstance(path, str) else [])
    return " ".join(parts)


def _strides(witness: dict[str, Any], footprints: list[Footprint]) -> str:
    """How far each side of a witness advances per block id, in bytes."""
    sides = [footprints[owner] for owner in witness["owners"]]
    return (f"`{sides[0].layer}` {sides[0].state} advances {sides[0].stride} bytes per block id and "
            f"`{sides[1].layer}` {sides[1].state} {sides[1].stride}")


def _state_views(views: dict[str, Any]) -> tuple[int, int]:
    """``(state views, of which page-strided)``: per-state tensors whose rows are not dense (``stride(0)`` the page)."""
    states = [tensor for value in views.values() if isinstance(value, list) for tensor in value if tensor is not None]
    return len(states), sum(not tensor.is_contiguous() for tensor in states)


def verify(kv_cache_config: Any, kv_caches: dict[str, Any], release: str, model: str, strict: bool) -> dict[str, Any]:
    """Prove the views the fork built, record the verdict, and refuse to start when they can collide.

    Args:
        kv_cache_config: the ``KVCacheConfig`` the reshape used (its groups name each layer's group).
        kv_caches: what the fork's reshape returned: layer -> K/V tensor or tuple, or list of state tensors.
        release: the installed stack, for messages (``vllm-ascend 0.30.0rc2 + vLLM 0.30.0``).
        model: the served model, for messages (:func:`model_name`).
        strict: ``KDA_PATCHES_STRICT=1``.

    Returns:
        The fact recorded under ``kv_cache_layout.ascend_layout``.

    Raises:
        LayoutRefused: the verdict is an overlap or out of storage, or not checkable under STRICT.
    """
    grouped = {name for group in kv_cache_config.kv_cache_groups for name in group.layer_names}
    views = {name: value for name, value in kv_caches.items() if name in grouped}
    num_blocks = kv_cache_config.num_blocks
    witness = None
    try:
        verdict, detail, witness, num_storages, num_views = ranked_verdict(describe_views(kv_cache_config, views))
    except Exception as error:  # a view the checker cannot describe: unproven, never a crash of the verifier
        verdict, detail, num_storages, num_views = "not checkable", f"views: {type(error).__name__}: {error}", 0, 0
    states, page_strided = _state_views(views)
    checked = (f"{num_views} views of {len(views)} layers on {num_storages} storage(s), block ids 0-{num_blocks - 1}, "
               "by the aliasing checker")
    return record_verdict(verdict, detail, witness, release=release, model=model, checked=checked, strict=strict,
                          fact_key=FACT, era="vllm-ascend", storages=num_storages, layers=len(views), fix=FIX,
                          refusing="refusing to start", subject="the fork's own KV-cache layout",
                          kept="the fork's layout is kept unchecked (KDA_PATCHES_STRICT=1 refuses to start instead)",
                          extra={"state_views": states, "state_views_page_strided": page_strided,
                                 "layers_outside_groups": sorted(set(kv_caches) - grouped)})


def record_verdict(verdict: str, detail: str, witness: Any, *, release: str, model: str, checked: str, strict: bool,
                   fact_key: str, era: str, storages: int, layers: int, fix: str, refusing: str, subject: str,
                   kept: str, where: str = "", extra: dict[str, Any] | None = None, counter: str | None = None
                   ) -> dict[str, Any]:
    """Record a layout verdict in the ledger and act on it: keep (proven), warn (unproven) or refuse.

    Shared by the vllm-ascend reshape verifier and vLLM 0.34's rebind verifier, which differ only in the words and
    the fact's extra fields passed here.

    Args:
        verdict, detail, witness: :func:`~kda_patches.kv_layout.ascend_verdict.ranked_verdict`'s answer.
        release, model, checked: for the fact and the messages.
        strict: ``KDA_PATCHES_STRICT=1`` (an unproven layout is refused).
        fact_key: the fact's name in the ``kv_cache_layout`` section.
        era, storages, layers: the ``summary`` fact's fields.
        fix, refusing, subject, kept: the refusal's fix, its verb, what collides, and the warning's last words.
        where: words after the release in the warning (`` after extend_kv_cache``), or "".
        extra: more fields of the fact.
        counter: a counter counted on every verdict, or None.
    Returns:
        The fact recorded.
    Raises:
        LayoutRefused: the verdict refuses (see :func:`action_for`).
    """
    action = action_for(verdict, strict)
    status = {"verified": PROVEN, "warn": NOT_PROVEN}.get(action, f"refused: {verdict}")
    fact = {"status": status, "verdict": verdict, "release": release, "model": model, "checked": checked,
            "detail": detail, **(extra or {})}
    ledger = get_ledger()
    ledger.set_fact(SECTION, fact_key, fact)
    decision = {"verified": "upstream-proven", "warn": "upstream-unproven"}.get(action, "refused")
    ledger.set_fact(SECTION, "summary", {"era": era, "mode": "verify", "storages": storages, "layers": layers,
                                         "decisions": {decision: layers}})
    if counter is not None:
        ledger.count(SECTION, counter)
    if action == "refuse":
        ledger.count(SECTION, "refusals")
        why = (f"lets two requests' cache bytes collide: {detail}; {_strides(*witness)}, so a request writing one "
               "changes the other's" if witness is not None else
               f"{verdict}: {detail}" + ("" if verdict in REFUSED_VERDICTS else
                                         " (KDA_PATCHES_STRICT=1 refuses an unproven layout)"))
        raise LayoutRefused(f"kda_patches kv_cache_layout: {refusing} {model} on {release}: {subject} {why}. "
                            f"Checked: {checked}. Fix: {fix}.")
    if action == "warn":
        logging.getLogger("kda_patches").warning("kv_cache_layout: %s for %s on %s%s (%s); %s", NOT_PROVEN, model,
                                                 release, where, detail, kept)
    return fact


def status_line(fact: dict[str, Any]) -> str:
    """The ``status`` line of a recorded verifier fact (``kv_cache_layout: upstream layout proven (...)``)."""
    strided = fact.get("state_views_page_strided", 0)
    kernels = (f"; {strided} of {fact.get('state_views', 0)} state views page-strided (the kernels that read them "
               "must take strides: `kda-patches doctor` reports fla_npu)" if strided else "")
    detail = f"; {fact['detail']}" if fact.get("detail") else ""
    return (f"kv_cache_layout: {fact['status']} on {fact.get('release')} for {fact.get('model')} "
            f"({fact.get('checked')}{detail}{kernels})")
