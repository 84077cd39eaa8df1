"""Model runners shaped like vLLM's ``GPUModelRunner`` and vllm-ascend's ``NPUModelRunner`` (KV-cache part only).

``initialize_kv_cache`` allocates each layer's recurrent-state cache as a page-gapped view of a raw buffer
(``stride(0) > H * V * K``, a storage offset, gap and padding elements poisoned with a fixed pattern), binds
``(conv_state, recurrent_state)`` to the layers of ``compilation_config.static_forward_context``, and
returns -- exactly the point where the kimi_prefill startup hook prepares and publishes the plans. A
spec can leave a layer unbound or give it a layout no plan accepts, to test that startup fails cleanly.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

POISON = -7.5  # exactly representable in FP32 and BF16: gap bytes must keep it


@dataclass
class StateCacheSpec:
    """How to allocate one layer's recurrent-state cache.

    Attributes:
        num_rows: ``N`` (cache rows / blocks).
        dtype: cache dtype.
        gap: poisoned elements between consecutive rows (page gap).
        offset: poisoned elements before row 0 (storage offset).
        layout: ``"dense"`` (``[H, V, K]`` inner payload dense) or ``"transposed"`` (V and K strides
            swapped: a layout no plan accepts).
        bind: False leaves the layer unbound.
    """

    num_rows: int
    dtype: torch.dtype = torch.float32
    gap: int = 24
    offset: int = 8
    layout: str = "dense"
    bind: bool = True


@dataclass
class KVCacheConfig:
    """layer name -> :class:`StateCacheSpec` (what the reference runners allocate)."""

    specs: dict[str, StateCacheSpec] = field(default_factory=dict)


class GPUModelRunner:
    """Reference runner: owns the layers (by name), the scheduler limit and the raw cache buffers.

    Args:
        layers: layer name -> layer (becomes ``compilation_config.static_forward_context``).
        max_num_seqs: ``scheduler_config.max_num_seqs``.
        device: where caches are allocated.
    """

    def __init__(self, layers: dict[str, Any], max_num_seqs: int, device: torch.device | str = "cpu") -> None:
        self.compilation_config = SimpleNamespace(static_forward_context=dict(layers))
        self.scheduler_config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.device = torch.device(device)
        self.raw_caches: dict[str, torch.Tensor] = {}
        self.initialize_calls = 0

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig, is_profiling: bool = False,
                            kv_cache_allocation_context: AbstractContextManager | None = None) -> None:
        """Allocate every layer's caches and bind them (signature of vLLM 0.32's ``GPUModelRunner``)."""
        self.initialize_calls += 1
        for name, spec in kv_cache_config.specs.items():
            layer = self.compilation_config.static_forward_context[name]
            raw, state = allocate_state_cache(spec, layer.num_heads, layer.head_dim, self.device)
            self.raw_caches[name] = raw
            conv_state = torch.zeros(spec.num_rows, 3 * layer.num_heads * layer.head_dim, 3, device=self.device)
            if spec.bind:
                layer.bind_kv_cache((conv_state, state))


class NPUModelRunner(GPUModelRunner):
    """vllm-ascend-shaped runner: its own ``initialize_kv_cache(self, kv_cache_config)`` calls the parent's."""

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Delegate to the parent (both methods are wrapped; only the outer call may publish plans)."""
        super().initialize_kv_cache(kv_cache_config)


def allocate_state_cache(spec: StateCacheSpec, heads: int, head_dim: int, device: torch.device
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(raw buffer, [N, H, V, K] view)`` for ``spec``; everything outside the rows holds :data:`POISON`."""
    payload = heads * head_dim * head_dim
    row_stride = payload + spec.gap
    raw = torch.full((spec.offset + spec.num_rows * row_stride + spec.gap,), POISON, dtype=spec.dtype, device=device)
    if spec.layout == "transposed":
        strides = (row_stride, head_dim * head_dim, 1, head_dim)
    else:
        strides = (row_stride, head_dim * head_dim, head_dim, 1)
    state = raw.as_strided((spec.num_rows, heads, head_dim, head_dim), strides, spec.offset)
    return raw, state
