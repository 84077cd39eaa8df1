"""vLLM's Kimi K3 KDA / Kimi Linear GDN layers as :mod:`upstream_child` runs them: construction, metadata, batches.

``k3`` = ``vllm.models.kimi_k3.nvidia.kda.KimiK3DeltaAttention`` (``kimi_prefill``), ``linear`` =
``...mamba.gdn.kimi_gdn_linear_attn.KimiGatedDeltaNetAttention`` (``gdn_state_copy``; same kernels), installed
0.32 or a release's file executed on it. :func:`build_layer` builds the real class without vLLM's config;
:func:`run_forward_batches` runs every batch of :data:`batch_plan.BATCHES` through the layer's own ``_forward``
inside a real ``ForwardContext`` with real ``KimiK3KDAMetadata``: fresh prefills, a mixed decode + prefill
batch, a decode-only batch (must pass through untouched), chunked continuations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from batch_plan import BATCHES, CONV_WIDTH, HEAD_DIM, HEADS, token_bounds


def build_layer(cls: type, name: str, generator: torch.Generator) -> torch.nn.Module:
    """Return the real layer class, constructed without vLLM's config (only what ``_forward`` reads is set)."""
    from upstream_standins import GatedRMSNorm

    projection = HEADS * HEAD_DIM
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    values = {"prefix": name, "head_dim": HEAD_DIM, "local_projection_size": projection, "gate_lower_bound": -5.0,
              "kda_spec_decode_backend": "triton", "kda_decode_backend": "triton", "kda_prefill_backend": "triton",
              "decode_conv1d_weight": None, "decode_norm_weight": None, "use_recoverssm": False,
              "A_log": torch.randn(HEADS, generator=generator), "dt_bias": torch.randn(projection, generator=generator),
              "o_norm": GatedRMSNorm(torch.rand(HEAD_DIM, generator=generator) + 0.5)}
    for key, value in values.items():
        object.__setattr__(layer, key, value)
    conv = torch.nn.Module()
    object.__setattr__(conv, "weight", torch.randn((3 * projection, 1, CONV_WIDTH), generator=generator) * 0.5)
    object.__setattr__(conv, "bias", None)
    object.__setattr__(layer, "conv1d", conv)
    return layer


def metadata_of(batch: tuple) -> tuple[object, tuple[int, ...]]:
    """Return the batch's real ``KimiK3KDAMetadata`` and its token offsets."""
    from vllm.models.kimi_k3.nvidia.kda_metadata import KimiK3KDAMetadata

    rows, flags, lengths, decodes, index_dtype = batch
    bounds = token_bounds(lengths)
    tokens = bounds[-1]
    prefills = len(rows) - decodes
    return KimiK3KDAMetadata(
        num_prefills=prefills, num_prefill_tokens=tokens - decodes, num_decodes=decodes, num_decode_tokens=decodes,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=tokens,
        has_initial_state=torch.tensor(flags), non_spec_query_start_loc=torch.tensor(bounds, dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor(rows, dtype=index_dtype)), tuple(bounds)


def run_forward_batches(layers: dict, raw_caches: dict, generator: torch.Generator,
                        invoke: Callable[[Callable[[], object]], None] | None = None,
                        ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Run every batch of :data:`BATCHES` through each Kimi layer's ``_forward`` in vLLM's forward context.

    Args:
        invoke: runs one layer call given as a callable (e.g. captured under a breakable CUDA graph, then
            replayed); None calls it once.

    Returns:
        ``(outputs, snapshots)``: one output per (batch, layer); ``len(BATCHES) + 1`` raw-cache snapshots.
    """
    from vllm.forward_context import ForwardContext, override_forward_context  # after the child's stack install

    outputs, snapshots = [], [{name: raw.clone() for name, raw in raw_caches.items()}]
    projection = HEADS * HEAD_DIM
    for batch in BATCHES:
        metadata, bounds = metadata_of(batch)
        tokens = bounds[-1]
        mixed_qkv = torch.randn((tokens, 3 * projection), generator=generator).to(torch.bfloat16)
        g1 = torch.randn((1, tokens, HEADS, HEAD_DIM), generator=generator).to(torch.bfloat16)
        g2 = torch.randn((tokens, HEADS, HEAD_DIM), generator=generator).to(torch.bfloat16)
        beta = torch.randn((1, tokens, HEADS), generator=generator).to(torch.bfloat16)
        for name, layer in layers.items():
            core = torch.zeros((1, tokens, HEADS, HEAD_DIM), dtype=torch.bfloat16)
            context = ForwardContext(no_compile_layers=layers, attn_metadata={name: metadata}, slot_mapping={})
            with override_forward_context(context):
                call = functools.partial(layer._forward, mixed_qkv, g1, g2, beta, core)
                call() if invoke is None else invoke(call)
            outputs.append(core)
        snapshots.append({name: raw.clone() for name, raw in raw_caches.items()})
    return outputs, snapshots

