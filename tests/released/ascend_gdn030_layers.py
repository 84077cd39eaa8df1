"""vllm-ascend 0.30's ``AscendGatedDeltaNetAttention._forward_core`` (FLA prefill branch) as :mod:`ascend_child`
runs it: :mod:`ascend_gdn_layers`' layers and metadata with what 0.30's builder adds -- the prefill chunk metadata
(host fields; ``prepare_chunk_indices`` is the release's) and the decode ``actual_seq_lengths`` in its
``[query_start_loc[0], len_0, ...]`` form. The FLA branch: ``gather_ssm_states`` -> ``DeviceOperator.fla_gdn_prefill``
-> ``scatter_ssm_states_`` (:mod:`ascend_gdn030_standins`).
"""

from __future__ import annotations

import itertools
import types

import torch
from ascend_gdn_layers import metadata_of

CHUNK_SIZE = 64  # gdn_attn_builder._GDN_CHUNK_SIZE


def chunk_metadata(prefill_query_start_loc: torch.Tensor, prepare_chunk_indices: object) -> types.SimpleNamespace:
    """Return the host fields of 0.30's ``GDNChunkedPrefillMetadata`` (``build_device_metadata=False``).

    No segment of the batch plan is empty, so ``cu_seqlens_kern`` / ``keep_meta`` are None (as the builder's
    ``_compact_empty_segments`` leaves them).
    """
    bounds = tuple(prefill_query_start_loc.to(torch.int64).tolist())
    assert all(end > start for start, end in itertools.pairwise(bounds)), "empty segment in the plan"
    indices = prepare_chunk_indices(prefill_query_start_loc, CHUNK_SIZE)
    device_fields = dict.fromkeys(("chunk_indices_chunk64", "chunk_offsets_chunk64", "update_chunk_offsets_chunk64",
                                   "final_chunk_indices_chunk64", "chunk_indices_large_block",
                                   "block_indices_cumsum"))
    return types.SimpleNamespace(cu_seqlens_host=bounds,
                                 chunk_indices_chunk64_host=tuple(indices.to(torch.int64).reshape(-1).tolist()),
                                 **device_fields, num_decodes=0, cu_seqlens_kern=None, keep_meta=None)


def fla_metadata_of(batch: tuple, metadata_class: type, prepare_chunk_indices: object) -> tuple[object, int]:
    """Return :func:`ascend_gdn_child.metadata_of`'s metadata with the fields 0.30's builder fills differently."""
    metadata, tokens = metadata_of(batch, metadata_class)
    starts, decodes = metadata.non_spec_query_start_loc, metadata.num_decodes
    if metadata.num_prefills:
        metadata.non_spec_prefill_metadata.chunk = chunk_metadata(metadata.prefill_query_start_loc,
                                                                  prepare_chunk_indices)
    if decodes:  # gdn_attn_builder._build_actual_seq_lengths(non_spec_query_start_loc, num_decodes)
        metadata.non_spec_decode_metadata.actual_seq_lengths = torch.cat(
            [starts[:1], starts[1:decodes + 1] - starts[:decodes]])
    return metadata, tokens

