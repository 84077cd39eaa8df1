"""Stand-ins for the CUDA-only calls of upstream vLLM's Kimi K3 layer (``vllm.models.kimi_k3.nvidia.kda``).

Installed at the module-level names the layer module reads, *before* it is imported, so its own
``from ... import`` binds them and the overlay wraps what the layer really calls:

- ``gather_initial_states`` (its module asserts ``state.is_cuda or state.is_xpu``; vLLM's CPU build has no
  Triton): the kernel's semantics in torch -- rows with a false flag read nothing and come back zero;
- ``chunk_kda_with_fused_gate`` / ``fused_recurrent_kda_packed_decode`` (FLA Triton kernels): fla-core's
  ``naive_recurrent_kda`` per sequence / per token, gate ``lower_bound * sigmoid(exp(A_log) * (g + bias))``,
  ``beta = sigmoid(raw_beta)``, q/k L2-normalized, state ``[H, V, K]``;
- the layer's ``o_norm`` (``FusedRMSNormGated``, a Triton kernel) by a torch gated RMS norm.

The causal convolution is vLLM's own CPU implementation (``causal_conv1d_fn_cpu`` /
``causal_conv1d_update_cpu``, what the CPU build binds), not stood in. :data:`STANDINS` is the written list.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
from ascend_standins import l2norm_fwd, spans_of, token_gate

GATHER_MODULE = "vllm.model_executor.layers.mamba.ops.gather_initial_states"
KDA_OPS_MODULE = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
LAYER_MODULE = "vllm.models.kimi_k3.nvidia.kda"
# layer kind -> (module, class, the overlay's ledger section): Kimi K3 KDA and Kimi Linear GDN share the kernels
LAYERS = {"k3": (LAYER_MODULE, "KimiK3DeltaAttention", "kimi_prefill"),
          "linear": ("vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn", "KimiGatedDeltaNetAttention",
                     "gdn_state_copy")}
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"

STANDINS = {
    f"{GATHER_MODULE}.gather_initial_states": "torch: state[where(flag, idx, 0)], rows with a false flag zeroed",
    f"{KDA_OPS_MODULE}.chunk_kda_with_fused_gate": "fla-core naive_recurrent_kda per sequence (lower-bound gate, "
    "sigmoid beta, L2-normalized q/k, [H,V,K] state)",
    f"{KDA_OPS_MODULE}.fused_recurrent_kda_packed_decode": "fla-core naive_recurrent_kda, one token per row, "
    "state updated in place",
    "<layer>.o_norm (layer attribute)": "torch gated RMS norm x*rsqrt(mean(x^2)+eps)*w*sigmoid(g)",
    "<layer>.__init__ (not run)": "layer built with object.__new__ + the attributes _forward reads",
    f"{RUNNER_MODULE}.GPUModelRunner": "stand-in runner: the installed initialize_kv_cache signature, binds "
    "poisoned pages (the real body needs the whole engine)",
}


def gather_initial_states(state: torch.Tensor, indices: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """Torch form of vLLM's ``_gather_initial_states_kernel`` (a flagged-off row never reads its index)."""
    keep = has_initial_state.to(torch.bool)
    rows = torch.where(keep, indices.long(), torch.zeros_like(indices, dtype=torch.long))
    packed = state[rows].clone()
    packed[~keep] = 0
    return packed


def _kda_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
              A_log: torch.Tensor, bias: Any, lower_bound: Any, states_vk: torch.Tensor, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence ``[1, L, H, D]`` through fla-core's naive recurrence; returns ``(o, final [H, V, K])``."""
    from fla.ops.kda.naive import naive_recurrent_kda

    gate = token_gate(raw_g[0], A_log, bias, lower_bound is not None, -5.0 if lower_bound is None else lower_bound)
    out, final = naive_recurrent_kda(l2norm_fwd(q), l2norm_fwd(k), v, gate[None], raw_beta.float().sigmoid(),
                                     scale=scale, initial_state=states_vk.float().transpose(-1, -2)[None],
                                     output_final_state=True)
    return out, final[0].transpose(-1, -2)


def chunk_kda_with_fused_gate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
                              raw_beta: torch.Tensor, A_log: torch.Tensor, g_bias: Any, scale: float | None = None,
                              initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                              lower_bound: float | None = None, use_qk_l2norm_in_kernel: bool = False,
                              cu_seqlens: torch.Tensor | None = None, out: torch.Tensor | None = None, **unused: Any
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in of FLA's ``chunk_kda_with_fused_gate``: ``(o [1, T, H, V], final [S, H, V, K] FP32)``."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    outs, finals = [], []
    for row, (start, end) in enumerate(spans_of(cu_seqlens)):
        o, final = _kda_rows(q[:, start:end], k[:, start:end], v[:, start:end], raw_g[:, start:end],
                             raw_beta[:, start:end], A_log, g_bias, lower_bound, initial_state[row], scale)
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, dim=1).to(v.dtype)
    if out is not None:
        out.copy_(o)
        o = out
    return o, torch.stack(finals)


def fused_recurrent_kda_packed_decode(mixed_qkv: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
                                      A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                                      initial_state: torch.Tensor, state_indices: torch.Tensor,
                                      scale: float | None = None, out: torch.Tensor | None = None
                                      ) -> tuple[torch.Tensor, None]:
    """Stand-in of FLA's packed one-token decode: updates ``initial_state[state_indices[i]]`` in place."""
    heads, head_dim = raw_g.shape[-2:]
    tokens = mixed_qkv.shape[0]
    q, k, v = (part.reshape(1, tokens, heads, head_dim) for part in mixed_qkv.split(heads * head_dim, dim=-1))
    scale = head_dim ** -0.5 if scale is None else scale
    outs = []
    for i in range(tokens):
        row = int(state_indices[i])
        o, final = _kda_rows(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], raw_g[:, i:i + 1], raw_beta[:, i:i + 1],
                             A_log, dt_bias, lower_bound, initial_state[row], scale)
        initial_state[row] = final.to(initial_state.dtype)
        outs.append(o)
    o = torch.cat(outs, dim=1).to(v.dtype)
    if out is not None:
        out.copy_(o)
        o = out
    return o, None


class GatedRMSNorm:
    """Torch stand-in of ``FusedRMSNormGated``: ``x * rsqrt(mean(x^2) + eps) * weight * sigmoid(g)``."""

    def __init__(self, weight: torch.Tensor, eps: float = 1e-5) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return (y * g.reshape(x.shape).float().sigmoid()).to(x.dtype)


def install(gather: bool = True) -> None:
    """Put the stand-ins at their module-level names (before the layer module is imported).

    Args:
        gather: also stand in ``gather_initial_states`` (False where the release's own op file is executed).
    """
    if gather:
        importlib.import_module(GATHER_MODULE).gather_initial_states = gather_initial_states
    ops = importlib.import_module(KDA_OPS_MODULE)
    ops.chunk_kda_with_fused_gate = chunk_kda_with_fused_gate
    ops.fused_recurrent_kda_packed_decode = fused_recurrent_kda_packed_decode


def set_conv_layout(layout: str) -> None:
    """Make ``layout`` (``SD`` / ``DS``) vLLM's conv-state layout from now on (its cached answer cleared).

    vLLM reads ``VLLM_SSM_CONV_STATE_LAYOUT`` once per process (``get_conv_state_layout`` is cached); a batch
    child sets it per case, so cases of both layouts share a process.
    """
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = layout
    importlib.import_module("vllm.model_executor.layers.mamba.mamba_utils").get_conv_state_layout.cache_clear()
