"""Kernel-level pieces of the reference Kimi KDA layers (test code, not the package).

Shaped like the forks' ops modules: ``clear_ssm_states`` (vllm-ascend's ``vllm_ascend.ops.triton.fla.utils``),
``gather_initial_states`` (upstream vLLM's ``vllm.model_executor.layers.mamba.ops.gather_initial_states``)
and the chunk math. The chunk math comes from flash-linear-attention (``fla-core``): on the CPU its naive
chunked KDA reference (``fla.ops.kda.naive.naive_chunk_kda`` with the lower-bound gate of
``fla.ops.kda.gate.naive_kda_lowerbound_gate``); on CUDA its Triton ``fla.ops.kda.chunk_kda`` with the gate,
the q/k L2 norm and the ``[H, V, K]`` state layout handled in the kernel, as vllm-ascend's AscendC call does.
Nothing here knows about kda_patches.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

CHUNK_SIZE = 64
CLEAR_CALLS = {"count": 0}  # how often the original clear ran (the patched run elides it)


def clear_ssm_states(ssm_states: torch.Tensor, has_initial_state: torch.Tensor) -> None:
    """Zero, in place, the rows of ``ssm_states`` whose ``has_initial_state`` is false (no host sync).

    Args:
        ssm_states: ``[S, ...]`` gathered initial states.
        has_initial_state: ``[S]`` bools.
    """
    CLEAR_CALLS["count"] += 1
    if ssm_states.numel() == 0:
        return
    keep = has_initial_state.to(device=ssm_states.device, dtype=torch.bool).reshape(-1)
    ssm_states.masked_fill_(~keep.view(-1, *([1] * (ssm_states.dim() - 1))), 0)


def gather_initial_states(state: torch.Tensor, indices: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """Gather cache rows ``state[indices]`` into a new tensor, zero where ``has_initial_state`` is false.

    Like upstream's kernel, a row whose flag is false never reads its index. Unlike the CUDA kernel
    (which reads out of bounds), a negative index wraps and an index ``>= N`` raises (torch indexing).
    """
    keep = has_initial_state.to(device=state.device, dtype=torch.bool)
    rows = torch.where(keep, indices.long(), torch.zeros_like(indices, dtype=torch.long))
    packed = state[rows].contiguous()
    packed.masked_fill_(~keep.view(-1, 1, 1, 1), 0)
    return packed


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Return ``x / sqrt(sum(x^2) + eps)`` over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _naive_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_gate: torch.Tensor,
                         beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
                         initial_state_vk: torch.Tensor, cu_seqlens: Sequence[int]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.kda.gate import naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_chunk_kda

    heads, head_dim = q.shape[2:]
    q, k = l2_normalize(q[0]), l2_normalize(k[0])
    gate = naive_kda_lowerbound_gate(raw_gate[0], A_log, dt_bias, lower_bound)
    v, beta = v[0].float(), beta[0].float()
    spans = list(itertools.pairwise(cu_seqlens))
    padded = max(1, -(-max(end - start for start, end in spans) // CHUNK_SIZE)) * CHUNK_SIZE
    # One naive batch, every sequence zero-padded at its end to the longest one's chunk count: padding
    # tokens (k = v = gate = beta = 0) follow every real token and leave the state unchanged.
    batch = [torch.zeros(len(spans), padded, heads, dim) for dim in (head_dim, head_dim, v.shape[-1], head_dim)]
    betas = torch.zeros(len(spans), padded, heads)
    for slot, (start, end) in enumerate(spans):
        for tensor, source in zip(batch, (q, k, v, gate), strict=True):
            tensor[slot, : end - start] = source[start:end]
        betas[slot, : end - start] = beta[start:end]
    o, state = naive_chunk_kda(*batch, betas, scale=head_dim ** -0.5,
                               initial_state=initial_state_vk.float().transpose(-1, -2),
                               output_final_state=True, chunk_size=CHUNK_SIZE)
    out = torch.cat([o[slot, : end - start] for slot, (start, end) in enumerate(spans)])
    final = state.transpose(-1, -2).contiguous()
    return out.unsqueeze(0), final


def chunk_kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_gate: torch.Tensor, beta: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float, initial_state_vk: torch.Tensor,
                      cu_seqlens: Sequence[int], cu_seqlens_device: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the KDA chunk math of a packed prefill batch.

    Args:
        q, k: ``[1, T, H, K]`` queries and keys (L2-normalized inside).
        v: ``[1, T, H, V]`` values.
        raw_gate: ``[1, T, H, K]`` raw forget-gate input (``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``).
        beta: ``[1, T, H]`` betas (post-sigmoid).
        A_log: ``[H]``; dt_bias: ``[H * K]``; lower_bound: gate lower bound (< 0).
        initial_state_vk: ``[S, H, V, K]`` initial states (cache layout).
        cu_seqlens: ``S + 1`` host offsets of the sequences in ``T``.
        cu_seqlens_device: the same on the device (CUDA path).
    Returns:
        ``(out [1, T, H, V] in v's dtype, final_state [S, H, V, K] float32)``.
    """
    if q.is_cuda:
        from fla.ops.kda import chunk_kda

        offsets = cu_seqlens_device if cu_seqlens_device is not None else torch.tensor(
            list(cu_seqlens), dtype=torch.long, device=q.device)
        out, final = chunk_kda(q, k, v, raw_gate, beta, scale=q.shape[-1] ** -0.5,
                               initial_state=initial_state_vk.float(),  # fla takes FP32 initial states
                               output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               safe_gate=True, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
                               state_v_first=True, cu_seqlens=offsets.long(),
                               cu_seqlens_cpu=torch.tensor(list(cu_seqlens), dtype=torch.long))
        return out, final
    out, final = _naive_chunk_prefill(q, k, v, raw_gate, beta, A_log, dt_bias, lower_bound, initial_state_vk,
                                      cu_seqlens)
    return out.to(v.dtype), final
