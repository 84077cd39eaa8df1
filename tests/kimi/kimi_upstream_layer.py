"""Reference layer named and shaped like upstream vLLM's ``vllm.models.kimi_k3.nvidia.kda.KimiK3DeltaAttention``.

Upstream has no ``_run_prefill``: the prefill branch of ``_forward`` reads the layer's metadata from vLLM's
forward context, calls the module-level ``gather_initial_states(recurrent_state, indices, has_initial_state)``,
runs the chunk math and writes ``recurrent_state[indices] = final.to(recurrent_state.dtype)``. This module
keeps exactly that shape (the real vLLM forward context is used, imported lazily so the module also loads
where vLLM is absent), with a minimal layer around it: no projections, the chunk math of
:mod:`kimi_kda_ops`. The kda_patches tests wrap it through the registry, never directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kimi_kda_ops import chunk_kda_prefill, gather_initial_states

LOWER_BOUND = -5.0


@dataclass
class KDAMetadata:
    """The fields of Kimi K3's KDA attention metadata the reference ``_forward`` reads.

    Attributes:
        num_prefills / num_decodes: sequence counts of the batch.
        has_initial_state: ``[S]`` bools (device).
        non_spec_state_indices_tensor: ``[S]`` int32/int64 cache rows (device).
        non_spec_query_start_loc: ``[S + 1]`` offsets (device).
        cu_seqlens_host: the same offsets on the host.
    """

    num_prefills: int
    num_decodes: int
    has_initial_state: torch.Tensor
    non_spec_state_indices_tensor: torch.Tensor
    non_spec_query_start_loc: torch.Tensor
    cu_seqlens_host: tuple[int, ...]


class KimiK3DeltaAttention:
    """Minimal Kimi K3 KDA layer: parameters of the gate, the bound ``kv_cache`` and the prefill ``_forward``.

    Args:
        prefix: the layer name (vLLM's ``static_forward_context`` key).
        num_heads: local heads ``H``; head_dim: ``K = V``.
        seed: parameter seed; device: where parameters live.
    """

    def __init__(self, prefix: str, num_heads: int, head_dim: int, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        generator = torch.Generator().manual_seed(seed)
        self.prefix = prefix
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.gate_lower_bound = LOWER_BOUND
        self.A_log = torch.rand(num_heads, generator=generator).log().to(device)
        self.dt_bias = (0.1 * torch.randn(num_heads * head_dim, generator=generator)).to(device)
        self.kv_cache: tuple[torch.Tensor, ...] = ()

    def bind_kv_cache(self, kv_cache: tuple[torch.Tensor, ...]) -> None:
        """Bind ``(conv_state, recurrent_state)`` (what the model runner does at startup)."""
        self.kv_cache = tuple(kv_cache)

    def _prefill_inputs(self, mixed_qkv: torch.Tensor) -> tuple | None:
        """Return ``(metadata, recurrent_state, q, k, v)`` for a prefill batch, or None when there is no prefill.

        Reads this layer's metadata from vLLM's forward context (as both forks' ``_forward`` do) and the
        recurrent-state cache bound now (during a routed call: the alias).
        """
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        m = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if m is None or m.num_prefills == 0:
            return None
        _, recurrent_state = self.kv_cache[:2]
        q, k, v = (part.reshape(1, -1, self.num_heads, self.head_dim) for part in mixed_qkv.chunk(3, dim=-1))
        return m, recurrent_state, q, k, v

    def _forward(self, mixed_qkv: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor) -> None:
        """Prefill branch of upstream's ``_forward``: gather, chunk math, scatter; output into ``core_attn_out``.

        Args:
            mixed_qkv: ``[T, 3 * H * D]`` packed q/k/v.
            g1: ``[1, T, H, D]`` raw gate; g2: output gate (unused here).
            beta: ``[1, T, H]`` betas (post-sigmoid).
            core_attn_out: ``[1, T, H, D]`` written in place.
        """
        inputs = self._prefill_inputs(mixed_qkv)
        if inputs is None:
            return
        m, recurrent_state, q, k, v = inputs
        initial_state = gather_initial_states(recurrent_state, m.non_spec_state_indices_tensor, m.has_initial_state)
        out, last_state = chunk_kda_prefill(q, k, v, g1, beta, self.A_log, self.dt_bias, self.gate_lower_bound,
                                            initial_state, m.cu_seqlens_host, m.non_spec_query_start_loc)
        recurrent_state[m.non_spec_state_indices_tensor] = last_state.to(recurrent_state.dtype)
        core_attn_out.copy_(out)
