"""Stand-ins for the NPU-only calls of vllm-ascend's released ``AscendGatedDeltaNetAttention._forward_core``.

AscendC / CANN kernels by torch equivalents on fla-core's naive gated delta rule (:mod:`gdn_standins`):
``torch.ops._C_ascend.npu_causal_conv1d_custom`` (SD conv state ``[N, W-1, D]``, the layout the fork's
kernel takes), ``torch.ops._C_ascend.npu_recurrent_gated_delta_rule`` (decode, rows updated in place),
``torch_npu.npu_chunk_gated_delta_rule`` (the fused prefill, present only for the "fused" variant; its
probe then succeeds), ``DeviceOperator.fused_gdn_gating``, vllm-ascend's Triton ``chunk_gated_delta_rule``
(``[H, K, V]`` states, the fork transposes around it); the KV-connector hooks by no-ops; vLLM's base class
``GatedDeltaNetAttention`` by a class with only ``rearrange_mixed_qkv``. ``get_forward_context`` is vLLM's
real one (installed 0.32). The fork's own ``clear_ssm_states`` (Triton, interpreter) is executed.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from ascend_standins import make_torch_npu, spans_of, standin_modules
from gdn_standins import delta_rule, gating

GDN_MODULE = "vllm_ascend.ops.gdn"
# vLLM's real forward context: the overlay's prefill gate reads the same one the fork's code reads.
REAL_MODULES = ("vllm.forward_context",)


class GDNAttentionMetadata(types.SimpleNamespace):
    """Stand-in of the metadata class ``_forward_core`` asserts (fields as the Ascend builder fills them)."""


class GatedDeltaNetAttention(torch.nn.Module):
    """Stand-in of vLLM's base layer: only ``rearrange_mixed_qkv`` (split packed q|k|v into ``[1, T, H, D]``)."""

    def rearrange_mixed_qkv(self, mixed_qkv: torch.Tensor | None) -> tuple[Any, Any, Any]:
        if mixed_qkv is None:
            return None, None, None
        key, value = self.key_dim // self.tp_size, self.value_dim // self.tp_size
        q, k, v = torch.split(mixed_qkv, [key, key, value], dim=-1)
        tokens = mixed_qkv.shape[0]
        return (q.reshape(1, tokens, -1, self.head_k_dim).contiguous(),
                k.reshape(1, tokens, -1, self.head_k_dim).contiguous(),
                v.reshape(1, tokens, -1, self.head_v_dim).contiguous())


def npu_causal_conv1d_custom(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                             bias_opt: Any = None, query_start_loc_opt: Any = None, cache_indices_opt: Any = None,
                             initial_state_mode_opt: Any = None, num_accepted_tokens_opt: Any = None,
                             activation_mode: int = 1, pad_slot_id: int = -1, run_mode: int = 0) -> None:
    """Causal depthwise convolution over packed sequences; ``weight [W, D]``, conv state ``[N, W-1, D]`` (SD)."""
    state_len = weight.shape[0] - 1
    for seq, (start, end) in enumerate(spans_of(query_start_loc_opt)):
        row = int(cache_indices_opt[seq])
        if row == pad_slot_id:
            continue
        has_state = run_mode == 1 or (initial_state_mode_opt is not None and bool(initial_state_mode_opt[seq]))
        initial = conv_state[row, :state_len].float() if has_state else x.new_zeros(state_len, x.shape[1]).float()
        full = torch.cat([initial, x[start:end].float()])
        length = end - start
        y = sum(full[w:w + length] * weight[w].float() for w in range(state_len + 1))
        if bias_opt is not None:
            y = y + bias_opt.float()
        out[start:end] = (F.silu(y) if activation_mode else y).to(out.dtype)
        conv_state[row, :state_len] = full[-state_len:].to(conv_state.dtype)


def npu_recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, state: torch.Tensor, scale: float, actual_seq_lengths: Any,
                                   ssm_state_indices: torch.Tensor, num_accepted_tokens: Any = None) -> torch.Tensor:
    """Decode: sequences of ``actual_seq_lengths`` tokens; state rows ``[HV, V, K]`` updated in place."""
    outs, start = [], 0
    for seq, length in enumerate(int(n) for n in actual_seq_lengths):
        row = int(ssm_state_indices[seq])
        part = slice(start, start + length)
        o, final = delta_rule(query[None, part], key[None, part], value[None, part], g[None, part],
                              beta[None, part], state[row], normalize=False)
        state[row] = final.to(state.dtype)
        outs.append(o[0])
        start += length
    return torch.cat(outs).to(value.dtype)


def npu_chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                               initial_state: torch.Tensor, actual_seq_lengths: torch.Tensor, scale: float,
                               g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused CANN prefill (TND layout, ``[N, HV, V, K]`` states): ``(o [T, HV, V], final)``."""
    outs, finals, start = [], [], 0
    for seq, length in enumerate(int(n) for n in actual_seq_lengths):
        part = slice(start, start + length)
        o, final = delta_rule(q[None, part], k[None, part], v[None, part], g[None, part], beta[None, part],
                              initial_state[seq], normalize=False)
        outs.append(o[0])
        finals.append(final)
        start += length
    return torch.cat(outs).to(v.dtype), torch.stack(finals).to(initial_state.dtype)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor, output_final_state: bool = True, cu_seqlens: Any = None,
                           use_qk_l2norm_in_kernel: bool = False, **unused: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """vllm-ascend's Triton chunk GDN: ``[S, HV, K, V]`` states in and out (the fork transposes around it)."""
    outs, finals = [], []
    for row, (start, end) in enumerate(spans_of(cu_seqlens)):
        o, final = delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                              beta[:, start:end], initial_state[row].transpose(-1, -2), use_qk_l2norm_in_kernel)
        outs.append(o)
        finals.append(final.transpose(-1, -2))
    return torch.cat(outs, dim=1).to(v.dtype), torch.stack(finals)


def fused_gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``DeviceOperator.fused_gdn_gating``: ``(g, beta)`` as ``[1, T, HV]`` FP32."""
    g, beta = gating(a, b, A_log, dt_bias)
    return g.unsqueeze(0), beta.unsqueeze(0)


def gdn_standin_modules(version: str, fused: bool) -> dict[str, dict[str, Any]]:
    """Return the import table of vllm-ascend ``version``'s ``gdn.py`` (``fused``: the CANN fused prefill exists)."""
    table = standin_modules(version)
    npu = make_torch_npu()
    if fused:  # the fork probes it with a smoke call on torch.npu.current_device()
        npu.npu_chunk_gated_delta_rule = npu_chunk_gated_delta_rule
        npu.npu.current_device = lambda: "cpu"
    table["torch_npu"] = {"": npu}
    noop = lambda *args, **kwargs: None  # noqa: E731
    table.update({
        "vllm.v1.attention.backends.gdn_attn": {"GDNAttentionMetadata": GDNAttentionMetadata, "*": True},
        "vllm.model_executor.layers.mamba.gdn.base": {"GatedDeltaNetAttention": GatedDeltaNetAttention},
        "vllm.v1.attention.backends.utils": {"PAD_SLOT_ID": -1, "*": True},
        "vllm_ascend.attention.utils": {"maybe_save_kv_layer_to_connector": noop,
                                        "wait_for_kv_layer_from_connector": noop, "*": True},
        "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.attention_fence": {
            "record_attention_compute_start": noop},
        "vllm_ascend.device.device_op": {"DeviceOperator": types.SimpleNamespace(fused_gdn_gating=fused_gdn_gating)},
        "vllm_ascend.ops.triton.fla.chunk": {"chunk_gated_delta_rule": chunk_gated_delta_rule},
    })
    return table


def install_c_ascend_gdn() -> None:
    """Install the GDN kernels the fork's ``_forward_core`` calls in ``torch.ops._C_ascend`` (beside the Kimi
    kernels :func:`ascend_standins.install_c_ascend` installed there, when a process runs both layers)."""
    from ascend_standins import c_ascend

    c_ascend().__dict__.update(npu_causal_conv1d_custom=npu_causal_conv1d_custom,
                               npu_recurrent_gated_delta_rule=npu_recurrent_gated_delta_rule)


STANDINS = {
    "torch.ops._C_ascend.npu_causal_conv1d_custom": "torch causal depthwise conv, SD conv state updated",
    "torch.ops._C_ascend.npu_recurrent_gated_delta_rule": "fla-core naive_recurrent_gated_delta_rule, rows in place",
    "torch_npu.npu_chunk_gated_delta_rule (fused variant only)": "fla-core naive_recurrent_gated_delta_rule",
    "vllm_ascend.ops.triton.fla.chunk.chunk_gated_delta_rule": "fla-core naive rule, [H,K,V] states",
    "vllm_ascend.device.device_op.DeviceOperator.fused_gdn_gating": "torch -exp(A_log)*softplus(a+dt_bias), "
    "sigmoid(b)",
    "vllm.model_executor.layers.mamba.gdn.base.GatedDeltaNetAttention": "base with only rearrange_mixed_qkv",
    "vllm.forward_context (real, installed vLLM 0.32)": "not stood in: the child sets a real ForwardContext",
    "vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadata": "SimpleNamespace with the Ascend builder's fields",
    "vllm_ascend.attention.utils.{wait_for,maybe_save}_kv_layer*, record_attention_compute_start": "no-ops "
    "(KV-connector hooks)",
    "torch_npu / torch.npu, vllm.triton_utils, l2norm_fwd, get_pcp_group": "as for kimi_kda (ascend_standins)",
}
