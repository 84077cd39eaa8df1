"""Where the custom ops find a layer's sealed binding at run time: the current forward context.

Inside vLLM the binding is the attribute ``_kda_state_copy_plan`` of the layer object registered in
the forward context's ``no_compile_layers`` (vLLM's static forward context, set per step by the
model runner). Outside vLLM (tests, benchmarks, other runners), :func:`use_plans` sets a small
context of ours for the duration of a ``with`` block. There is no process-global plan registry:
the bindings live only as long as the worker (or the ``with`` block) that owns them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from kda_patches.state_copy.errors import refuse

PLAN_ATTRIBUTE = "_kda_state_copy_plan"

_BINDINGS: ContextVar[Mapping[str, Any] | None] = ContextVar("kda_state_copy_bindings", default=None)


@contextmanager
def use_plans(bindings: Mapping[str, Any]) -> Iterator[None]:
    """Make ``bindings`` (layer name -> LayerStatePlan) visible to the custom ops inside the block.

    Args:
        bindings: the bindings returned by :func:`kda_patches.state_copy.plan.initialize`.
    Yields:
        None; the previous context is restored on exit (blocks nest).
    """
    token = _BINDINGS.set(dict(bindings))
    try:
        yield
    finally:
        _BINDINGS.reset(token)


def vllm_forward_layers() -> Mapping[str, Any] | None:
    """Return vLLM's ``no_compile_layers`` of the current forward context, or None.

    vLLM is consulted only when it is already imported (a serving process); this never imports it.
    """
    forward_context = sys.modules.get("vllm.forward_context")
    if forward_context is None or not forward_context.is_forward_context_available():
        return None
    return getattr(forward_context.get_forward_context(), "no_compile_layers", None)


def resolve_binding(layer_name: str) -> Any:
    """Return the sealed binding of ``layer_name`` from the current forward context.

    Args:
        layer_name: the layer's name as registered with vLLM (``LayerStatePlan.layer_name``).
    Returns:
        The layer's ``LayerStatePlan``.
    Raises:
        StateCopyRefused: no context holds the layer, or the layer has no published plan.
    """
    layers = vllm_forward_layers()
    if layers is not None and layer_name in layers:
        binding = getattr(layers[layer_name], PLAN_ATTRIBUTE, None)
        if binding is None:
            refuse("unpublished", f"the layer is in vLLM's forward context but has no {PLAN_ATTRIBUTE}; the "
                   "worker must initialize the state-copy plans after binding the KV cache", layer_name)
        return binding
    bindings = _BINDINGS.get()
    if bindings is not None and layer_name in bindings:
        return bindings[layer_name]
    refuse("no_context", "no forward context holds this layer's state-copy plan: run the model inside vLLM's "
           "set_forward_context or inside kda_patches.state_copy.context.use_plans(bindings)", layer_name)
