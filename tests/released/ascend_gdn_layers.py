"""vllm-ascend's released ``AscendGatedDeltaNetAttention`` as :mod:`ascend_child` runs it: layers, pages, metadata.

:func:`build_layer` builds the release's class without vLLM's config (only what ``_forward_core`` reads);
:func:`bind_layers` binds poisoned hybrid pages (SD conv state, the fork's layout) through the stand-in runner,
whose ``initialize_kv_cache`` the overlay's startup hook wraps; :func:`metadata_of` returns a batch's metadata
with the fields the Ascend GDN builder fills (decodes first). Prefill, mixed decode + prefill, decode-only and
continued batches then run through the fork's own ``_forward_core`` (:func:`batch_plan.run_forward_core_batches`).
"""

from __future__ import annotations

import types

import torch
from batch_plan import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, LAYERS, MAX_NUM_SEQS, token_bounds
from runner_standin import PageSpec


def build_layer(cls: type, name: str, generator: torch.Generator) -> torch.nn.Module:
    """Return the release's layer class, constructed without vLLM's config (only what ``_forward_core`` reads)."""
    projection = HEADS * HEAD_DIM
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    conv = torch.nn.Module()
    weight = torch.randn((3 * projection, 1, CONV_WIDTH), generator=generator) * 0.5
    conv.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
    conv.register_parameter("ascend_conv1d_weight",  # the fork's packed [W, D] copy (0.28+)
                            torch.nn.Parameter(weight[:, 0].transpose(0, 1).contiguous(), requires_grad=False))
    object.__setattr__(conv, "bias", None)
    values = {"prefix": name, "activation": "silu", "conv_kernel_size": CONV_WIDTH, "num_k_heads": HEADS,
              "num_v_heads": HEADS, "tp_size": 1, "head_k_dim": HEAD_DIM, "head_v_dim": HEAD_DIM,
              "key_dim": projection, "value_dim": projection, "A_log": torch.randn(HEADS, generator=generator) * 0.5,
              "dt_bias": torch.randn(HEADS, generator=generator)}
    for key, value in values.items():
        object.__setattr__(layer, key, value)
    layer.conv1d = conv
    return layer


def bind_layers(cls: type, runner_class: type, seed: int, cache_dtype: str, first: int = 0
                ) -> tuple[dict[str, torch.nn.Module], object, torch.Generator]:
    """Build the release's layers from ``seed`` and bind their poisoned hybrid pages through the stand-in runner.

    Its ``initialize_kv_cache`` is the one the overlay's startup hook wraps (the plans are prepared there).
    ``first`` is the first layer index of their names (layers of several cases in one process keep apart).
    Returns:
        ``(layers by name, the runner, the generator)``; the batches draw from the same generator next.
    """
    generator = torch.Generator().manual_seed(seed)
    names = [f"model.layers.{first + i}.linear_attn" for i in range(LAYERS)]
    layers = {name: build_layer(cls, name, generator) for name in names}
    runner = runner_class(layers, MAX_NUM_SEQS, seed)
    runner.initialize_kv_cache({name: PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH,
                                               conv_layout="SD") for name in layers})
    return layers, runner, generator


def metadata_of(batch: tuple, metadata_class: type) -> tuple[object, int]:
    """Return the batch's metadata with the fields the Ascend GDN builder fills (decodes first)."""
    rows, flags, lengths, decodes, index_dtype = batch
    bounds = token_bounds(lengths)
    tail = [bound - bounds[decodes] for bound in bounds[decodes:]]
    prefills = len(rows) - decodes
    indices, has_initial = torch.tensor(rows, dtype=index_dtype), torch.tensor(flags)
    starts = torch.tensor(bounds, dtype=torch.int32)
    conv = types.SimpleNamespace(query_start_loc=starts, cache_indices=indices, initial_state_mode=has_initial.int())
    decode_conv = types.SimpleNamespace(query_start_loc=starts[:decodes + 1], cache_indices=indices[:decodes])
    return metadata_class(
        num_prefills=prefills, num_decodes=decodes, num_decode_tokens=decodes, num_actual_tokens=bounds[-1],
        spec_sequence_masks=None, spec_token_indx=None, non_spec_token_indx=None, spec_state_indices_tensor=None,
        non_spec_state_indices_tensor=indices, non_spec_query_start_loc=starts,
        non_spec_prefill_metadata=types.SimpleNamespace(causal_conv1d=conv, chunk=None),
        non_spec_decode_metadata=types.SimpleNamespace(causal_conv1d=decode_conv, actual_seq_lengths=[1] * decodes),
        prefill_query_start_loc=torch.tensor(tail, dtype=torch.int32) if prefills else None,
        prefill_state_indices=indices[decodes:] if prefills else None,
        prefill_has_initial_state=has_initial[decodes:] if prefills else None), bounds[-1]

