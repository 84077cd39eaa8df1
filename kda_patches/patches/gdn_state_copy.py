"""``gdn_state_copy``: route the GDN layers' prefill state copy through the sealed state-copy plans.

Issue 8 / DESIGN §4.6. Qwen3.5/3.6 and Qwen3-Next, Olmo hybrid and Kimi Linear GDN layers gather, clear and
scatter their recurrent state in every prefill exactly like the Kimi layer, with torch-native indexing. This
record declares those seams (data only); the mechanism, the per-call proof and the worker startup hook are
the routing core shared with ``kimi_prefill`` (:mod:`kda_patches.routing`) -- one startup prepares the
plans of Kimi and GDN layers together, and layers with the same cache layout share one compiled table.

Seams, per the released sources (``kda-patches conformance`` re-reads them):

- vLLM >= 0.26 ``QwenGatedDeltaNetAttention._forward_core`` (``ssm_state[prefill_state_indices]``,
  native clear ``initial_state[~prefill_has_initial_state, ...] = 0``, ``ssm_state[idx] = last.to(dtype)``)
  and ``OlmoHybridGatedDeltaNetAttention._forward_core`` (the same on ``non_spec_state_indices_tensor`` /
  ``has_initial_state``, gather followed by ``.contiguous()``): the native clear is folded into the plan's
  flagged gather and elided (the metadata's flags are a routed alias for the call, so ``~flags`` is known);
- vLLM >= 0.27 ``KimiGatedDeltaNetAttention._forward`` (``gather_initial_states(recurrent_state, idx,
  flags)`` -- its module-level name is wrapped -- and ``recurrent_state[idx] = last``); 0.26's body cleared
  with ``recurrent_state[zero_idx] = 0`` (a boolean-mask index) and is not a target;
- vllm-ascend 0.26-0.29 ``AscendGatedDeltaNetAttention._forward_core`` (``clear_ssm_states`` elided after
  the folded gather; both the direct and the ``.transpose(-1, -2).contiguous()`` variant: the gather and the
  scatter go through the plan on the cache's own ``[N, H, V, K]`` layout, the fork's transposes stay its
  own copies, and the folded clear is recognised on the transposed copy, whose flag-false rows the folded
  gather already zeroed). vllm-ascend 0.30's NPU prefill paths gather and scatter through its own Triton
  kernels (``gather_ssm_states`` / ``scatter_ssm_states_``, flags and the dtype cast in one pass); its CPU
  branch indexes the cache. The overlay stands aside there by default (``KDA_PATCHES_GDN_PLAN=fork``: the era
  is inert with the reason); ``KDA_PATCHES_GDN_PLAN=overlay`` wraps the seam and the runners' startup hooks
  (``Target.chosen_by``) and the rewritten twin sends both kernel calls and the CPU branch's index copies to
  the overlay's plan (:data:`ASCEND_030_SEAM`).

vLLM 0.34 (V2 runner only; ``extend_kv_cache`` re-validates and republishes the plans after the extensible KV
cache's rebind, :mod:`kda_patches.routing.rebind`): Olmo is unchanged and routed; Qwen ``_forward_core`` and Kimi
Linear ``_forward`` copy states with upstream's own startup-warmed Triton ops ``gather_initial_states`` /
``scatter_states(state, src, indices)``. Each of those two seams follows the measurement of 0.34's own layer
(``KDA_PATCHES_GDN_OPS=measured``, the default; ``docs/results/h200-vllm-layers``, rule: route only where the plan
is at least as fast at every batch size, :data:`LAYER_RULE`): Qwen is routed through the plan, the overlay stands
aside on Kimi Linear (inert with the reason, conformance "stands down" on it: the plan is not at least as fast at
every batch size there). The figures are ``kda_patches/measured.json``'s (``kda-patches status`` prints them).
``upstream`` stands aside on both, ``overlay`` routes both (rewritten twin only:
``QWEN_034_SEAM`` / ``KIMI_GDN_034_SEAM``). Qwen's FlashInfer prefill branch (0.34's ``auto`` on SM90) gathers
inside ``_forward_flashinfer_prefill`` and scatters in the seam: the seam routes only layers on the Triton backend
(:data:`QWEN_FLASHINFER_GATE`); a FlashInfer layer gets no plan and keeps both of upstream's copies (``stands-aside``
in the ledger, its calls counted ``calls_upstream``).

Final-state cast folded into the scatter (``Seam.final``): where the released body scatters
``ssm_state[idx] = last_recurrent_state.to(ssm_state.dtype)`` with the final state straight from a chunk
callable -- Qwen's ``self.chunk_gated_delta_rule`` (a layer attribute, shadowed for the call), Olmo's module-level
``chunk_gated_delta_rule`` and vllm-ascend 0.27-0.29's fused ``_chunk_gated_delta_rule_fused`` (wrapped names) --
the ``.to()`` is deferred and the plan's scatter reads the FP32 final state and writes the cache dtype in one
pass (``casts_folded``). vllm-ascend's Triton variant casts a transposed copy (``.transpose(-1, -2)
.contiguous().to(...)``) and Kimi Linear scatters uncast: those are left as written.

No copy (``KDA_PATCHES_STATE_IO=indexed|auto``, :mod:`kda_patches.indexed_chunk`): every Triton prefill of these
seams reaches vLLM's vendored FLA ``chunk_gated_delta_rule_fwd_h``; each era declares that host from
:data:`~kda_patches.routing.eras.FLA_CHUNK_STATE_RELEASES` (:func:`~kda_patches.routing.eras.indexed_host_targets`):
wrapped, when chosen, from vLLM 0.32 (masked-pointer kernel), a declared gap before (block pointers). The seams'
``indexed`` declarations say which layers the twin serves: 0.34's Qwen and Kimi Linear (their seam's backend gate),
Olmo (every layer), pre-0.34 Qwen only on the Triton prefill backend (:data:`QWEN_CHUNK_STATE`; its folded
``.to(ssm_state.dtype)`` scatter is the twin's own exact cast) and pre-0.34 Kimi Linear only on FP32 caches
(:data:`KIMI_GDN_CHUNK_STATE`: it scatters the FP32 final states uncast); any other layer copies through the plan.

Decode-only and speculative-only batches pass through untouched and uncounted. Importing this module imports
neither torch nor vLLM.
"""

from __future__ import annotations

from kda_patches.patches.kimi_prefill import format_status_line as format_section_line
from kda_patches.registry import Patch, Target
from kda_patches.routing.eras import (
    CLEAR_PARAMETERS,
    FLA_CHUNK_STATE_FINAL_DTYPE,
    FLA_CHUNK_STATE_HOST,
    FLA_CHUNK_STATE_KERNEL,
    FLA_CHUNK_STATE_MODULE,
    GATHER_PARAMETERS,
    STATE_IO_WRAPS_MEASURED,
    UncastFinalGate,
    ascend_runners,
    era,
    indexed_host_targets,
    release_tuple,
    upstream_runners,
)
from kda_patches.routing.seams import (
    CLEAR_FUNCTION,
    CLEAR_NATIVE,
    CLEAR_NONE,
    BackendGate,
    FinalFrom,
    IndexedChunk,
    KVCacheSlot,
    MetadataField,
    Seam,
)
from kda_patches.routing.wrappers import (
    IndexedHostWrapper,
    RebindWrapper,
    SeamWrapper,
    StartupWrapper,
    wrap_clear,
    wrap_final,
    wrap_gather,
)

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any

LEDGER_PATH = "gdn_state_copy"

FORWARD_CORE_PARAMETERS = ("self", "mixed_qkv", "b", "a", "core_attn_out")
KIMI_GDN_FORWARD_PARAMETERS = ("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out")

_ASCEND_GDN = {"state": KVCacheSlot(1), "indices": MetadataField("prefill_state_indices"),
               "flags": MetadataField("prefill_has_initial_state"), "clear": CLEAR_FUNCTION,
               "clear_function": "clear_ssm_states", "prefill_gated": True}
ASCEND_SEAM = Seam("vllm-ascend GDN _forward_core", LEDGER_PATH, **_ASCEND_GDN)
# 0.30: the NPU branches call the fork's Triton kernels gather_ssm_states / scatter_ssm_states_ (flags, and the
# cast of the fused branch's final state, in one pass); the CPU branch indexes the cache as 0.26-0.29 did
ASCEND_030_SEAM = Seam("vllm-ascend 0.30 GDN _forward_core", LEDGER_PATH, **_ASCEND_GDN,
                       gather_function="gather_ssm_states", scatter_function="scatter_ssm_states_")
# vLLM >= 0.34: Qwen and Kimi Linear copy states with upstream's startup-warmed Triton ops gather_initial_states
# (flags inside) and scatter_states(state, src, indices) (the cast inside its store); routed only when chosen
_UPSTREAM_OPS = {"state": KVCacheSlot(1), "clear": CLEAR_NONE, "gather_function": "gather_initial_states",
                 "scatter_function": "scatter_states", "scatter_value_first": True, "prefill_gated": True}
# 0.34's Qwen FlashInfer branch (the `auto` choice on SM90, and SM100/SM120 with head_k_dim 128) gathers inside
# _forward_flashinfer_prefill while the seam scatters after it: routed, one call would have two owners
QWEN_FLASHINFER_GATE = BackendGate(
    "gdn_prefill_backend", ("triton",),
    "the FlashInfer branch gathers inside _forward_flashinfer_prefill (upstream's gather_initial_states) and the seam "
    "scatters after it, so routing the seam's scatter alone would give one call two owners; routing both copies on "
    "that backend is not measured (bench layers covers the Triton backend), so upstream keeps both; no copy "
    "(KDA_PATCHES_STATE_IO) does not reach it either: it would need FlashInfer's own state-pool prefill, which is "
    "not routed (docs/results/no-copy)")
# the chunk-state host function of vLLM's vendored FLA (every Triton GDN/KDA prefill reaches it), whose kernel has an
# indexed twin under KDA_PATCHES_STATE_IO=indexed (kda_patches.indexed_chunk)
FLA_CHUNK_STATE = IndexedChunk(FLA_CHUNK_STATE_MODULE, FLA_CHUNK_STATE_HOST, FLA_CHUNK_STATE_KERNEL)
# ... and as the seams of vLLM 0.34's Qwen and Kimi Linear layers reach it: their own layers were measured at least as
# fast with no copy (auto) at every batch size as unpatched and as the plan, in two runs (docs/results/no-copy), so
# KDA_PATCHES_STATE_IO=measured (the default) runs them as auto; Olmo's seam, not measured, copies
FLA_CHUNK_STATE_MEASURED = IndexedChunk(FLA_CHUNK_STATE_MODULE, FLA_CHUNK_STATE_HOST, FLA_CHUNK_STATE_KERNEL,
                                        measured=True)
# vLLM < 0.34's Qwen (gdn_prefill_backend, 0.31+): only its Triton branch (the CustomOp's forward_native) reaches FLA's
# chunk rule; FlashInfer, CuTe DSL, AITER FlyDSL and SYCL read the gathered initial states themselves (0.33's
# FlashInfer checkpoint plan too: it is planned only on that backend), so a layer on any of those only copies
QWEN_CHUNK_STATE = IndexedChunk(
    FLA_CHUNK_STATE_MODULE, FLA_CHUNK_STATE_HOST, FLA_CHUNK_STATE_KERNEL,
    backend=BackendGate("gdn_prefill_backend", ("triton",), "the FlashInfer, CuTe DSL, AITER FlyDSL and SYCL "
                        "prefills read the gathered initial states themselves (only the Triton chunk rule reaches "
                        "the indexed twin)"))
# vLLM < 0.34's Kimi Linear scatters the host's FP32 final states uncast (``recurrent_state[idx] = last``): the twin
# stands in for that only on an FP32 cache (into another, the release's index_put raises, and so does the copy route)
KIMI_GDN_CHUNK_STATE = IndexedChunk(
    FLA_CHUNK_STATE_MODULE, FLA_CHUNK_STATE_HOST, FLA_CHUNK_STATE_KERNEL,
    backend=UncastFinalGate(1, FLA_CHUNK_STATE_FINAL_DTYPE, "the seam scatters the host's final states without a "
                            "cast, which the release's own index_put refuses into another dtype (it raises): the "
                            "indexed twin would store them cast, so the layer copies and behaves as the release"))
QWEN_SEAM = Seam("vLLM Qwen GDN _forward_core", LEDGER_PATH, state=KVCacheSlot(1),
                 indices=MetadataField("prefill_state_indices"), flags=MetadataField("prefill_has_initial_state"),
                 clear=CLEAR_NATIVE, prefill_gated=True, final=FinalFrom(1, attribute="chunk_gated_delta_rule"),
                 indexed=QWEN_CHUNK_STATE)
KIMI_GDN_SEAM = Seam("vLLM Kimi Linear GDN _forward", LEDGER_PATH, state=KVCacheSlot(1), clear=CLEAR_NONE,
                     gather_function="gather_initial_states", prefill_gated=True, indexed=KIMI_GDN_CHUNK_STATE)
# Olmo's index copies (every release) reach the same host through FLA's chunk_gated_delta_rule: indexed where that
# host is wrapped (FLA_CHUNK_STATE_RELEASES)
OLMO_SEAM = Seam("vLLM Olmo hybrid GDN _forward_core", LEDGER_PATH, state=KVCacheSlot(1),
                 indices=MetadataField("non_spec_state_indices_tensor"), flags=MetadataField("has_initial_state"),
                 clear=CLEAR_NATIVE, prefill_gated=True, final=FinalFrom(1, function="chunk_gated_delta_rule"),
                 indexed=FLA_CHUNK_STATE)
QWEN_034_SEAM = Seam("vLLM 0.34 Qwen GDN _forward_core", LEDGER_PATH, **_UPSTREAM_OPS, backend=QWEN_FLASHINFER_GATE,
                     indexed=FLA_CHUNK_STATE_MEASURED)
KIMI_GDN_034_SEAM = Seam("vLLM 0.34 Kimi Linear GDN _forward", LEDGER_PATH, **_UPSTREAM_OPS,
                         indexed=FLA_CHUNK_STATE_MEASURED)
ASCEND_FUSED_CHUNK = "AscendGatedDeltaNetAttention._chunk_gated_delta_rule_fused"
# 0.27-0.29: the same seam, plus the fused variant's chunk as the final state's source (the folded cast)
ASCEND_FOLD_SEAM = Seam("vllm-ascend GDN _forward_core", LEDGER_PATH, **_ASCEND_GDN,
                        final=FinalFrom(1, function=ASCEND_FUSED_CHUNK))

wrap_qwen_forward_core = SeamWrapper(QWEN_SEAM)
wrap_olmo_forward_core = SeamWrapper(OLMO_SEAM)
wrap_kimi_gdn_forward = SeamWrapper(KIMI_GDN_SEAM)
wrap_ascend_forward_core = SeamWrapper(ASCEND_SEAM)
wrap_ascend_fold_forward_core = SeamWrapper(ASCEND_FOLD_SEAM)
wrap_ascend_030_forward_core = SeamWrapper(ASCEND_030_SEAM)
wrap_qwen_034_forward_core = SeamWrapper(QWEN_034_SEAM)
wrap_kimi_gdn_034_forward = SeamWrapper(KIMI_GDN_034_SEAM)
wrap_fla_chunk_state = IndexedHostWrapper(FLA_CHUNK_STATE)
wrap_initialize_kv_cache = StartupWrapper(LEDGER_PATH)
wrap_extend_kv_cache = RebindWrapper(LEDGER_PATH)

_GDN = "vllm.model_executor.layers.mamba.gdn"
_QWEN_SHAPES = ("read:self.kv_cache", "gather:ssm_state[prefill_state_indices]",
                "clear:initial_state[~prefill_has_initial_state, ...]=0", "scatter:ssm_state[prefill_state_indices]=",
                "fold:ssm_state[prefill_state_indices]=self.chunk_gated_delta_rule(...)[1].to(ssm_state.dtype)")
_OLMO_SHAPES = ("read:self.kv_cache", "gather:ssm_state[non_spec_state_indices_tensor]",
                "clear:initial_state[~has_initial_state, ...]=0", "scatter:ssm_state[non_spec_state_indices_tensor]=",
                "fold:ssm_state[non_spec_state_indices_tensor]=chunk_gated_delta_rule(...)[1].to(ssm_state.dtype)")
_KIMI_GDN_SHAPES = ("read:self.kv_cache", "gather:gather_initial_states(recurrent_state, ...)",
                    "scatter:recurrent_state[...]=")
_ASCEND_SHAPES = ("read:self.kv_cache", "gather:ssm_state[prefill_state_indices]",
                  "clear:clear_ssm_states(_, prefill_has_initial_state)", "scatter:ssm_state[prefill_state_indices]=")
_ASCEND_FOLD_SHAPES = (*_ASCEND_SHAPES, f"fold:ssm_state[prefill_state_indices]={ASCEND_FUSED_CHUNK}(...)"
                       "[1].to(ssm_state.dtype)")
ASCEND_FUSED_CHUNK_PARAMETERS = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "scale")

def _upstream_era(low: str, high: str) -> tuple[Target, ...]:
    members = [
        (f"{_GDN}.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention._forward_core", wrap_qwen_forward_core,
         FORWARD_CORE_PARAMETERS, _QWEN_SHAPES),
        (f"{_GDN}.olmo_gdn_linear_attn", "OlmoHybridGatedDeltaNetAttention._forward_core", wrap_olmo_forward_core,
         FORWARD_CORE_PARAMETERS, _OLMO_SHAPES),
        # re-exported FLA function: its keyword signature varies by release; the seam's fold shape is the contract
        (f"{_GDN}.olmo_gdn_linear_attn", "chunk_gated_delta_rule", wrap_final, None, ())]
    if release_tuple(low) >= (0, 27):  # 0.26's Kimi Linear _forward clears with a boolean-mask index: not this seam
        members += [
            (f"{_GDN}.kimi_gdn_linear_attn", "KimiGatedDeltaNetAttention._forward", wrap_kimi_gdn_forward,
             KIMI_GDN_FORWARD_PARAMETERS, _KIMI_GDN_SHAPES),
            (f"{_GDN}.kimi_gdn_linear_attn", "gather_initial_states", wrap_gather, GATHER_PARAMETERS, ())]
    targets = era("vllm", low, high, (*members, *upstream_runners(wrap_initialize_kv_cache, low)))
    return (*targets, *indexed_host_targets(wrap_fla_chunk_state, low, high, targets[0].group, STATE_IO_COPY))


UPSTREAM_OPS_CHOSEN = ("vLLM >= 0.34 copies this seam's GDN states with its own startup-warmed Triton ops "
                       "gather_initial_states / scatter_states (flags and cast in one pass, PDL on SM90+)")
# the rule that turns the measurement of 0.34's own layers into each seam's default (vllm_layers_check.py's
# seam_default); the figures it read are kda_patches/measured.json's entries for these targets
LAYER_RULE = ("per docs/results/h200-vllm-layers: a seam is routed by default only where the plan is at least as "
              "fast in 0.34's own layer at every batch size (unpatched/patched per engine step >= 1.00 at 1, 8, 64 "
              "and 256 sequences)")
QWEN_034_STAND_ASIDE = (f"{UPSTREAM_OPS_CHOSEN}; KDA_PATCHES_GDN_OPS=upstream chose them, so the overlay stands "
                        "aside; the default (measured) and overlay route those two calls through the overlay's "
                        f"sealed plan ({LAYER_RULE}, which Qwen's layer meets)")
KIMI_GDN_034_STAND_ASIDE = (f"{UPSTREAM_OPS_CHOSEN}, and 0.34's own Kimi Linear layer does not meet the rule "
                            f"({LAYER_RULE}) with the plan's copy, so the overlay stands aside "
                            "(KDA_PATCHES_GDN_OPS=measured, the default, or upstream); with no copy from 64 sequences "
                            "(KDA_PATCHES_STATE_IO=measured or auto) the layer meets it (per docs/results/no-copy), "
                            "but no engine A/B of Kimi Linear on 0.34 has run yet; KDA_PATCHES_GDN_OPS=overlay "
                            "routes those two calls through the overlay's sealed plan (and the indexed twin)")
# which KDA_PATCHES_GDN_OPS values route each 0.34 seam: the default follows LAYER_RULE on the layer measurement
# (docs/results/h200-vllm-layers: vllm_layers_check.py's DEFAULT lines)
QWEN_034_ROUTED_BY = ("measured", "overlay")
KIMI_GDN_034_ROUTED_BY = ("overlay",)
_QWEN_034_SHAPES = ("read:self.kv_cache", "gather:gather_initial_states(ssm_state, ...)",
                    "scatter:scatter_states(ssm_state, ...)")
_KIMI_GDN_034_SHAPES = ("read:self.kv_cache", "gather:gather_initial_states(recurrent_state, ...)",
                        "scatter:scatter_states(recurrent_state, ...)")


STATE_IO_COPY = ("KDA_PATCHES_STATE_IO=copy, or measured (the default) in a release where no seam reaching this "
                 "host was measured faster with no copy: routed prefills copy their states through the sealed "
                 "plan; KDA_PATCHES_STATE_IO=indexed (or auto) wraps this host function so the Qwen and Olmo seams' "
                 "chunk kernel reads and stores the cache rows itself (an indexed twin derived from the release's "
                 "kernel source; Kimi Linear's too where its seam is routed: before vLLM 0.34 on FP32 caches, on "
                 "0.34 where KDA_PATCHES_GDN_OPS=overlay routes it)")


def _upstream_034_era(low: str, high: str) -> tuple[Target, ...]:
    """vLLM >= 0.34: Olmo (index copies) routed; Qwen and Kimi Linear (upstream's own ops) each when chosen.

    ``KDA_PATCHES_GDN_OPS=measured`` (default) routes Qwen and leaves Kimi Linear to upstream's ops, as the
    measurement of 0.34's own layers says by :data:`LAYER_RULE` (:data:`QWEN_034_ROUTED_BY`,
    :data:`KIMI_GDN_034_ROUTED_BY`).

    One group: the members standing aside by choice are not members while they stand aside
    (:func:`kda_patches.verdicts.group_verdict`), so Olmo and the runner hooks apply without them; chosen, they
    join the group (applied together with the hooks or not at all).
    """
    plain = era("vllm", low, high, (
        (f"{_GDN}.olmo_gdn_linear_attn", "OlmoHybridGatedDeltaNetAttention._forward_core", wrap_olmo_forward_core,
         FORWARD_CORE_PARAMETERS, _OLMO_SHAPES),
        (f"{_GDN}.olmo_gdn_linear_attn", "chunk_gated_delta_rule", wrap_final, None, ()),
        *upstream_runners(wrap_initialize_kv_cache, low, wrap_extend_kv_cache)))
    qwen = era("vllm", low, high, (
        (f"{_GDN}.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention._forward_core", wrap_qwen_034_forward_core,
         FORWARD_CORE_PARAMETERS, _QWEN_034_SHAPES),), chosen_by=("gdn_ops", QWEN_034_ROUTED_BY),
        stands_aside=QWEN_034_STAND_ASIDE)
    indexed = indexed_host_targets(wrap_fla_chunk_state, low, high, qwen[0].group, STATE_IO_COPY,
                                   chosen=STATE_IO_WRAPS_MEASURED)
    kimi_linear = era("vllm", low, high, (
        (f"{_GDN}.kimi_gdn_linear_attn", "KimiGatedDeltaNetAttention._forward", wrap_kimi_gdn_034_forward,
         KIMI_GDN_FORWARD_PARAMETERS, _KIMI_GDN_034_SHAPES),), chosen_by=("gdn_ops", KIMI_GDN_034_ROUTED_BY),
        stands_aside=KIMI_GDN_034_STAND_ASIDE)
    return (*plain, *qwen, *indexed, *kimi_linear)


def _ascend_era(low: str, high: str) -> tuple[Target, ...]:
    if release_tuple(low) < (0, 27):  # 0.26 has only the Triton variant (transposed copies around the chunk)
        seam: tuple[tuple[Any, ...], ...] = (
            ("vllm_ascend.ops.gdn", "AscendGatedDeltaNetAttention._forward_core", wrap_ascend_forward_core,
             FORWARD_CORE_PARAMETERS, _ASCEND_SHAPES),)
    else:
        seam = (("vllm_ascend.ops.gdn", "AscendGatedDeltaNetAttention._forward_core", wrap_ascend_fold_forward_core,
                 FORWARD_CORE_PARAMETERS, _ASCEND_FOLD_SHAPES),
                ("vllm_ascend.ops.gdn", ASCEND_FUSED_CHUNK, wrap_final, ASCEND_FUSED_CHUNK_PARAMETERS, ()))
    return era("vllm-ascend", low, high, (
        *seam, ("vllm_ascend.ops.gdn", "clear_ssm_states", wrap_clear, CLEAR_PARAMETERS, ()),
        *ascend_runners(wrap_initialize_kv_cache, low)))


ASCEND_030_INERT = ("vllm-ascend 0.30's NPU prefill paths gather and scatter GDN states through its own Triton "
                    "kernels gather_ssm_states / scatter_ssm_states_ (flags and cast in one pass), so the overlay "
                    "stands aside (KDA_PATCHES_GDN_PLAN=fork, the default); KDA_PATCHES_GDN_PLAN=overlay routes "
                    "those two calls through the overlay's sealed plan")
_ASCEND_030_SHAPES = ("read:self.kv_cache", "gather:gather_ssm_states(ssm_state, ...)",
                      "scatter:scatter_ssm_states_(ssm_state, ...)")


def _ascend_030_era(low: str, high: str) -> tuple[Target, ...]:
    """vllm-ascend >= 0.30: the seam and the runners' startup hook, applied only under KDA_PATCHES_GDN_PLAN=overlay."""
    return era("vllm-ascend", low, high, (
        ("vllm_ascend.ops.gdn", "AscendGatedDeltaNetAttention._forward_core", wrap_ascend_030_forward_core,
         FORWARD_CORE_PARAMETERS, _ASCEND_030_SHAPES),
        *ascend_runners(wrap_initialize_kv_cache, low)), chosen_by=("gdn_plan", "overlay"),
        stands_aside=ASCEND_030_INERT)

PATCH = Patch(
    name=LEDGER_PATH,
    summary="route the GDN layers' prefill gather(+clear)/scatter through the sealed state-copy plans "
    "(shared routing core and startup with kimi_prefill)",
    targets=(*_upstream_era("0.26", "0.27"), *_upstream_era("0.27", "0.30"), *_upstream_era("0.30", "0.34"),
             *_upstream_034_era("0.34", "0.35"),
             *_ascend_era("0.26", "0.27"), *_ascend_era("0.27", "0.28"), *_ascend_era("0.28", "0.30"),
             *_ascend_030_era("0.30", "0.40"),
             Target("vllm_ascend.ops.gdn", "clear_ssm_states", None, "vllm-ascend", "vllm-ascend", "0.30", "0.40",
                    inert="vllm-ascend 0.30 calls clear_ssm_states only in its CPU branch, right after the gather "
                    "the rewritten seam folds it into (KDA_PATCHES_GDN_PLAN=overlay); nothing wraps it")),
)


def build_patch(name: str, seams: tuple[tuple[str, str, Seam], ...],
                runners: tuple[tuple[str, str, tuple[str, ...]], ...] = (), clear_module: str | None = None,
                gather_module: str | None = None, group: str | None = "reference") -> Patch:
    """Return a record with GDN seams on other modules (tests' stand-in layers or released functions).

    Args:
        name: the record's name (routed calls count in each seam's own section).
        seams: ``(module, qualname, seam)`` per seam function.
        runners: ``(module, class, parameters)`` whose ``initialize_kv_cache`` gets the startup hook.
        clear_module: module whose ``clear_ssm_states`` is wrapped, or None.
        gather_module: module whose ``gather_initial_states`` is wrapped, or None.
        group: the one group every target joins (None: uncoupled). No version ranges are declared.
    """
    targets = [Target(module, qualname, SeamWrapper(seam), group=group) for module, qualname, seam in seams]
    if clear_module is not None:
        targets.append(Target(clear_module, "clear_ssm_states", wrap_clear, parameters=CLEAR_PARAMETERS, group=group))
    if gather_module is not None:
        targets.append(Target(gather_module, "gather_initial_states", wrap_gather, parameters=GATHER_PARAMETERS,
                              group=group))
    for module, cls, parameters in runners:
        targets.append(Target(module, f"{cls}.initialize_kv_cache", wrap_initialize_kv_cache, parameters=parameters,
                              group=group))
    return Patch(name=name, summary=PATCH.summary, targets=tuple(targets))


def format_status_line(snapshot: dict[str, Any]) -> str:
    """Return the one-line ``status`` summary of this patch (same form as ``kimi_prefill``'s)."""
    return format_section_line(snapshot, LEDGER_PATH)
