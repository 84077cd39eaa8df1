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
