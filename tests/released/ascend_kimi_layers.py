"""vllm-ascend's released Kimi ``_run_prefill`` as :mod:`ascend_child` runs it: the layer, its batches and inputs.

:func:`build_layer` makes an instance of the release's layer class with only the attributes ``_run_prefill``
reads; every batch of :data:`BATCHES` (fresh prefills, chunked continuations of cached rows, ``keep_meta``
compaction, INT32 and INT64 indices) then runs through the release's own ``_run_prefill`` of every layer, with
:func:`batch_inputs`' fresh random tensors.
"""

from __future__ import annotations

import types

import torch
from batch_plan import token_bounds

HEADS, HEAD_DIM, BLOCKS, LAYERS, MAX_NUM_SEQS = 2, 32, 9, 2, 8
# (cache rows, has_initial_state, token counts, keep_meta or None, index dtype). A row prefilled in one batch
# is continued (chunked prefill) by a later batch with its flag True; rows not listed are decode / idle
# rows that must keep their bytes. keep_meta drops entries (the fork compacts with a boolean mask).
BATCHES = (
    ((5, 1, 6), (False, False, False), (7, 13, 4), None, torch.int32),
    ((1, 6, 3), (True, True, False), (5, 9, 11), None, torch.int64),
    ((2, 4, 0, 7), (False, True, True, False), (6, 8, 3), (True, False, True, True), torch.int32),
    ((5,), (True,), (21,), None, torch.int64),
    ((3, 8), (True, False), (1, 2), None, torch.int32),
)


def build_layer(cls: type, name: str, generator: torch.Generator) -> object:
    """Return an instance of the release's layer class with only the attributes ``_run_prefill`` reads.

    The constructor (projections, quantization, TP) is vLLM's and is not run: the class's own methods are.
    """
    layer = object.__new__(cls)
    layer.prefix = name
    layer.head_dim = HEAD_DIM
    layer.local_num_heads = HEADS
    layer.gate_lower_bound = -5.0
    layer.A_log = torch.randn((1, 1, HEADS, 1), generator=generator)
    layer.dt_bias = torch.randn((HEADS * HEAD_DIM,), generator=generator)
    return layer


def batch_inputs(batch: tuple, generator: torch.Generator) -> tuple:
    """Return ``_run_prefill``'s arguments after ``recurrent_state`` for one batch (fresh random tensors)."""
    rows, flags, lengths, keep, index_dtype = batch
    tokens = sum(lengths)
    q, k, v, gate = (torch.randn((1, tokens, HEADS, HEAD_DIM), generator=generator).to(torch.bfloat16)
                     for _ in range(4))
    beta = torch.rand((1, tokens, HEADS), generator=generator)
    bounds = token_bounds(lengths)
    metadata = types.SimpleNamespace(cu_seqlens_host=tuple(bounds), cu_seqlens_kern=None,
                                     keep_meta=None if keep is None else torch.tensor(keep),
                                     chunk_indices_chunk64_host=None)
    return (q, k, v, gate, beta), torch.tensor(rows, dtype=index_dtype), torch.tensor(flags), metadata

