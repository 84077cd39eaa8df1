"""Layers for measuring the kimi_prefill wrapper's host overhead per call (used by the benchmark script).

Both run the vllm-ascend ``_run_prefill`` body shape with no chunk math and a :class:`NullPlan` (gather
returns a preallocated tensor, scatter does nothing), so the difference between them is exactly what the
patch adds per call: the wrapt dispatch, the routed alias, the two routed index operations, the elided
clear and the per-call proof with its ledger counters.

- :class:`OverheadKimiK3DeltaAttention`: the fork's body (``cache[indices]``, ``clear_ssm_states``,
  ``cache[indices] = ...``), patched through the registry;
- :class:`DirectKimiK3DeltaAttention`: never patched; calls the same plan directly where the fork indexes.
"""

from __future__ import annotations

from typing import Any

import torch
from kimi_kda_ops import clear_ssm_states


class NullPlan:
    """A plan that copies nothing: ``gather`` returns ``packed``, ``scatter`` returns at once."""

    kind = "null"

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def gather(self, state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None = None) -> torch.Tensor:
        """Return the preallocated packed tensor."""
        return self.packed

    def scatter(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
        """Do nothing."""


class OverheadKimiK3DeltaAttention:
    """The fork's ``_run_prefill`` body shape without chunk math (patched in the measurement)."""

    prefix = "model.layers.0.self_attn"

    def _run_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_gate: torch.Tensor,
                     beta: torch.Tensor, recurrent_state: torch.Tensor, state_indices: torch.Tensor,
                     has_initial_state: torch.Tensor, prebuilt_metadata: Any) -> torch.Tensor:
        """Gather(+clear) and scatter the recurrent state; return ``q``."""
        initial_state_vk = recurrent_state[state_indices].contiguous()
        clear_ssm_states(initial_state_vk, has_initial_state)
        recurrent_state[state_indices] = initial_state_vk.to(recurrent_state.dtype)
        return q


class DirectKimiK3DeltaAttention:
    """The same body calling the layer's plan directly (the zero-overhead reference)."""

    prefix = "model.layers.0.self_attn"

    def _run_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_gate: torch.Tensor,
                     beta: torch.Tensor, recurrent_state: torch.Tensor, state_indices: torch.Tensor,
                     has_initial_state: torch.Tensor, prebuilt_metadata: Any) -> torch.Tensor:
        """Gather(+clear) and scatter through ``self._kda_state_copy_plan``; return ``q``."""
        plan = self._kda_state_copy_plan
        initial_state_vk = plan.gather(recurrent_state, state_indices, has_initial_state).contiguous()
        plan.scatter(recurrent_state, initial_state_vk.to(recurrent_state.dtype), state_indices)
        return q
