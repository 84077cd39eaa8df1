"""Reference layer shaped like vllm-ascend's ``vllm_ascend.ops.kimi_kda.AscendKimiK3DeltaAttention``.

Like the fork, it subclasses the upstream-shaped layer, overrides ``_forward`` and does its prefill in
``_run_prefill(self, q, k, v, raw_gate, beta, recurrent_state, state_indices, has_initial_state,
prebuilt_metadata) -> Tensor`` with the fork's body shape: optional ``keep_meta`` compaction of the
indices and flags, ``recurrent_state[state_indices].contiguous()`` then ``clear_ssm_states(...)`` (the
module-level name the fork imports), the chunk math (fla-core here instead of ``chunk_kda_fwd``), and
``recurrent_state[state_indices] = final.to(recurrent_state.dtype)``. The kda_patches tests wrap it
through the registry's post-import hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kimi_kda_ops import chunk_kda_prefill, clear_ssm_states
from kimi_upstream_layer import KimiK3DeltaAttention


@dataclass
class PrefillChunkMetadata:
    """What vllm-ascend's ``prebuilt_metadata`` (``non_spec_prefill_metadata.chunk``) carries for prefill.

    Attributes:
        cu_seqlens_host: ``S + 1`` sequence offsets on the host.
        cu_seqlens_kern: the same on the device, or None.
        keep_meta: optional bool/index tensor selecting the live sequences of ``state_indices``.
    """

    cu_seqlens_host: tuple[int, ...]
    cu_seqlens_kern: torch.Tensor | None = None
    keep_meta: torch.Tensor | None = None


@dataclass
class AscendKDAMetadata:
    """The GDN-metadata fields the reference ``_forward`` reads (prefill-only batches)."""

    num_prefills: int
    prefill_state_indices: torch.Tensor
    prefill_has_initial_state: torch.Tensor
    chunk: PrefillChunkMetadata


class AscendKimiK3DeltaAttention(KimiK3DeltaAttention):
    """vllm-ascend-shaped Kimi K3 KDA layer (prefill path only)."""

    def _forward(self, mixed_qkv: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor) -> None:
        """Read this layer's metadata from vLLM's forward context and run ``_run_prefill`` on prefill batches."""
        inputs = self._prefill_inputs(mixed_qkv)
        if inputs is None:
            return
        m, recurrent_state, q, k, v = inputs
        core_attn_out.copy_(self._run_prefill(q, k, v, g1, beta, recurrent_state, m.prefill_state_indices,
                                              m.prefill_has_initial_state, m.chunk))

    def _run_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_gate: torch.Tensor,
                     beta: torch.Tensor, recurrent_state: torch.Tensor, state_indices: torch.Tensor,
                     has_initial_state: torch.Tensor, prebuilt_metadata: PrefillChunkMetadata) -> torch.Tensor:
        """Gather(+clear) the initial states, run the chunk math, scatter the final states; return the output.

        Args:
            q, k: ``[1, T, H, K]``; v: ``[1, T, H, V]``; raw_gate: ``[1, T, H, K]``; beta: ``[1, T, H]``.
            recurrent_state: the layer's cache ``[N, H, V, K]`` (updated in place).
            state_indices: ``[S]`` int32/int64 cache rows; has_initial_state: ``[S]`` bools.
            prebuilt_metadata: :class:`PrefillChunkMetadata`.
        Returns:
            ``[1, T, H, V]`` attention output.
        """
        cu_seqlens_device = prebuilt_metadata.cu_seqlens_kern
        keep = prebuilt_metadata.keep_meta
        if keep is not None:
            state_indices = state_indices[keep]
            has_initial_state = has_initial_state[keep]
        initial_state_vk = recurrent_state[state_indices].contiguous()
        clear_ssm_states(initial_state_vk, has_initial_state)
        out, final_state = chunk_kda_prefill(q, k, v, raw_gate, beta, self.A_log, self.dt_bias, self.gate_lower_bound,
                                             initial_state_vk, prebuilt_metadata.cu_seqlens_host, cu_seqlens_device)
        recurrent_state[state_indices] = final_state.to(recurrent_state.dtype)
        return out
