"""Launch the indexed twin in place of the release's chunk-state host function, and its naive twin.

The release's host function (``chunk_gated_delta_rule_fwd_h(k, w, u, g=None, gk=None, initial_state=None,
output_final_state=False, chunk_size=64, save_new_value=True, cu_seqlens=None, chunk_indices=None,
chunk_offsets=None, use_exp2=False)``; older releases take a subset) returns ``(h, v_new, final_state)``: the
per-chunk states, the new values and the final states of the ``N`` sequences. Its indexed counterpart
(:func:`indexed_fwd_h`) takes the same arguments plus the cache, each sequence's cache row and flag, and returns
``(h, v_new, None)``: the initial states were read from ``cache[rows[n]]`` (zeros where the flag is false or the
row is not a cache row) and the final states were stored into ``cache[rows[n]]`` in the cache's dtype, exactly as
torch's ``.to()`` casts (rows outside the cache stored nowhere). :func:`naive_indexed_fwd_h` has the same signature
and does the same by the release's own function between a naive gather and scatter
(:mod:`~kda_patches.state_copy.naive`): the reference the twin is compared with.

Preconditions (as for the plans' scatter): the valid rows are distinct; the cache is ``[N, H, V, K]`` with a
contiguous ``[H, V, K]`` inside each row (any row stride); the call passes no ``initial_state`` of its own.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import triton

from kda_patches.indexed_chunk.derive import DerivedKernel
from kda_patches.state_copy import naive
from kda_patches.state_copy.casts import CastPolicy, probe_nan_policy

# the twin's launch configuration: one of the release autotuner's configs, the one whose worst slowdown against the
# fastest config of each bench row was least on an H100 (docs/results/no-copy, run 1). One fixed config, not the
# autotuner: its timing runs would store into the live cache, and nothing may compile or tune while serving
DEFAULT_CONFIG = {"kwargs": {"BV": 64}, "num_warps": 4, "num_stages": 2}
_INDEX_DTYPES = (torch.int32, torch.int64)


class IndexedCallRefused(ValueError):
    """A call the indexed twin cannot run exactly; the message names the argument and what it should be."""


@dataclass
class CallShape:
    """The host arguments of one call, bound to the release function's signature."""

    arguments: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.arguments.get(name)


@dataclass(frozen=True)
class HostSignature:
    """A host function's parameters as the binder needs them (read once per function).

    Attributes:
        names: the parameters in order (positional-or-keyword only: the release hosts take no ``*args``,
            ``**kwargs`` or keyword-only parameters; any other signature is bound by :mod:`inspect`).
        defaults: each defaulted parameter's default.
        required: the parameters without a default.
    """

    names: tuple[str, ...]
    defaults: dict[str, Any]
    required: frozenset[str]


_signatures: dict[Any, HostSignature | inspect.Signature] = {}


def read_signature(host: Any) -> HostSignature | inspect.Signature:
    """Return ``host``'s :class:`HostSignature`, or its :class:`inspect.Signature` where it has other kinds."""
    signature = inspect.signature(host)
    parameters = signature.parameters.values()
    if any(parameter.kind is not parameter.POSITIONAL_OR_KEYWORD for parameter in parameters):
        return signature
    return HostSignature(tuple(signature.parameters),
                         {p.name: p.default for p in parameters if p.default is not p.empty},
                         frozenset(p.name for p in parameters if p.default is p.empty))


def bind_host_call(host: Any, args: tuple, kwargs: dict) -> CallShape:
    """Bind a call of the release's host function to its signature, defaults applied, as :mod:`inspect` binds it.

    A routed prefill binds once per layer call, so the common signature (positional-or-keyword parameters only) is
    bound from a per-function table instead of :meth:`inspect.Signature.bind`.

    Raises:
        TypeError: as calling ``host`` would: too many positional arguments, an unknown keyword, a parameter given
            twice, a required one missing.
    """
    signature = _signatures.get(host)
    if signature is None:
        signature = _signatures[host] = read_signature(host)
    if not isinstance(signature, HostSignature):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return CallShape(dict(bound.arguments))
    names = signature.names
    if len(args) > len(names):
        raise TypeError(f"{host.__name__}() takes {len(names)} positional arguments but {len(args)} were given")
    arguments = dict(signature.defaults)
    arguments.update(zip(names[:len(args)], args, strict=True))
    for name in kwargs:
        if name not in signature.defaults and name not in signature.required:
            raise TypeError(f"{host.__name__}() got an unexpected keyword argument {name!r}")
        if name in names[:len(args)]:
            raise TypeError(f"{host.__name__}() got multiple values for argument {name!r}")
    arguments.update(kwargs)
    missing = signature.required.difference(arguments)
    if missing:
        raise TypeError(f"{host.__name__}() missing required arguments: {', '.join(sorted(missing))}")
    return CallShape(arguments)


def check_indexed_call(call: CallShape, cache: torch.Tensor, rows: torch.Tensor, flags: torch.Tensor | None,
                       sequences: int) -> None:
    """Refuse what the twin cannot run exactly.

    Raises:
        IndexedCallRefused: an ``initial_state`` was passed; the cache is not 4-D ``[N, H, V, K]`` of the call's
            ``H, V, K`` with a contiguous inside; ``rows`` is not a 1-D int32/int64 vector of one row per sequence on
            the cache's device; ``flags`` is not a 1-D bool vector of the same length.
    """
    if call["initial_state"] is not None:
        raise IndexedCallRefused("initial_state: the indexed twin reads the initial states from the cache; the "
                                 "call must pass initial_state=None")
    u, k = call["u"], call["k"]
    heads, value_dim, key_dim = u.shape[-2], u.shape[-1], k.shape[-1]
    if cache.dim() != 4 or tuple(cache.shape[1:]) != (heads, value_dim, key_dim):
        raise IndexedCallRefused(f"cache: shape {tuple(cache.shape)}, expected [N, {heads}, {value_dim}, "
                                 f"{key_dim}] (the call's H, V, K)")
    if cache.stride()[1:] != (value_dim * key_dim, key_dim, 1):
        raise IndexedCallRefused(f"cache: strides {cache.stride()}, each row's [H, V, K] must be contiguous")
    if cache.device != k.device:
        raise IndexedCallRefused(f"cache: on {cache.device}, the call's tensors on {k.device}")
    if not (isinstance(rows, torch.Tensor) and rows.dim() == 1 and rows.dtype in _INDEX_DTYPES
            and rows.numel() == sequences and rows.device == cache.device):
        raise IndexedCallRefused(f"rows: expected a 1-D int32/int64 vector of {sequences} cache rows on "
                                 f"{cache.device}, got {_describe(rows)}")
    if flags is not None and not (isinstance(flags, torch.Tensor) and flags.dim() == 1 and flags.dtype == torch.bool
                                  and flags.numel() == sequences and flags.device == cache.device):
        raise IndexedCallRefused(f"flags: expected a 1-D bool vector of {sequences} flags on {cache.device}, got "
                                 f"{_describe(flags)}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} on {value.device}"
    return type(value).__name__


_policies: dict[tuple[torch.dtype, torch.device], CastPolicy] = {}


def final_cast_policy(cache: torch.Tensor) -> CastPolicy:
    """Return the exact FP32 -> cache-dtype cast policy on the cache's device (probed once per pair)."""
    key = (cache.dtype, cache.device)
    if key not in _policies:
        _policies[key] = probe_nan_policy(torch.float32, cache.dtype, cache.device)
    return _policies[key]


def indexed_fwd_h(derived: DerivedKernel, cache: torch.Tensor, rows: torch.Tensor, flags: torch.Tensor | None,
                  *args: Any, config: dict[str, Any] | None = None, **kwargs: Any
                  ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """Run the release's chunk-state step with the states read from and stored into ``cache`` by row.

    Args:
        derived: the indexed twin (:func:`~kda_patches.indexed_chunk.derive.derive_indexed_kernel`).
        cache: ``[N, H, V, K]`` state cache (FP32, BF16 or FP16); read and written in place.
        rows: ``[S]`` int32/int64, sequence ``n``'s cache row (``S`` sequences of the call).
        flags: ``[S]`` bool, whether sequence ``n`` starts from its cached state; None: every one does.
        *args, **kwargs: the release host function's arguments, ``initial_state`` None.
        config: ``{"kwargs": {"BV": ...}, "num_warps": ..., "num_stages": ...}``; default :data:`DEFAULT_CONFIG`.
    Returns:
        ``(h, v_new, None)`` as the release returns them (``v_new`` None unless ``save_new_value``).
    Raises:
        IndexedCallRefused: see :func:`check_indexed_call`.
    """
    return run_bound(derived, cache, rows, flags, bind_host_call(derived.host, args, kwargs), config)


def run_bound(derived: DerivedKernel, cache: torch.Tensor, rows: torch.Tensor, flags: torch.Tensor | None,
              call: CallShape, config: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """:func:`indexed_fwd_h` of a call already bound to the host's signature (:func:`bind_host_call`): the routed
    path binds once to recognise its placeholder and launches from the same binding."""
    host = derived.host
    k, w, u = call["k"], call["w"], call["u"]
    batch, tokens, key_heads, key_dim = k.shape
    value_dim, heads = u.shape[-1], u.shape[-2]
    chunk = call["chunk_size"] or 64
    cu_seqlens, chunk_indices, chunk_offsets = call["cu_seqlens"], call["chunk_indices"], call["chunk_offsets"]
    globals_ = host.__globals__
    if cu_seqlens is None:
        sequences, chunks, chunk_offsets = batch, triton.cdiv(tokens, chunk), None
    else:
        if chunk_indices is None:
            chunk_indices = globals_["prepare_chunk_indices"](cu_seqlens, chunk)
        sequences, chunks = len(cu_seqlens) - 1, len(chunk_indices)
        if chunk_offsets is None:
            chunk_offsets = globals_["prepare_chunk_offsets"](cu_seqlens, chunk)
    check_indexed_call(call, cache, rows, flags, sequences)
    if flags is None:
        flags = torch.ones(sequences, dtype=torch.bool, device=cache.device)
    states = k.new_empty(batch, chunks, heads, value_dim, key_dim)
    save = call["save_new_value"]
    new_values = torch.empty_like(u) if save is None or save else None
    _, dst, nan_rule, nan_bits = final_cast_policy(cache).constexprs()
    chosen = config or DEFAULT_CONFIG
    block_v = chosen["kwargs"]["BV"]
    arguments = {"k": k, "v": u, "w": w, "v_new": new_values, "g": call["g"], "gk": call["gk"], "h": states,
                 "h0": cache, "ht": cache, "kda_rows": rows, "kda_flags": flags, "kda_num_rows": cache.shape[0],
                 "kda_row_stride": cache.stride(0), "cu_seqlens": cu_seqlens, "chunk_offsets": chunk_offsets,
                 "T": tokens, "H": heads, "Hg": key_heads, "K": key_dim, "V": value_dim, "BT": chunk, "BV": block_v,
                 "USE_EXP2": bool(call["use_exp2"]), "KDA_DST": dst, "KDA_NAN_RULE": nan_rule,
                 "KDA_NAN_BITS": nan_bits}
    arguments = {name: value for name, value in arguments.items() if name in derived.arg_names}
    grid = (triton.cdiv(value_dim, block_v), sequences * heads)
    derived.jitted[grid](**arguments, num_warps=chosen["num_warps"], num_stages=chosen["num_stages"])
    return states, new_values, None


def naive_indexed_fwd_h(derived: DerivedKernel, cache: torch.Tensor, rows: torch.Tensor,
                        flags: torch.Tensor | None, *args: Any, config: dict[str, Any] | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """:func:`indexed_fwd_h` by gather, the release's own host function, scatter (``config`` unused)."""
    host = derived.host
    call = bind_host_call(host, args, kwargs)
    arguments = dict(call.arguments)
    arguments["initial_state"] = naive.gather_states(cache, rows, flags)
    arguments["output_final_state"] = True
    states, new_values, final = host(**arguments)
    naive.scatter_states(cache, final, rows)
    return states, new_values, None
