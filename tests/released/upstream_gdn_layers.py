"""vLLM's Qwen / Olmo hybrid GDN layers as :mod:`upstream_child` runs them: construction and real metadata.

:func:`build_layer` builds the real layer class (installed 0.32, or a release's ``qwen_gdn_linear_attn.py`` /
``olmo_gdn_linear_attn.py`` executed on it) without vLLM's config; :func:`metadata_of` returns a batch's real
``GDNAttentionMetadata`` (0.33+'s field ``flashinfer_checkpoint_plan`` set to None on 0.32's class, meaning no
FlashInfer checkpoint plan): prefill, mixed decode + prefill (decodes peeled off first, as the builder lays them
out), decode-only, continued. The layer's own ``_forward_core`` runs inside a real ``ForwardContext``
(:func:`batch_plan.run_forward_core_batches`).
"""

from __future__ import annotations

import torch
from batch_plan import CONV_WIDTH, HEAD_DIM, HEADS, token_bounds


def build_layer(cls: type, name: str, generator: torch.Generator) -> torch.nn.Module:
    """Return the real Qwen GDN layer class, constructed without vLLM's config (only what it reads is set)."""
    from gdn_standins import chunk_gated_delta_rule

    projection = HEADS * HEAD_DIM
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    conv = torch.nn.Module()
    object.__setattr__(conv, "weight", torch.randn((3 * projection, 1, CONV_WIDTH), generator=generator) * 0.5)
    object.__setattr__(conv, "bias", None)
    values = {"prefix": name, "activation": "silu", "num_k_heads": HEADS, "num_v_heads": HEADS, "tp_size": 1,
              "head_k_dim": HEAD_DIM, "head_v_dim": HEAD_DIM, "key_dim": projection, "value_dim": projection,
              "enable_packed_recurrent_decode": False, "allow_neg_eigval": True,
              "chunk_gated_delta_rule": chunk_gated_delta_rule,
              "A_log": torch.randn(HEADS, generator=generator) * 0.5,
              "dt_bias": torch.randn(HEADS, generator=generator), "conv1d": conv}
    for key, value in values.items():
        object.__setattr__(layer, key, value)
    return layer


def metadata_of(batch: tuple, extra_fields: dict | None = None) -> tuple[object, int]:
    """Return the batch's real ``GDNAttentionMetadata`` (prefill tail fields as the builder sets them)."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    rows, flags, lengths, decodes, index_dtype = batch
    bounds = token_bounds(lengths)
    tail = [bound - bounds[decodes] for bound in bounds[decodes:]]
    prefills = len(rows) - decodes
    indices = torch.tensor(rows, dtype=index_dtype)
    has_initial = torch.tensor(flags)
    metadata = GDNAttentionMetadata(
        num_prefills=prefills, num_prefill_tokens=bounds[-1] - decodes, num_decodes=decodes,
        num_decode_tokens=decodes, num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=bounds[-1],
        has_initial_state=has_initial, non_spec_query_start_loc=torch.tensor(bounds, dtype=torch.int32),
        non_spec_state_indices_tensor=indices,
        prefill_query_start_loc=torch.tensor(tail, dtype=torch.int32) if prefills else None,
        prefill_state_indices=indices[decodes:] if prefills else None,
        prefill_has_initial_state=has_initial[decodes:] if prefills else None)
    for key, value in (extra_fields or {}).items():
        object.__setattr__(metadata, key, value)
    return metadata, bounds[-1]

