"""Dummy seam functions for the routing-core tests (test code, not the package; nothing here knows kda_patches).

Each layer copies its state the way one fork family does, with a trivial "chunk math" (final = 0.5 * initial
+ 1 in float32, output = per-sequence sums) so that any wrong gathered or scattered byte shows in the output or
the cache:

- :class:`FunctionClearLayer` -- vllm-ascend Kimi ``_run_prefill``: ``cache[idx].contiguous()``, the
  module-level :func:`clear_ssm_states`, ``cache[idx] = final.to(cache.dtype)``;
- :class:`NativeClearLayer` -- upstream Qwen GDN ``_forward_core``: metadata from vLLM's forward context,
  ``initial = cache[idx]``, ``initial[~flags, ...] = 0``;
- :class:`ContiguousNativeClearLayer` -- Olmo hybrid GDN: other metadata names, ``.contiguous()`` after the gather;
- :class:`TransposeLayer` -- vllm-ascend GDN's ``.transpose(-1, -2).contiguous()`` variant;
- :class:`GatherFunctionLayer` -- Kimi Linear GDN: module-level :func:`gather_initial_states`;
- :class:`OtherIndexLayer` -- gathers with a *different* index tensor of the same shape and values, no clear;
- :class:`NoClearLayer` -- a fork that stopped calling ``clear_ssm_states`` after its gather;
- :class:`AttributeChunkLayer` -- Qwen GDN: ``self.chunk_gated_delta_rule(...)``, ``ssm_state[idx] = last.to(dtype)``;
- :class:`FunctionChunkLayer` -- Olmo hybrid GDN: module-level :func:`chunk_gated_delta_rule`;
- :class:`CastReuseLayer` -- uses ``last.to(dtype)`` (a sum) before scattering it;
- :class:`Runner` -- ``initialize_kv_cache(self, kv_cache_config)`` binding page-gapped, poisoned caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

POISON = -7.5
CLEARS = {"count": 0}


def clear_ssm_states(ssm_states: torch.Tensor, has_initial_state: torch.Tensor) -> None:
    """Zero the rows of ``ssm_states`` whose flag is false (vllm-ascend's semantics)."""
    CLEARS["count"] += 1
    ssm_states.masked_fill_(~has_initial_state.view(-1, *([1] * (ssm_states.dim() - 1))), 0)


def gather_initial_states(state: torch.Tensor, indices: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """Gather ``state[indices]``, zero where the flag is false (upstream's semantics; valid indices only)."""
    packed = torch.Tensor.__getitem__(state, indices.long()).clone()
    packed.masked_fill_(~has_initial_state.view(-1, 1, 1, 1), 0)
    return packed


def chunk(initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(output [S], final [S, ...] float32)`` of the dummy chunk math."""
    final = initial.float() * 0.5 + 1.0
    return final.sum(dim=tuple(range(1, final.dim()))), final


def special_finals(initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dummy chunk math, with FP32 edge values written into each final row's first items.

    NaNs with payloads and both signs, infinities, -0.0, FP32 subnormals, values past the 16-bit range and
    BF16/FP16 rounding ties: the folded cast must give torch's ``.to()`` bits for every one.
    """
    out, final = chunk(initial)
    edges = torch.tensor([0x7FC00001, 0xFFC00000, 0x7FA00000, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001,
                          0x80400000, 0x7F7FFFFF, 0x477FF000, 0x3F808000, 0x3F818000, 0x3F800800, 0x33800000,
                          0xC7800000, 0x00800000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    rows = final.reshape(final.shape[0], -1)
    rows[:, :edges.numel()] = edges
    return out, final


def chunk_gated_delta_rule(initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Module-level chunk callable (Olmo's name): :func:`special_finals`."""
    return special_finals(initial)


@dataclass
class Metadata:
    """The GDN-metadata fields the dummy forward-context layers read."""

    num_prefills: int
    num_decodes: int
    prefill_state_indices: torch.Tensor
    prefill_has_initial_state: torch.Tensor
    non_spec_state_indices_tensor: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None


class Layer:
    """A layer with a name and a bound ``kv_cache``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.kv_cache: tuple[torch.Tensor, ...] = ()
        self.seen_state_types: list[type] = []


class FunctionClearLayer(Layer):
    def _run_prefill(self, q, k, v, raw_gate, beta, recurrent_state, state_indices, has_initial_state,
                     prebuilt_metadata):
        initial = recurrent_state[state_indices].contiguous()
        clear_ssm_states(initial, has_initial_state)
        out, final = chunk(initial)
        recurrent_state[state_indices] = final.to(recurrent_state.dtype)
        return out


class NoClearLayer(Layer):
    def _run_prefill(self, q, k, v, raw_gate, beta, recurrent_state, state_indices, has_initial_state,
                     prebuilt_metadata):
        initial = recurrent_state[state_indices].contiguous()
        out, final = chunk(initial)
        recurrent_state[state_indices] = final.to(recurrent_state.dtype)
        return out


class OtherIndexLayer(Layer):
    def _run_prefill(self, q, k, v, raw_gate, beta, recurrent_state, state_indices, has_initial_state,
                     prebuilt_metadata):
        rows = state_indices.clone()  # same shape and values, another tensor object
        initial = recurrent_state[rows].contiguous()
        out, final = chunk(initial)
        recurrent_state[state_indices] = final.to(recurrent_state.dtype)
        return out


def _metadata(layer: Layer) -> Metadata | None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    return metadata.get(layer.prefix) if isinstance(metadata, dict) else None


class NativeClearLayer(Layer):
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = _metadata(self)
        ssm_state = self.kv_cache[1]
        self.seen_state_types.append(type(ssm_state))
        if m is None or m.num_prefills == 0:  # decode: the cache is read in place (a kernel would do this)
            core_attn_out.copy_(ssm_state.flatten(1).sum(-1)[: core_attn_out.shape[0]].float())
            return
        prefill_state_indices = m.prefill_state_indices
        prefill_has_initial_state = m.prefill_has_initial_state
        initial_state = ssm_state[prefill_state_indices]
        initial_state[~prefill_has_initial_state, ...] = 0
        out, last = chunk(initial_state)
        ssm_state[prefill_state_indices] = last.to(ssm_state.dtype)
        core_attn_out.copy_(out)


class ContiguousNativeClearLayer(Layer):
    """Olmo hybrid's shape: other metadata names, ``.contiguous()`` after the gather, native clear."""

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = _metadata(self)
        ssm_state = self.kv_cache[1]
        has_initial_state = m.has_initial_state
        initial_state = ssm_state[m.non_spec_state_indices_tensor].contiguous()
        initial_state[~has_initial_state, ...] = 0
        out, last = chunk(initial_state)
        ssm_state[m.non_spec_state_indices_tensor] = last.to(ssm_state.dtype)
        core_attn_out.copy_(out)


class TransposeLayer(Layer):
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = _metadata(self)
        ssm_state = self.kv_cache[1]
        prefill_state_indices = m.prefill_state_indices
        prefill_has_initial_state = m.prefill_has_initial_state
        initial_state = ssm_state[prefill_state_indices].transpose(-1, -2).contiguous()
        clear_ssm_states(initial_state, prefill_has_initial_state)
        out, last = chunk(initial_state)
        ssm_state[prefill_state_indices] = last.transpose(-1, -2).contiguous().to(ssm_state.dtype)
        core_attn_out.copy_(out)


class GatherFunctionLayer(Layer):
    def _forward(self, mixed_qkv, g1, g2, beta, core_attn_out):
        m = _metadata(self)
        _, recurrent_state = self.kv_cache
        initial_state = gather_initial_states(recurrent_state, m.prefill_state_indices, m.prefill_has_initial_state)
        out, last = chunk(initial_state)
        recurrent_state[m.prefill_state_indices] = last.to(recurrent_state.dtype)
        core_attn_out.copy_(out)


class AttributeChunkLayer(Layer):
    """Qwen's shape: the chunk rule is a layer attribute; the final state is scattered ``.to(ssm_state.dtype)``."""

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix)
        self.chunk_gated_delta_rule = special_finals

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = _metadata(self)
        ssm_state = self.kv_cache[1]
        prefill_state_indices = m.prefill_state_indices
        prefill_has_initial_state = m.prefill_has_initial_state
        initial_state = ssm_state[prefill_state_indices]
        initial_state[~prefill_has_initial_state, ...] = 0
        out, last_recurrent_state = self.chunk_gated_delta_rule(initial_state)
        ssm_state[prefill_state_indices] = last_recurrent_state.to(ssm_state.dtype)
        core_attn_out.copy_(out)


class FunctionChunkLayer(Layer):
    """Olmo hybrid's shape: module-level ``chunk_gated_delta_rule``, other metadata names, ``.contiguous()``."""

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = _metadata(self)
        ssm_state = self.kv_cache[1]
        initial_state = ssm_state[m.non_spec_state_indices_tensor].contiguous()
        initial_state[~m.has_initial_state, ...] = 0
        out, last_recurrent_state = chunk_gated_delta_rule(initial_state)
        ssm_state[m.non_spec_state_indices_tensor] = last_recurrent_state.to(ssm_state.dtype)
        core_attn_out.copy_(out)


class ChunkModule(torch.nn.Module):
    """The chunk rule as a submodule (vLLM's ``ChunkGatedDeltaRule`` is a CustomOp ``nn.Module``)."""

    def forward(self, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return special_finals(initial)


class ModuleChunkLayer(torch.nn.Module):
    """Qwen's shape on an ``nn.Module``: the chunk rule is a registered submodule, ``kv_cache`` a plain attribute."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.kv_cache: tuple[torch.Tensor, ...] = ()
        self.chunk_gated_delta_rule = ChunkModule()

    _forward_core = AttributeChunkLayer._forward_core


class CastReuseLayer(AttributeChunkLayer):
    """Reads the cast final state (a copy, into ``cast_copies``) before scattering it."""

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix)
        self.cast_copies: list[torch.Tensor] = []

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = _metadata(self)
        ssm_state = self.kv_cache[1]
        initial_state = ssm_state[m.prefill_state_indices]
        initial_state[~m.prefill_has_initial_state, ...] = 0
        out, last_recurrent_state = self.chunk_gated_delta_rule(initial_state)
        cast = last_recurrent_state.to(ssm_state.dtype)
        self.cast_copies.append(cast.clone())
        ssm_state[m.prefill_state_indices] = cast
        core_attn_out.copy_(out)


class Runner:
    """Binds a page-gapped ``[N, H, V, K]`` cache (gaps and offset poisoned) to every layer at startup."""

    def __init__(self, layers: dict[str, Layer], max_num_seqs: int, rows: int = 24, heads: int = 2, dim: int = 4,
                 dtype: torch.dtype = torch.float32) -> None:
        self.compilation_config = SimpleNamespace(static_forward_context=dict(layers))
        self.scheduler_config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.shape, self.dtype = (rows, heads, dim, dim), dtype
        self.raw: dict[str, torch.Tensor] = {}

    def initialize_kv_cache(self, kv_cache_config):
        rows, heads, dim, _ = self.shape
        payload = heads * dim * dim
        for name, layer in self.compilation_config.static_forward_context.items():
            raw = torch.full((5 + rows * (payload + 6),), POISON, dtype=self.dtype)
            state = raw.as_strided(self.shape, (payload + 6, dim * dim, dim, 1), 5)
            state.copy_(torch.randn(self.shape, generator=torch.Generator().manual_seed(len(self.raw))))
            self.raw[name] = raw
            layer.kv_cache = (torch.zeros(rows, 3), state)
