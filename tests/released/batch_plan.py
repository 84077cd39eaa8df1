"""The batch plan every upstream/Ascend GDN and upstream Kimi child runs: sizes and the four batches.

One table for all children, so that their ledgers' expected prefill-call counts are derived the same way.
Decodes come first in every batch, as vLLM's builders order them; batch 2 is decode-only (the pure-decode
branch, never counted as a prefill call).
"""

from __future__ import annotations

import torch

HEADS, HEAD_DIM, BLOCKS, LAYERS, MAX_NUM_SEQS, CONV_WIDTH = 2, 32, 9, 2, 8, 4
# (rows, has_initial_state, token counts, number of leading decodes, index dtype)
BATCHES = (
    ((4, 1, 6), (False, False, False), (7, 5, 9), 0, torch.int32),
    ((4, 1, 6, 3), (True, True, True, False), (1, 1, 6, 8), 2, torch.int64),
    ((4, 6), (True, True), (1, 1), 2, torch.int32),
    ((3, 8, 4), (True, False, True), (10, 3, 2), 0, torch.int64),
)
PREFILL_CALLS = sum(1 for batch in BATCHES if batch[3] < len(batch[0])) * LAYERS


def token_bounds(lengths: tuple[int, ...]) -> list[int]:
    """Return the cumulative token offsets ``[0, l0, l0 + l1, ...]`` of a batch's sequences (``query_start_loc``)."""
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return bounds


def run_forward_core_batches(layers: dict, raw_caches: dict, metadata_of_batch: object, generator: torch.Generator
                             ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Run every batch of :data:`BATCHES` through each GDN layer's ``_forward_core`` in vLLM's forward context.

    Args:
        layers: layer name -> layer (its ``_forward_core(mixed_qkv, b, a, core_attn_out)`` is the seam).
        raw_caches: layer name -> its raw cache pages (snapshotted before the first batch and after each).
        metadata_of_batch: ``batch -> (attention metadata, tokens)``.
        generator: draws the inputs (BF16 ``mixed_qkv``, ``b``, ``a``).
    Returns:
        ``(outputs, snapshots)``: one output per (batch, layer); ``len(BATCHES) + 1`` snapshots.
    """
    from vllm.forward_context import ForwardContext, override_forward_context  # after the child's stack install

    outputs, snapshots = [], [{name: raw.clone() for name, raw in raw_caches.items()}]
    for batch in BATCHES:
        metadata, tokens = metadata_of_batch(batch)
        mixed_qkv = torch.randn((tokens, 3 * HEADS * HEAD_DIM), generator=generator).to(torch.bfloat16)
        b = torch.randn((tokens, HEADS), generator=generator).to(torch.bfloat16)
        a = torch.randn((tokens, HEADS), generator=generator).to(torch.bfloat16)
        for name, layer in layers.items():
            core = torch.zeros((tokens, HEADS, HEAD_DIM), dtype=torch.bfloat16)
            context = ForwardContext(no_compile_layers=layers, attn_metadata={name: metadata}, slot_mapping={})
            with override_forward_context(context):
                layer._forward_core(mixed_qkv, b, a, core)
            outputs.append(core)
        snapshots.append({name: raw.clone() for name, raw in raw_caches.items()})
    return outputs, snapshots
