"""The compile boundary: two opaque torch custom ops around a layer's sealed plan.

``kda_patches::state_gather(state, indices, flags, layer_name) -> Tensor`` allocates the packed
states; ``kda_patches::state_scatter(state!, packed, indices, layer_name) -> ()`` mutates the cache,
with ``packed`` in any final-state dtype the kernels cast (FP32, BF16, FP16; or the cache dtype): which
of those a layer prepared is known only to its plan, which refuses the others at run time.
Their fake implementations validate metadata (shapes, strides, dtypes, devices) without touching
pointers or plans, so Dynamo/FakeTensor tracing works with dynamic selected counts. At run time each
op resolves the sealed binding of the named layer from the current forward context
(:mod:`kda_patches.state_copy.context`) and launches its stored compiled kernels.
"""

from __future__ import annotations

import torch

from kda_patches.state_copy import layout
from kda_patches.state_copy.casts import FINAL_DTYPES
from kda_patches.state_copy.context import resolve_binding
from kda_patches.state_copy.errors import LayoutError, refuse

GATHER_SCHEMA = "(Tensor state, Tensor indices, Tensor? flags, str layer_name) -> Tensor"
SCATTER_SCHEMA = "(Tensor(a!) state, Tensor packed, Tensor indices, str layer_name) -> ()"


def check_gather_meta(state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None,
                      layer_name: str) -> None:
    """Validate a gather's metadata (no pointers): cache layout, index vector, flags shape."""
    layout.check_layout(state, layer_name)
    layout.check_indices(indices, state.device, layer_name)
    if flags is not None:
        layout.check_flags(flags, indices.shape[0], state.device, layer_name)


def check_scatter_meta(state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor, layer_name: str) -> None:
    """Validate a scatter's metadata (no pointers): cache layout, index vector, packed shape and dtype."""
    layout.check_layout(state, layer_name)
    layout.check_indices(indices, state.device, layer_name)
    layout.check_packed(packed, indices.shape[0], state, layer_name)
    if packed.dtype not in FINAL_DTYPES and packed.dtype != state.dtype:
        refuse("final_dtype", f"final states of dtype {packed.dtype} have no folded cast into the {state.dtype} "
               "cache (FP32, BF16, FP16 or the cache dtype)", layer_name, LayoutError)


@torch.library.custom_op("kda_patches::state_gather", mutates_args=(), schema=GATHER_SCHEMA)
def state_gather(state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None,
                 layer_name: str) -> torch.Tensor:
    """Run the named layer's sealed gather (see ``LayerStatePlan.gather``)."""
    return resolve_binding(layer_name).plan.gather(state, indices, flags, layer_name)


@state_gather.register_fake
def _state_gather_fake(state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None,
                       layer_name: str) -> torch.Tensor:
    check_gather_meta(state, indices, flags, layer_name)
    return state.new_empty((indices.shape[0], *state.shape[1:]))


@torch.library.custom_op("kda_patches::state_scatter", mutates_args=("state",), schema=SCATTER_SCHEMA)
def state_scatter(state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor, layer_name: str) -> None:
    """Run the named layer's sealed scatter (see ``LayerStatePlan.scatter``)."""
    resolve_binding(layer_name).plan.scatter(state, packed, indices, layer_name)


@state_scatter.register_fake
def _state_scatter_fake(state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor, layer_name: str) -> None:
    check_scatter_meta(state, packed, indices, layer_name)
