"""A fork that changed its copy code: the reference layer gathering with ``index_select`` instead of indexing.

Same ``_run_prefill`` signature as :mod:`kimi_ascend_layer` (so the patch's fingerprint still matches), but
the gather no longer goes through ``recurrent_state[state_indices]``. The patch must report such calls as
``bypassed`` (and raise under STRICT), never count them as routed.
"""

from __future__ import annotations

import torch
from kimi_ascend_layer import AscendKimiK3DeltaAttention, PrefillChunkMetadata
from kimi_kda_ops import chunk_kda_prefill, clear_ssm_states


class IndexSelectKimiK3DeltaAttention(AscendKimiK3DeltaAttention):
    """The reference layer with ``torch.index_select`` as its gather."""

    def _run_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_gate: torch.Tensor,
                     beta: torch.Tensor, recurrent_state: torch.Tensor, state_indices: torch.Tensor,
                     has_initial_state: torch.Tensor, prebuilt_metadata: PrefillChunkMetadata) -> torch.Tensor:
        """Same contract as the reference ``_run_prefill``; gathers with ``index_select``."""
        initial_state_vk = torch.index_select(recurrent_state, 0, state_indices).contiguous()
        clear_ssm_states(initial_state_vk, has_initial_state)
        out, final_state = chunk_kda_prefill(q, k, v, raw_gate, beta, self.A_log, self.dt_bias, self.gate_lower_bound,
                                             initial_state_vk, prebuilt_metadata.cu_seqlens_host,
                                             prebuilt_metadata.cu_seqlens_kern)
        recurrent_state[state_indices] = final_state.to(recurrent_state.dtype)
        return out
