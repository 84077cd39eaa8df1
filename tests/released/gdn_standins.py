"""Stand-ins for the device-only GDN kernels the released Qwen3-Next / vllm-ascend GDN layers call.

The gated delta rule itself comes from fla-core's naive reference (``naive_recurrent_gated_delta_rule``,
state ``[H, K, V]``; the caches hold ``[H, V, K]``, so states are transposed at the stand-in's boundary),
gates ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, q/k L2-normalized -- the
formulas the fused Triton / AscendC kernels implement. Used for vLLM 0.32's
``QwenGatedDeltaNetAttention._forward_core`` (installed; its CPU causal convolution is vLLM's own) and for
vllm-ascend's ``AscendGatedDeltaNetAttention._forward_core`` (released source).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from ascend_standins import l2norm_fwd, spans_of

FLA_OPS_MODULE = "vllm.third_party.flash_linear_attention.ops"
QWEN_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"

STANDINS = {
    f"{FLA_OPS_MODULE}.fused_post_conv_prep": "torch split + L2 norm + g=-exp(A_log)*softplus(a+dt_bias), "
    "beta=sigmoid(b)",
    f"{FLA_OPS_MODULE}.fused_sigmoid_gating_delta_rule_update": "fla-core naive_recurrent_gated_delta_rule per "
    "sequence, cache rows updated in place",
    "QwenGatedDeltaNetAttention.chunk_gated_delta_rule (layer attribute)": "fla-core "
    "naive_recurrent_gated_delta_rule per sequence ([H,V,K] cache layout)",
    "QwenGatedDeltaNetAttention.__init__ (not run)": "layer built with object.__new__ + the attributes "
    "_forward_core reads",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner": "stand-in runner: the installed initialize_kv_cache "
    "signature, binds poisoned pages",
    "GDNAttentionMetadata.flashinfer_checkpoint_plan (0.33 file only)": "None on 0.32's metadata (no FlashInfer "
    "checkpoint plan)",
}


def gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(g, beta)`` in FP32: ``-exp(A_log) * softplus(a + dt_bias)`` and ``sigmoid(b)``."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state_vk: torch.Tensor, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence (``[1, L, H, D]``) through fla-core's naive rule; returns ``(o, final [H, V, K] FP32)``."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    if normalize:
        q, k = l2norm_fwd(q), l2norm_fwd(k)
    initial = state_vk.float().transpose(-1, -2)[None]
    out, final = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=initial, output_final_state=True)
    return out, final[0].transpose(-1, -2)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor, output_final_state: bool = True, cu_seqlens: Any = None,
                           use_qk_l2norm_in_kernel: bool = False, **unused: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in of the chunked GDN prefill: ``(o [1, T, H, V] in v's dtype, final [S, H, V, K] FP32)``."""
    outs, finals = [], []
    for row, (start, end) in enumerate(spans_of(cu_seqlens)):
        o, final = delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                              beta[:, start:end], initial_state[row], use_qk_l2norm_in_kernel)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs, dim=1).to(v.dtype), torch.stack(finals)


def flashinfer_chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, initial_state: torch.Tensor, output_final_state: bool,
                                      cu_seqlens: Any = None, output: torch.Tensor | None = None, **unused: Any
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in of FlashInfer's ``flashinfer.gdn_prefill.chunk_gated_delta_rule`` (the device kernel vLLM 0.34's
    ``fi_chunk_gated_delta_rule`` calls): ``[T, H, D]`` inputs, ``g`` already exponentiated (its log goes to the
    naive rule), the output written into ``output`` when given; ``(o [T, H, V], final [S, H, V, K] FP32)``."""
    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g.log()[None], beta[None], initial_state,
                                      cu_seqlens=cu_seqlens)
    if output is not None:
        output.copy_(o[0])
        return output, final
    return o[0], final


def fused_post_conv_prep(conv_output: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                         dt_bias: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                         apply_l2norm: bool = True, output_g_exp: bool = False) -> tuple[torch.Tensor, ...]:
    """Stand-in of vLLM's fused post-conv prep: ``(q, k [L, H, K], v [L, HV, V], g, beta [L, HV] FP32)``."""
    tokens = conv_output.shape[0]
    key = num_k_heads * head_k_dim
    q, k, v = conv_output.split([key, key, conv_output.shape[1] - 2 * key], dim=-1)
    q, k = (x.reshape(tokens, num_k_heads, head_k_dim) for x in (q, k))
    if apply_l2norm:
        q, k = l2norm_fwd(q), l2norm_fwd(k)
    g, beta = gating(a, b, A_log, dt_bias)
    return q.contiguous(), k.contiguous(), v.reshape(tokens, -1, head_v_dim).contiguous(), \
        g.exp() if output_g_exp else g, beta


def fused_sigmoid_gating_delta_rule_update(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                           dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                           initial_state: torch.Tensor, inplace_final_state: bool = True,
                                           cu_seqlens: Any = None, ssm_state_indices: Any = None,
                                           use_qk_l2norm_in_kernel: bool = False, **unused: Any
                                           ) -> tuple[torch.Tensor, None]:
    """Stand-in of vLLM's fused decode update: each sequence's cache row updated in place."""
    g, beta = gating(a, b, A_log, dt_bias)
    outs = []
    for row, (start, end) in enumerate(spans_of(cu_seqlens)):
        index = int(ssm_state_indices[row])
        o, final = delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[None, start:end],
                              beta[None, start:end], initial_state[index], use_qk_l2norm_in_kernel)
        initial_state[index] = final.to(initial_state.dtype)
        outs.append(o)
    return torch.cat(outs, dim=1).to(v.dtype), None


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, initial_state: torch.Tensor, inplace_final_state: bool = True,
                                     cu_seqlens: Any = None, ssm_state_indices: Any = None,
                                     use_qk_l2norm_in_kernel: bool = False, **unused: Any) -> tuple[torch.Tensor, None]:
    """Stand-in of vLLM's fused recurrent GDN decode (gates given): cache rows updated in place."""
    outs = []
    for row, (start, end) in enumerate(spans_of(cu_seqlens)):
        index = int(ssm_state_indices[row])
        o, final = delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                              beta[:, start:end], initial_state[index], use_qk_l2norm_in_kernel)
        initial_state[index] = final.to(initial_state.dtype)
        outs.append(o)
    return torch.cat(outs, dim=1).to(v.dtype), None


def fused_olmo_hybrid_gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                                 allow_neg_eigval: bool = False, **unused: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in of Olmo hybrid's Triton gating: ``(g, beta)`` ``[1, T, HV]`` FP32, beta doubled when negative
    eigenvalues are allowed."""
    g, beta = gating(a, b, A_log, dt_bias)
    return g.unsqueeze(0), (beta * 2.0 if allow_neg_eigval else beta).unsqueeze(0)


OLMO_MODULE = "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn"
STANDINS_OLMO = {
    f"{FLA_OPS_MODULE}.chunk_gated_delta_rule": "fla-core naive_recurrent_gated_delta_rule per sequence",
    f"{FLA_OPS_MODULE}.fused_recurrent_gated_delta_rule": "fla-core naive rule, cache rows updated in place",
    f"{OLMO_MODULE}.fused_olmo_hybrid_gdn_gating": "torch -exp(A_log)*softplus(a+dt_bias), sigmoid(b) (x2 when "
    "allow_neg_eigval); set on the module after import (vLLM's CPU build disables its Triton kernel)",
    "OlmoHybridGatedDeltaNetAttention.__init__ (not run)": "layer built with object.__new__ + the attributes "
    "_forward_core reads",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner": STANDINS["vllm.v1.worker.gpu_model_runner.GPUModelRunner"],
}


# layer kind -> (module, class, stand-in list)
LAYERS = {"qwen": (QWEN_MODULE, "QwenGatedDeltaNetAttention", STANDINS),
          "olmo": (OLMO_MODULE, "OlmoHybridGatedDeltaNetAttention", STANDINS_OLMO)}


def install_upstream() -> None:
    """Put the stand-ins at the names vLLM's Qwen / Olmo GDN modules import (before they are imported)."""
    ops = importlib.import_module(FLA_OPS_MODULE)
    ops.fused_post_conv_prep = fused_post_conv_prep
    ops.fused_sigmoid_gating_delta_rule_update = fused_sigmoid_gating_delta_rule_update
    ops.chunk_gated_delta_rule = chunk_gated_delta_rule
    ops.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
