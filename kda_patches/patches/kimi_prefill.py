"""``kimi_prefill``: route the Kimi KDA layer's prefill state copy through a sealed state-copy plan.

Seed 000 / DESIGN §4.1. The Kimi layer's prefill gathers each request's initial recurrent state out of
the cache rows (clearing rows without an initial state), runs the chunk math, and scatters the final state
back. This record declares the two Kimi seams and their startup hooks; the mechanism is the shared routing
core (:mod:`kda_patches.routing`), the same one ``gdn_state_copy`` uses.

Targets, per the released sources (``kda-patches conformance`` re-reads them):

- vllm-ascend 0.26: ``AscendKimiGatedDeltaNetAttention._run_prefill``; 0.27-0.29:
  ``AscendKimiK3DeltaAttention._run_prefill`` (the class that defines ``_run_prefill`` in
  ``vllm_ascend.ops.kimi_kda``), the ``clear_ssm_states`` name that module calls, and both runners'
  ``initialize_kv_cache`` (``(self, kv_cache_config)`` up to 0.27, ``+ kv_cache_allocation_context`` from
  0.28) -- one group: applied together or not at all;
- vllm-ascend >= 0.30 ships its own plan: only ``initialize_kda_state_copy`` is wrapped, to record the
  fork's plan per layer (``decision: fork-native``) or, with ``KDA_PATCHES_KIMI_PLAN=overlay``, to publish
  the overlay's plan into the fork's seam (:mod:`kda_patches.routing.fork_native`; unverified on NPUs);
- upstream vLLM >= 0.27: ``KimiK3DeltaAttention._forward`` (prefill-gated), the ``gather_initial_states``
  name its module calls, and ``GPUModelRunner.initialize_kv_cache`` of V1 (``(self, kv_cache_config,
  is_profiling)`` before 0.29, ``+ kv_cache_allocation_context`` from 0.29) and V2 (``(self,
  kv_cache_config)`` before 0.29, the 4-parameter form from 0.29; one sibling per signature inside the
  0.27-0.29 era, :mod:`kda_patches.routing.eras`) -- one group; vLLM 0.34 (V2 runner only,
  ``+ extensible``, and ``extend_kv_cache``, after which the plans are re-validated and republished:
  :mod:`kda_patches.routing.rebind`): upstream gathers through its own ``gather_initial_states`` there but still
  scatters by index assignment, so the seam is routed as before.

No copy (``KDA_PATCHES_STATE_IO=indexed|auto``): every upstream era declares the chunk-state host its Triton KDA
prefill reaches (vLLM's vendored FLA ``chunk_gated_delta_rule_fwd_h``) from
:data:`~kda_patches.routing.eras.FLA_CHUNK_STATE_RELEASES`: wrapped when chosen from vLLM 0.32 on, a declared gap
before (0.27-0.31's block-pointer kernel). The seam's scatter ``final.to(recurrent_state.dtype)`` is the twin's own
exact cast, so every cache dtype is served; FlashKDA and FlashInfer layers copy (:data:`KIMI_K3_CHUNK_STATE`).

Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

from kda_patches.registry import Patch, Target
from kda_patches.routing.eras import (
    CLEAR_PARAMETERS,
    FLA_CHUNK_STATE_HOST,
    FLA_CHUNK_STATE_KERNEL,
    FLA_CHUNK_STATE_MODULE,
    GATHER_PARAMETERS,
    ascend_runners,
    era,
    indexed_host_targets,
    upstream_runners,
)
from kda_patches.routing.seams import (
    CLEAR_FUNCTION,
    CLEAR_NONE,
    Argument,
    BackendGate,
    IndexedChunk,
    KVCacheSlot,
    Seam,
    capture_section,
)
from kda_patches.routing.wrappers import (
    ForkPlanWrapper,
    IndexedHostWrapper,
    RebindWrapper,
    SeamWrapper,
    StartupWrapper,
    wrap_clear,
    wrap_gather,
)

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any

LEDGER_PATH = "kimi_prefill"

RUN_PREFILL_PARAMETERS = ("self", "q", "k", "v", "raw_gate", "beta", "recurrent_state", "state_indices",
                          "has_initial_state", "prebuilt_metadata")
FORWARD_PARAMETERS = ("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out")
FORK_INITIALIZE_PARAMETERS = ("static_forward_context", "max_selected")

ASCEND_SEAM = Seam("vllm-ascend Kimi _run_prefill", LEDGER_PATH, state=Argument(5, "recurrent_state"),
                   indices=Argument(6, "state_indices"), flags=Argument(7, "has_initial_state"),
                   clear=CLEAR_FUNCTION, clear_function="clear_ssm_states")
# KDA_PATCHES_STATE_IO=indexed: Kimi K3's Triton KDA prefill reaches vLLM's vendored FLA chunk-state host; its
# FlashKDA and FlashInfer branches read the gathered states themselves, so a layer on those only copies
KIMI_K3_CHUNK_STATE = IndexedChunk(
    FLA_CHUNK_STATE_MODULE, FLA_CHUNK_STATE_HOST, FLA_CHUNK_STATE_KERNEL,
    backend=BackendGate("kda_prefill_backend", ("triton",), "the FlashKDA and FlashInfer prefills read the gathered "
                        "initial states themselves (only the Triton chunk rule reaches the indexed twin)"))
UPSTREAM_SEAM = Seam("vLLM Kimi K3 _forward", LEDGER_PATH, state=KVCacheSlot(1), clear=CLEAR_NONE,
                     gather_function="gather_initial_states", prefill_gated=True, indexed=KIMI_K3_CHUNK_STATE)

wrap_run_prefill = SeamWrapper(ASCEND_SEAM)
wrap_upstream_forward = SeamWrapper(UPSTREAM_SEAM)
wrap_initialize_kv_cache = StartupWrapper(LEDGER_PATH)
wrap_fork_initialize = ForkPlanWrapper(LEDGER_PATH)
wrap_extend_kv_cache = RebindWrapper(LEDGER_PATH)
wrap_chunk_state = IndexedHostWrapper(KIMI_K3_CHUNK_STATE)
STATE_IO_COPY = ("KDA_PATCHES_STATE_IO=copy, or measured (the default: Kimi K3's own layer was never measured with "
                 "no copy): routed prefills copy their states through the sealed plan; KDA_PATCHES_STATE_IO=indexed "
                 "(or auto) wraps this host function so Kimi K3's Triton KDA prefill reads and stores the cache rows "
                 "itself (an indexed twin derived from the release's kernel source)")
wrap_clear_ssm_states = wrap_clear
wrap_gather_initial_states = wrap_gather

_ASCEND_SHAPES = ("gather:recurrent_state[state_indices]", "clear:clear_ssm_states(_, has_initial_state)",
                  "scatter:recurrent_state[state_indices]=")
_UPSTREAM_SHAPES = ("read:self.kv_cache", "gather:gather_initial_states(recurrent_state, ...)",
                    "scatter:recurrent_state[...]=")
_KIMI_KDA = "vllm_ascend.ops.kimi_kda"
_KIMI_K3 = "vllm.models.kimi_k3.nvidia.kda"


def _ascend_era(low: str, high: str, cls: str) -> tuple[Target, ...]:
    return era("vllm-ascend", low, high, (
        (_KIMI_KDA, f"{cls}._run_prefill", wrap_run_prefill, RUN_PREFILL_PARAMETERS, _ASCEND_SHAPES),
        (_KIMI_KDA, "clear_ssm_states", wrap_clear, CLEAR_PARAMETERS, ()),
        *ascend_runners(wrap_initialize_kv_cache, low)))


def _upstream_era(low: str, high: str) -> tuple[Target, ...]:
    members = era("vllm", low, high, (
        (_KIMI_K3, "KimiK3DeltaAttention._forward", wrap_upstream_forward, FORWARD_PARAMETERS, _UPSTREAM_SHAPES),
        (_KIMI_K3, "gather_initial_states", wrap_gather, GATHER_PARAMETERS, ()),
        *upstream_runners(wrap_initialize_kv_cache, low, wrap_extend_kv_cache)))
    # the chunk-state host the era's Triton KDA prefill reaches, where eras.FLA_CHUNK_STATE_RELEASES declares it
    return (*members, *indexed_host_targets(wrap_chunk_state, low, high, members[0].group, STATE_IO_COPY))


PATCH = Patch(
    name=LEDGER_PATH,
    summary="route the Kimi KDA prefill gather(+clear)/scatter through sealed state-copy plans prepared at "
    "worker startup (stand aside where the fork ships its own plan)",
    targets=(
        *_ascend_era("0.26", "0.27", "AscendKimiGatedDeltaNetAttention"),
        *_ascend_era("0.27", "0.28", "AscendKimiK3DeltaAttention"),
        *_ascend_era("0.28", "0.30", "AscendKimiK3DeltaAttention"),
        *era("vllm-ascend", "0.30", "0.40", (
            ("vllm_ascend.ops.kda_state_copy_plan", "initialize_kda_state_copy", wrap_fork_initialize,
             FORK_INITIALIZE_PARAMETERS, ("fork:kda_state_copy_plan",)),)),
        *(Target(_KIMI_KDA, qualname, None, "vllm-ascend", "vllm-ascend", "0.30", "0.40",
                 inert="vllm-ascend >= 0.30 copies Kimi states through its own plan (_ascend_kda_state_copy); "
                 "kimi_prefill observes it or overlays it through initialize_kda_state_copy instead")
          for qualname in ("AscendKimiK3DeltaAttention._run_prefill", "clear_ssm_states")),
        *_upstream_era("0.27", "0.30"),
        *_upstream_era("0.30", "0.34"),
        *_upstream_era("0.34", "0.35"),
    ),
)


def build_patch(name: str = "kimi_prefill_reference", ascend: tuple[str, str] | None = None,
                upstream: tuple[str, str] | None = None,
                runners: tuple[tuple[str, str, tuple[str, ...]], ...] = (), fork_plan: str | None = None,
                group: str | None = "reference") -> Patch:
    """Return a record with this patch's seams on other modules (tests' stand-in or reference layers).

    Args:
        name: the record's name (its ledger entries; the routed calls still count in ``kimi_prefill``).
        ascend: ``(module, class)`` shaped like vllm-ascend's (``_run_prefill`` + module-level ``clear_ssm_states``).
        upstream: ``(module, class)`` shaped like upstream's (``_forward`` + module-level ``gather_initial_states``).
        runners: ``(module, class, parameters)`` whose ``initialize_kv_cache`` gets the startup hook.
        fork_plan: module defining a fork-shaped ``initialize_kda_state_copy``, or None.
        group: the one group every target joins (None: uncoupled). No version ranges are declared.
    """
    targets = []
    if ascend is not None:
        targets += [Target(ascend[0], f"{ascend[1]}._run_prefill", wrap_run_prefill, parameters=RUN_PREFILL_PARAMETERS,
                           group=group),
                    Target(ascend[0], "clear_ssm_states", wrap_clear, parameters=CLEAR_PARAMETERS, group=group)]
    if upstream is not None:
        targets += [Target(upstream[0], f"{upstream[1]}._forward", wrap_upstream_forward,
                           parameters=FORWARD_PARAMETERS, group=group),
                    Target(upstream[0], "gather_initial_states", wrap_gather, parameters=GATHER_PARAMETERS,
                           group=group)]
    for module, cls, parameters in runners:
        targets.append(Target(module, f"{cls}.initialize_kv_cache", wrap_initialize_kv_cache, parameters=parameters,
                              group=group))
    if fork_plan is not None:
        targets.append(Target(fork_plan, "initialize_kda_state_copy", wrap_fork_initialize,
                              parameters=FORK_INITIALIZE_PARAMETERS, group=group))
    return Patch(name=name, summary=PATCH.summary, targets=tuple(targets))


def format_status_line(snapshot: dict[str, Any], section: str = LEDGER_PATH) -> str:
    """Return the one-line ``status`` summary of a state-copy patch from a ledger snapshot.

    Args:
        snapshot: ``Ledger.snapshot()`` (or a ledger JSON file's content).
        section: the patch's ledger section (``kimi_prefill`` or ``gdn_state_copy``).
    Returns:
        e.g. ``kimi_prefill: prefill calls seen 12, routed 12, bypassed 0; plans fused=4 (model.layers.0…);
        seams by rewrite 1``; calls a breakable CUDA-graph capture ran (dummy batches) follow as ``at graph
        capture seen N, routed N, bypassed N`` when there were any; layers where the fork keeps its own plan
        show as ``fork-native:fused=4 (…)``, layers whose prefill backend the seam does not route as ``stands-aside
        on flashinfer=N (…)`` (their calls: ``upstream N``); routed calls whose chunk kernel read and stored the
        cache rows itself (``KDA_PATCHES_STATE_IO=indexed``) as ``indexed N``;
        the last part counts the wrapped seam functions by routing mechanism (facts ``routing <target>``).
    """
    counters = snapshot.get("counters", {}).get(section, {})
    facts = snapshot.get("facts", {}).get(section, {})
    kinds: dict[str, list[str]] = {}
    for layer, fact in sorted(facts.items()):
        if isinstance(fact, dict) and "plan_kind" in fact:
            decision = fact.get("decision", "overlay-plan")
            prefix = "" if decision == "overlay-plan" else f"{decision}:"
            kinds.setdefault(f"{prefix}{fact['plan_kind']}", []).append(layer)
        elif isinstance(fact, dict) and fact.get("decision") == "stands-aside":  # a backend the seam does not route
            kinds.setdefault(f"stands-aside on {fact.get('backend')}", []).append(layer)
    plans = ", ".join(f"{kind}={len(layers)} ({layers[0]}{'…' if len(layers) > 1 else ''})"
                      for kind, layers in sorted(kinds.items())) or "none published"
    line = (f"{section}: prefill calls seen {counters.get('calls_seen', 0)}, routed "
            f"{counters.get('calls_routed', 0)}, bypassed {counters.get('calls_bypassed', 0)}")
    for extra in ("calls_refused", "calls_failed", "calls_upstream", "calls_indexed"):
        if counters.get(extra):
            line += f", {extra.split('_')[1]} {counters[extra]}"
    for extra in ("casts_folded", "casts_materialized"):  # the final-state cast inside the scatter, or not
        if counters.get(extra):
            line += f", {extra.replace('_', ' ')} {counters[extra]}"
    captured = snapshot.get("counters", {}).get(capture_section(section), {})
    if captured:  # breakable CUDA-graph capture's eager runs of dummy batches: not requests, counted apart
        line += (f"; at graph capture seen {captured.get('calls_seen', 0)}, routed {captured.get('calls_routed', 0)}, "
                 f"bypassed {captured.get('calls_bypassed', 0)}")
    mechanisms = sorted(fact["mechanism"] for key, fact in facts.items()
                        if key.startswith("routing ") and isinstance(fact, dict) and "mechanism" in fact)
    routing = ", ".join(f"{name} {mechanisms.count(name)}" for name in sorted(set(mechanisms)))
    return f"{line}; plans {plans}" + (f"; seams by {routing}" if routing else "")
