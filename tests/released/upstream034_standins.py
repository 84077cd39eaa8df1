"""What :mod:`upstream034_child` executes of vLLM 0.34.0 and what it stands in: the declared difference from 0.33.

0.33's layers run through :mod:`upstream_child` (:mod:`upstream_gdn_layers`, :mod:`upstream_kimi_layers`) with
the stand-ins of :mod:`gdn_standins` / :mod:`upstream_standins`; 0.34 reuses all of them (layer construction,
metadata, batch plan, kernels) and declares here only what differs:

- **executed from the release** (:data:`RELEASE_MODULES`): the four layer files, and what 0.34's seams copy states
  with -- ``gather_initial_states`` and ``scatter_states`` (``vllm.model_executor.layers.mamba.ops``), the latter
  launched through 0.34's warmup dispatcher (``vllm.model_executor.warmup.jit_warmup{,_triton_helper}``, no warmup
  runs: only its launch path) -- and Kimi K3's ``ops.kda_conv`` (its packed convolution declines CPU tensors, so
  the stock per-part convolution runs, vLLM's own CPU kernel). The two state ops' Triton kernels run under the
  Triton interpreter: their host functions assert ``state.is_cuda or state.is_xpu``, the one line lifted
  (:data:`LIFTED`); ``launch_pdl`` is False (the CPU platform's ``is_arch_support_pdl``), so the PDL calls
  ``gdc_wait`` / ``gdc_launch_dependents`` sit in a branch not taken -- the kernels' copies are what runs;
- ``vllm.triton_utils`` for the release's files: the real ``triton`` (what it is on a device with Triton; vLLM's
  CPU build disables it), as for vllm-ascend's releases (:func:`ascend_standins.triton_utils`);
- the runner: the V2 ``vllm.v1.worker.gpu.model_runner`` (0.34 has no V1 runner), 5-parameter
  ``initialize_kv_cache`` (``+ extensible``; :mod:`runner_standin`);
- Kimi K3 / Kimi Linear: the FLA KDA kernels stood in as for 0.33, ``gather_initial_states`` NOT stood in;
- ``vllm.v1.worker.extensible_kv_cache`` (absent from 0.32): a stand-in module whose ``extend_kv_cache`` has the
  release's parameters (:func:`release_loader.function_stubs`; calling it raises): a member of 0.34's runner group,
  so the overlay must see it; the rebind is not exercised here.

:data:`STANDINS` is the written list per layer, the two interpreter fixes (harness, not vLLM) included.
"""

from __future__ import annotations

import pathlib
import sys
import types
from typing import Any

import gdn_standins
import torch
import upstream_standins
from ascend_standins import REAL as REAL_STDLIB
from ascend_standins import triton_utils
from batch_plan import HEAD_DIM, HEADS, run_forward_core_batches
from release_loader import function_stubs
from upstream_standins import set_conv_layout  # noqa: F401  (the 0.34 child sets it per case)

_OPS = "vllm.model_executor.layers.mamba.ops"
GATHER_MODULE = f"{_OPS}.gather_initial_states"
SCATTER_MODULE = f"{_OPS}.scatter_states"
KDA_CONV_MODULE = "vllm.models.kimi_k3.nvidia.ops.kda_conv"
RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
RUNNER_FILE = "vllm/v1/worker/gpu/model_runner.py"
EXTENSIBLE_MODULE = "vllm.v1.worker.extensible_kv_cache"  # extend_kv_cache: a member of 0.34's runner group
EXTENSIBLE_FILE = "vllm/v1/worker/extensible_kv_cache.py"
FLASHKDA_MODULE = "vllm._flashkda_C"  # Kimi K3's FlashKDA extension (0.34's SM90+ prefill default)
BREAKABLE_MODULE = "vllm.compilation.breakable_cudagraph"  # eager_break_during_capture on Kimi K3 / Kimi Linear
BREAK_REPLAYS = 2  # a ":breakable" case captures each layer call once, then replays it this many times
# layer kind -> (module, class, seam method)
LAYERS = {"qwen": (gdn_standins.QWEN_MODULE, "QwenGatedDeltaNetAttention", "_forward_core"),
          "olmo": (gdn_standins.OLMO_MODULE, "OlmoHybridGatedDeltaNetAttention", "_forward_core"),
          "linear": (*upstream_standins.LAYERS["linear"][:2], "_forward"),
          "k3": (*upstream_standins.LAYERS["k3"][:2], "_forward")}
SUFFIX = {"qwen": "linear_attn", "olmo": "linear_attn", "linear": "self_attn", "k3": "self_attn"}
SECTION = {"qwen": "gdn_state_copy", "olmo": "gdn_state_copy", "linear": "gdn_state_copy", "k3": "kimi_prefill"}
KERNELS = ((GATHER_MODULE, "_gather_initial_states_kernel"), (SCATTER_MODULE, "_scatter_states_kernel"))
# ':indexed' cases: vLLM's vendored FLA chunk rule executed from the release (its Triton kernels by the interpreter,
# with fla_interpreter's fixes), the Qwen layer's chunk call reaching it, so KDA_PATCHES_STATE_IO=indexed has the
# release's own chunk-state kernel to derive its twin from
FLA_OPS = "vllm.third_party.flash_linear_attention.ops"
FLA_MODULES = tuple(f"{FLA_OPS}.{stem}" for stem in (
    "chunk", "chunk_delta_h", "chunk_o", "chunk_scaled_dot_kkt", "cumsum", "index", "l2norm", "op", "solve_tril",
    "utils", "wy_fast"))
# and for Kimi Linear / Kimi K3 ':indexed' cases, the release's own KDA chunk rule (chunk_kda_with_fused_gate, whose
# chunk-state step is FLA's chunk_gated_delta_rule_fwd_h with per-key gates)
KDA_OPS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
KDA_MODULES = (KDA_OPS, *(f"{KDA_OPS}.{stem}" for stem in (
    "chunk", "chunk_intra", "chunk_intra_token_parallel", "fused_recurrent")))
RELEASE_MODULES = (*(module for module, _, _ in LAYERS.values()), GATHER_MODULE, SCATTER_MODULE,
                   "vllm.model_executor.warmup.jit_warmup", "vllm.model_executor.warmup.jit_warmup_triton_helper",
                   KDA_CONV_MODULE, BREAKABLE_MODULE)
DEVICE_GUARD = "state.is_cuda or state.is_xpu"
LIFTED = {GATHER_MODULE: (DEVICE_GUARD,), SCATTER_MODULE: (DEVICE_GUARD,)}
# the warmup modules import more of the standard library than the layer files: all of it is real
REAL = ("vllm", "transformers", *REAL_STDLIB, *sorted(sys.stdlib_module_names - set(REAL_STDLIB)))
# 0.34's GDN metadata field that 0.32's class lacks: None = no FlashInfer checkpoint plan (as for 0.33)
GDN_EXTRA_FIELDS = {"flashinfer_checkpoint_plan": None}

_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
_COMMON = {
    _RUNNER: "stand-in V2 runner: 0.34's initialize_kv_cache signature (+ extensible), binds poisoned pages",
    "vllm.triton_utils.{triton,tl,HAS_TRITON} (release files)": "the real triton (vLLM's CPU build disables it)",
    f"{EXTENSIBLE_MODULE}.extend_kv_cache": "stub with the release's parameters in a stand-in module (0.32 has no "
    "such module): a member of 0.34's runner group the overlay wraps, never called here (the extensible KV cache's "
    "rebind is not exercised; executing the file would import vLLM's KV-transfer stack, ~3 s per process)",
}
_GATHER = {
    f"{GATHER_MODULE} (release, not stood in)": "upstream's gather_initial_states, Triton interpreter; "
    f"`assert {DEVICE_GUARD}` lifted; launch_pdl False on the CPU platform (PDL branch not taken)",
    "triton.runtime.interpreter masked load/store (harness fix, not vLLM)": "an integer mask is read as mask != 0 "
    "(Triton 3.9's interpreter mistypes gather_initial_states' `mask & flag.to(tl.int1)` as int8)",
}
_SCATTER = {
    f"{SCATTER_MODULE} (release, not stood in)": "upstream's scatter_states through 0.34's warmup dispatcher "
    f"(released jit_warmup{{,_triton_helper}}), Triton interpreter; `assert {DEVICE_GUARD}` lifted; launch_pdl False",
    "triton.runtime.interpreter FP32->BF16 create_fp_trunc (harness fix, not vLLM)": "rounds to nearest even as "
    "compiled Triton does (the interpreter truncates): scatter_states' store of FP32 finals into a BF16 cache",
}
_BREAKABLE = {
    f"{BREAKABLE_MODULE} (release, not stood in)": "0.34's eager_break_during_capture on the Kimi layers' _forward "
    "(always a wrapper in 0.34) and BreakableCUDAGraphCapture, which ':breakable' cases capture and replay under",
    "torch.cuda.CUDAGraph (breakable cases)": "capture_begin / capture_end / replay do nothing: the CPU records no "
    "graph, so a replay runs the eager breaks (the layer calls) and nothing else",
    f"{BREAKABLE_MODULE}.weak_ref_tensor(s)": "the tensor itself (vLLM's is a CUDA op; on the CPU the replay closure "
    "holds the same storage either way)",
}
_GDN_METADATA = {"GDNAttentionMetadata.flashinfer_checkpoint_plan (0.34 field)": "None on 0.32's metadata (no "
                 "FlashInfer checkpoint plan)"}
_KIMI = {name: what for name, what in upstream_standins.STANDINS.items()
         if not name.startswith(("vllm.v1.worker", GATHER_MODULE))}
# layer kind -> what was stood in (printed per executed layer; the harness fixes of the interpreter included)
STANDINS = {
    "qwen": {**{name: what for name, what in gdn_standins.STANDINS.items()
                if not name.startswith(("vllm.v1.worker", "GDNAttentionMetadata"))}, **_GDN_METADATA,
             "QwenGatedDeltaNetAttention.gdn_prefill_backend (layer attribute)": "'triton' (the chunk path), or "
             "'flashinfer' in ':flashinfer' cases (the released _forward_flashinfer_prefill and "
             "fi_chunk_gated_delta_rule run)",
             "flashinfer.gdn_prefill.chunk_gated_delta_rule (':flashinfer' cases)": "fla-core "
             "naive_recurrent_gated_delta_rule per sequence on log(g) (FlashInfer takes exp(g)); output written into "
             "the given buffer",
             "QwenGatedDeltaNetAttention.chunk_gated_delta_rule (':indexed' cases)": "the release's FLA "
             "chunk_gated_delta_rule (executed; its Triton kernels by the interpreter with fla_interpreter's fixes: "
             "int32 loop indices, exp/exp2 looked up at run time, one autotune config)",
             "vllm._aiter_ops.rocm_aiter_ops (Qwen file)": "are_gdn_triton_kernels_available / "
             "are_rdna_gdn_triton_kernels_available -> False (not ROCm), nothing else",
             **_GATHER, **_SCATTER, **_COMMON},
    "linear": {**_KIMI, **_GATHER, **_SCATTER, **_COMMON, **_BREAKABLE},
    "k3": {**_KIMI, **_GATHER, **_COMMON, **_BREAKABLE,
           "torch.ops._flashkda_C.fwd (':flashkda' cases)": "FlashKDA's kernel: the same naive KDA recurrence as the "
           "chunk_kda_with_fused_gate stand-in (lower-bound gate from A_log and dt_bias, sigmoid beta, L2-normalized "
           "q/k), writing out and final_state; the released _flashkda_prefill and the FlashKDA branch of _forward run",
           f"{FLASHKDA_MODULE} (':flashkda' cases)": "an empty module (importing the extension registers its ops)",
           "vllm.v1.worker.workspace.current_workspace_manager": "hands out fresh zeroed CPU buffers per (shape, "
           "dtype) (vLLM's manager calls torch.accelerator, absent on the CPU); the FlashKDA branch takes its buffers "
           "from it",
           f"{KDA_CONV_MODULE} (release, not stood in)": "packed_causal_conv1d_supported declines CPU tensors: "
           "the stock per-part convolution (vLLM's CPU kernel) runs"},
    "olmo": {**{name: what for name, what in gdn_standins.STANDINS_OLMO.items() if not name.startswith("vllm.v1")},
             **_GDN_METADATA, **_COMMON},
}


class RocmAiterOps:
    """Stand-in of ``vllm._aiter_ops.rocm_aiter_ops`` for 0.34's Qwen file: the two ROCm capability queries it asks
    at import answer no (this is no ROCm device; 0.32's class lacks ``are_rdna_gdn_triton_kernels_available``)."""

    @staticmethod
    def are_gdn_triton_kernels_available() -> bool:
        return False

    @staticmethod
    def are_rdna_gdn_triton_kernels_available() -> bool:
        return False


def interpreter_rounds_bf16_downcasts() -> None:
    """Make the Triton interpreter's implicit FP32 -> BF16 conversion round to nearest even, as compiled Triton does.

    ``scatter_states`` stores FP32 final states into a BF16 cache: ``tl.store`` converts through ``create_fp_trunc``
    (``arith.truncf``, round to nearest even: ``triton.language.semantic.cast`` says so, and NVIDIA lowers it to
    ``cvt.rn.bf16.f32``; the H200 measurement of issue 27 found upstream's scatter bit-identical to the plan's).
    Triton 3.9's interpreter truncates there instead (``cast_impl`` with no rounding mode), which would make
    upstream's own op differ from torch's ``.to()`` -- an interpreter artifact, not vLLM's behaviour. Only that one
    conversion of the interpreter is replaced, by torch's (round to nearest even; NaN patterns are not modelled:
    no NaN reaches a scatter here); the kernels are vLLM's, unchanged.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_kda_bf16_rtne", False):
        return
    truncate = builder.create_fp_trunc

    def create_fp_trunc(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interpreter.TensorHandle(values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                            tl.bfloat16)
        return truncate(self, src, dst_type)

    builder.create_fp_trunc = create_fp_trunc
    builder._kda_bf16_rtne = True


def extensible_module(root: pathlib.Path) -> types.ModuleType:
    """Return the stand-in ``vllm.v1.worker.extensible_kv_cache``: ``extend_kv_cache`` with the release's parameters."""
    module = types.ModuleType(EXTENSIBLE_MODULE)
    for name, stub in function_stubs(root / EXTENSIBLE_FILE, ("extend_kv_cache",)).items():
        stub.__module__ = EXTENSIBLE_MODULE
        setattr(module, name, stub)
    return module


def standin_modules() -> dict[str, dict[str, Any]]:
    """Return the stand-in import table of 0.34's executed files (module -> {name: object})."""
    return {"vllm.triton_utils": triton_utils(), "vllm._aiter_ops": {"rocm_aiter_ops": RocmAiterOps},
            FLASHKDA_MODULE: {"": types.ModuleType(FLASHKDA_MODULE)},
            "vllm.v1.worker.workspace": {"current_workspace_manager": lambda: CPUWorkspace(),
                                         "is_workspace_manager_initialized": lambda: True},
            "flashinfer.gdn_prefill": {"chunk_gated_delta_rule": gdn_standins.flashinfer_chunk_gated_delta_rule}}


def install() -> None:
    """Put the device-kernel stand-ins at the module-level names the layer files import (before importing them)."""
    gdn_standins.install_upstream()
    upstream_standins.install(gather=False)  # 0.34's own gather_initial_states is executed


def released_chunk_rule(chunk_module: Any) -> Any:
    """The Qwen layer's ``chunk_gated_delta_rule`` attribute for ':indexed' cases: the release's FLA
    ``chunk_gated_delta_rule`` itself (the CustomOp's Triton branch minus its ROCm-only ``aiter_prefill_metadata``)."""
    rule = chunk_module.chunk_gated_delta_rule

    def chunk_gated_delta_rule(*args: Any, aiter_prefill_metadata: Any = None, **kwargs: Any) -> Any:
        return rule(*args, **kwargs)

    return chunk_gated_delta_rule


def install_layer_standins(modules: dict[str, Any]) -> None:
    """Stand-ins set on imported layer modules (Olmo's Triton gating, as for 0.33)."""
    modules["olmo"].fused_olmo_hybrid_gdn_gating = gdn_standins.fused_olmo_hybrid_gdn_gating


class CPUGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` under the released breakable capture: nothing to record on the CPU."""

    def capture_begin(self, pool: Any = None) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def replay(self) -> None:
        pass


class CPUWorkspace:
    """Stand-in of vLLM's workspace manager: ``get_simultaneous(*(shape, dtype))`` -> fresh zeroed CPU tensors."""

    def get_simultaneous(self, *shapes_and_dtypes: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes_and_dtypes]


def register_flashkda_op() -> None:
    """Define ``torch.ops._flashkda_C.fwd`` on the CPU: FlashKDA's kernel, stood in by the naive KDA recurrence the
    ``chunk_kda_with_fused_gate`` stand-in computes (the rest of the FlashKDA branch is the release's)."""
    if hasattr(torch.ops._flashkda_C, "fwd"):
        return
    library = torch.library.Library("_flashkda_C", "DEF")
    library.define("fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) out, "
                   "Tensor workspace, Tensor A_log, Tensor dt_bias, float lower_bound, Tensor initial_state, "
                   "Tensor(b!) final_state, Tensor cu_seqlens, Tensor? checkpoint_state, "
                   "Tensor? checkpoint_offsets) -> ()")

    def fwd(q, k, v, g, beta, scale, out, workspace, A_log, dt_bias, lower_bound, initial_state, final_state,
            cu_seqlens, checkpoint_state, checkpoint_offsets):
        assert checkpoint_state is None, "FlashKDA checkpoints are not exercised here"
        _, final = upstream_standins.chunk_kda_with_fused_gate(
            q, k, v, g, beta, A_log, dt_bias.reshape(-1), scale=scale, initial_state=initial_state,
            output_final_state=True, lower_bound=lower_bound, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
            out=out)
        final_state[: final.shape[0]].copy_(final.to(final_state.dtype))

    library.impl("fwd", fwd, "CPU")
    register_flashkda_op.library = library  # keep the registration alive


def flashkda_buffer_specs(layer: torch.nn.Module, state_dtype: torch.dtype) -> tuple:
    """The ``_flashkda_buffer_specs`` the layer's ``__init__`` would set (not run): output, final and checkpoint
    states, FlashKDA's workspace -- sized for the batch plan."""
    from batch_plan import BATCHES, MAX_NUM_SEQS

    tokens = max(sum(batch[2]) for batch in BATCHES)
    heads, dim = HEADS, HEAD_DIM
    return (((1, tokens, heads, dim), torch.bfloat16), ((MAX_NUM_SEQS, heads, dim, dim), state_dtype),
            ((MAX_NUM_SEQS, heads, dim, dim), state_dtype), ((1 << 12,), torch.uint8))


def install_breakable_standins(breakable: Any) -> None:
    """Stand in the CUDA-graph calls of the released ``breakable_cudagraph`` (and nothing else of it)."""
    torch.cuda.CUDAGraph = CPUGraph
    breakable.weak_ref_tensor = lambda tensor: tensor
    breakable.weak_ref_tensors = lambda tensors: tensors


def capture_and_replay(breakable: Any) -> Any:
    """Return ``invoke(call)``: capture ``call`` under the released ``BreakableCUDAGraphCapture`` (its eager run is
    the capture-time call), then replay the capture :data:`BREAK_REPLAYS` times, as vLLM replays a batch."""

    def invoke(call: Any) -> None:
        with breakable.BreakableCUDAGraphCapture() as capture:
            call()
        assert capture.num_eager_breaks == 1, f"the layer call was not an eager break: {capture!r}"
        for _ in range(BREAK_REPLAYS):
            capture.replay()

    return invoke


def build_layer(kind: str, cls: type, name: str, generator: torch.Generator, backend: str = "triton",
                state_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Return the release's layer class built as for 0.33 (only what the seam reads is set); ``backend`` is the
    layer's prefill backend: a GDN layer's ``gdn_prefill_backend`` (``triton`` or ``flashinfer``), Kimi K3's
    ``kda_prefill_backend`` (``triton`` or ``flashkda``, with the buffer specs its ``__init__`` would set)."""
    if kind in ("qwen", "olmo"):
        from upstream_gdn_layers import build_layer as build_gdn

        layer = build_gdn(cls, name, generator)
        object.__setattr__(layer, "gdn_prefill_backend", backend)
        return layer
    from upstream_kimi_layers import build_layer as build_kimi

    layer = build_kimi(cls, name, generator)
    if backend == "flashkda":
        object.__setattr__(layer, "kda_prefill_backend", "flashkda")
        object.__setattr__(layer, "_flashkda_buffer_specs", flashkda_buffer_specs(layer, state_dtype))
        object.__setattr__(layer, "_checkpoint_exporter", None)
    return layer


def run_batches(kind: str, layers: dict, raw_caches: dict, generator: torch.Generator, invoke: Any = None
                ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Run the shared batch plan through the layers' seam (``_forward_core`` / ``_forward``); ``invoke`` (Kimi
    layers only) runs each layer call, e.g. :func:`capture_and_replay`."""
    if kind in ("qwen", "olmo"):
        from upstream_gdn_layers import metadata_of

        return run_forward_core_batches(layers, raw_caches, lambda batch: metadata_of(batch, GDN_EXTRA_FIELDS),
                                        generator)
    from upstream_kimi_layers import run_forward_batches

    return run_forward_batches(layers, raw_caches, generator, invoke)
