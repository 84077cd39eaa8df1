"""Stand-ins for the NPU-only calls of vllm-ascend 0.30's ``AscendGatedDeltaNetAttention._forward_core`` (FLA).

0.30's ``gdn.py`` imports its convolution and decode kernels from ``fla_npu.ops.ascendc`` (0.26-0.29 called
``torch.ops._C_ascend``) and, for prefills, takes the FLA NPU branch when the process group has one rank,
the hardware profile reports ``HardwareCapability.FLA_GDN_PREFILL`` and ``_get_fla_gdn_prefill_op()`` (the
release's own function) finds ``fla_npu.ops.ascendc.chunk_gated_delta_rule_fwd``: it gathers the rows with the
fork's Triton ``gather_ssm_states``, runs ``DeviceOperator.fla_gdn_prefill`` and scatters the FP32 finals back
with ``scatter_ssm_states_(..., final.to(ssm_state.dtype).contiguous())``. Only the device calls are stood
in here, by torch on fla-core's naive gated delta rule (:func:`gdn_standins.delta_rule`); ``state_index.py``
(both Triton kernels, under the interpreter), ``gdn.py`` and ``clear_ssm_states`` are the release's code.
:data:`BRANCH_CALLS` counts which prefill branch ran (the FLA device call vs. the Triton chunk).
"""

from __future__ import annotations

import enum
import math
import types
from typing import Any

import torch
from ascend_gdn_standins import STANDINS as STANDINS_029
from ascend_gdn_standins import chunk_gated_delta_rule as triton_chunk_gated_delta_rule
from ascend_gdn_standins import (
    fused_gdn_gating,
    gdn_standin_modules,
    npu_causal_conv1d_custom,
    npu_recurrent_gated_delta_rule,
)
from ascend_standins import spans_of
from gdn_standins import delta_rule
from release_loader import StandInNotProvided

STATE_INDEX_MODULE = "vllm_ascend.ops.triton.mamba.state_index"  # the fork's gather/scatter (executed)
STATE_KERNELS = ("_gather_ssm_states_kernel", "_scatter_ssm_states_kernel")
BRANCH_CALLS = {"fla": 0, "triton": 0}  # prefill calls per branch (the fused CANN branch is absent: no op)



def chunk_gated_delta_rule_fwd(*args: Any, **kwargs: Any) -> None:
    """The FLA NPU operator handle that ``_get_fla_gdn_prefill_op`` imports: its presence selects the branch and
    the fork passes it to ``DeviceOperator.fla_gdn_prefill`` as ``fused_fwd``; that call is stood in whole, so
    the handle is never called.

    Raises:
        StandInNotProvided: always (the device kernel is reached only through ``fla_gdn_prefill``).
    """
    raise StandInNotProvided("fla_npu.ops.ascendc.chunk_gated_delta_rule_fwd is reached only through the "
                             "stood-in DeviceOperator.fla_gdn_prefill")


class HardwareCapability(enum.Enum):
    """Stand-in of the release's capability enum (``vllm_ascend.device.hardware_profile``): the member read."""

    FLA_GDN_PREFILL = enum.auto()


def get_current_hardware_profile() -> types.SimpleNamespace:
    """Stand-in of the SoC-detected profile: an A2/A3 (standard adaptor family) that supports FLA GDN prefill."""
    return types.SimpleNamespace(supports=lambda capability: capability is HardwareCapability.FLA_GDN_PREFILL)


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     conv_states: torch.Tensor, query_start_loc: torch.Tensor, cache_indices: torch.Tensor,
                     has_initial_state: torch.Tensor, activation: str | None = "silu", pad_slot_id: int = -1,
                     null_block_id: int = 0) -> torch.Tensor:
    """fla_npu's varlen causal conv (prefill): ``x [T, D]``, ``weight [W, D]``, SD conv state ``[N, W-1, D]``.

    Returns the activated output ``[T, D]`` in ``x``'s dtype; each sequence's conv-state row is updated.
    """
    out = torch.empty_like(x)
    npu_causal_conv1d_custom(out, x, weight, conv_states, bias, query_start_loc, cache_indices, has_initial_state,
                             activation_mode=int(activation is not None), pad_slot_id=pad_slot_id)
    return out


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None, *,
                         conv_state_indices: torch.Tensor, query_start_loc: torch.Tensor,
                         num_accepted_tokens: Any = None, max_query_len: int = 1, null_block_id: int = 0,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """fla_npu's causal conv update (decode, no speculation): every sequence continues its conv-state row.

    Returns ``out`` (``[T, D]``, allocated when None), written in place.
    """
    if num_accepted_tokens is not None:
        raise NotImplementedError("speculative decode is not part of the batch plan")
    out = torch.empty_like(x) if out is None else out
    npu_causal_conv1d_custom(out, x, weight, conv_state, bias, query_start_loc, conv_state_indices, None,
                             activation_mode=int(activation is not None), run_mode=1)
    return out


def recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, state: torch.Tensor, *,
                               g: torch.Tensor, beta: torch.Tensor, scale: float, actual_seq_lengths: Any,
                               ssm_state_indices: torch.Tensor, num_accepted_tokens: Any = None) -> torch.Tensor:
    """fla_npu's recurrent GDN (decode): q/k already L2-normalized by the fork, ``[T, H, K]``; ``g``/``beta``
    ``[T, HV]``; state rows ``[HV, V, K]`` at ``ssm_state_indices`` updated in place.

    ``actual_seq_lengths`` is what 0.30's builder fills (``_build_actual_seq_lengths``): ``[query_start_loc[0],
    len_0, ..., len_{N-1}]``, N + 1 entries for N sequences; a plain list of N lengths is accepted too.
    Returns ``o [T, HV, V]`` in ``value``'s dtype.
    """
    if num_accepted_tokens is not None:
        raise NotImplementedError("speculative decode is not part of the batch plan")
    lengths = [int(n) for n in actual_seq_lengths]
    if len(lengths) == ssm_state_indices.numel() + 1:
        lengths = lengths[1:]
    assert math.isclose(scale, key.shape[-1] ** -0.5), "the naive rule applies K**-0.5"
    return npu_recurrent_gated_delta_rule(query, key, value, g, beta, state, scale, lengths, ssm_state_indices)


def fla_gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_state: torch.Tensor, scale: float, prebuilt_meta: Any, fused_fwd: Any
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in of ``DeviceOperator.fla_gdn_prefill`` (A2/A3 adaptor: L2 norm of q/k outside the kernel, then
    fla_npu's ``chunk_gated_delta_rule_fwd``, BNSD, ``state_v_first=False``) as one device call.

    Args:
        q, k: ``[1, T, H, K]``; v: ``[1, T, HV, V]``; g, beta: ``[1, T, HV]`` (g FP32, beta cast to v's dtype
            as the adaptor does); all prefill sequences packed.
        initial_state: ``[N, HV, V, K]``, the cache layout (what ``gather_ssm_states`` returned; the adaptor
            transposes to the kernel's ``[N, HV, K, V]`` and back).
        scale: ``K ** -0.5`` (fla-core's default, asserted). prebuilt_meta: the builder's chunk metadata
            (``cu_seqlens_host``, ``cu_seqlens_kern``, ``keep_meta``). fused_fwd: the op handle.
    Returns:
        ``(o [1, T, HV, V] in v's dtype, final [N, HV, V, K] FP32)``; a zero-length segment (compacted away by
        ``keep_meta``) keeps its initial state.
    """
    assert fused_fwd is chunk_gated_delta_rule_fwd, "the fork passed another op than _get_fla_gdn_prefill_op's"
    assert math.isclose(scale, k.shape[-1] ** -0.5), "the naive rule applies K**-0.5"
    BRANCH_CALLS["fla"] += 1
    g, beta = g.float(), beta.to(v.dtype)
    outs, finals = [], []
    for row, (start, end) in enumerate(spans_of(prebuilt_meta.cu_seqlens_host)):
        if start == end:
            finals.append(initial_state[row].float())
            continue
        o, final = delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                              beta[:, start:end], initial_state[row], normalize=True)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs, dim=1).to(v.dtype), torch.stack(finals).contiguous()


def counted_triton_chunk(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The 0.26-0.29 Triton-chunk stand-in, counted (the branch taken when the FLA op is absent)."""
    BRANCH_CALLS["triton"] += 1
    return triton_chunk_gated_delta_rule(*args, **kwargs)


def gdn030_standin_modules(version: str) -> dict[str, dict[str, Any]]:
    """Return the import table of vllm-ascend ``version``'s (0.30) ``gdn.py`` in its FLA configuration."""
    table = gdn_standin_modules(version, fused=False)
    table.update({
        "fla_npu.ops.ascendc": {"causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update,
                                "recurrent_gated_delta_rule": recurrent_gated_delta_rule,
                                "chunk_gated_delta_rule_fwd": chunk_gated_delta_rule_fwd},
        "vllm_ascend.device.hardware_profile": {"HardwareCapability": HardwareCapability,
                                                "get_current_hardware_profile": get_current_hardware_profile},
        "vllm_ascend.device.device_op": {"DeviceOperator": types.SimpleNamespace(
            fused_gdn_gating=fused_gdn_gating, fla_gdn_prefill=fla_gdn_prefill)},
        "vllm_ascend.ops.triton.fla.chunk": {"chunk_gated_delta_rule": counted_triton_chunk},
    })
    return table


def count_kernel_launches(module: types.ModuleType, kernels: tuple[str, ...] = STATE_KERNELS) -> dict[str, int]:
    """Count launches of a release module's Triton kernels (default: the fork's state-index kernels) through
    Triton's own ``add_pre_run_hook`` (the kernel objects are unchanged); return the live ``kernel name ->
    launches`` table."""
    launches = dict.fromkeys(kernels, 0)
    for name in kernels:
        def count(*args: Any, _name: str = name, **kwargs: Any) -> None:
            launches[_name] += 1

        getattr(module, name).add_pre_run_hook(count)
    return launches


def interpreter_accepts_integer_masks() -> None:
    """Let Triton's interpreter take an integer load/store mask as ``mask != 0`` (a compiled kernel's i1 mask).

    The fork's ``_gather_ssm_states_kernel`` loads its bool flag, casts it ``.to(tl.int1)`` and ands it into a
    block mask. Triton 3.9's interpreter tags the comparison behind that cast with the operand's type (int8),
    so the splatted flag and the ``&`` come out int8 and ``tl.load`` refuses the mask ("mask has unsupported
    dtype"). Only the interpreter's masked load/store are adjusted; the kernel is the fork's, unchanged.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_kda_integer_masks", False):
        return

    def as_bool(mask: Any) -> Any:
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data != 0, mask.dtype)

    load, store = builder.create_masked_load, builder.create_masked_store
    builder.create_masked_load = lambda self, ptrs, mask, *rest: load(self, ptrs, as_bool(mask), *rest)
    builder.create_masked_store = lambda self, ptrs, value, mask, *rest: store(self, ptrs, value, as_bool(mask), *rest)
    builder._kda_integer_masks = True


STANDINS = {name: what for name, what in STANDINS_029.items()
            if not name.startswith(("torch.ops._C_ascend", "torch_npu.npu_chunk"))}
STANDINS.update({
    "fla_npu.ops.ascendc.causal_conv1d_fn / causal_conv1d_update": "torch causal depthwise conv (0.29's "
    "npu_causal_conv1d_custom stand-in), SD conv state updated",
    "fla_npu.ops.ascendc.recurrent_gated_delta_rule": "fla-core naive_recurrent_gated_delta_rule, rows in place "
    "(lengths after the builder's leading query_start_loc[0])",
    "fla_npu.ops.ascendc.chunk_gated_delta_rule_fwd": "op handle (present: selects the FLA branch; only its "
    "identity is used, calling it raises)",
    "vllm_ascend.device.device_op.DeviceOperator.fla_gdn_prefill": "fla-core naive rule per sequence on the "
    "gathered [N,HV,V,K] states, q/k L2 norm, beta in v's dtype; finals FP32 [N,HV,V,K]",
    "vllm_ascend.device.hardware_profile.{HardwareCapability,get_current_hardware_profile}": "A2/A3 profile "
    "supporting FLA_GDN_PREFILL",
    "vllm_ascend.ops.triton.fla.chunk.chunk_gated_delta_rule": STANDINS_029[
        "vllm_ascend.ops.triton.fla.chunk.chunk_gated_delta_rule"] + " (counted; not reached in the FLA branch)",
    f"{STATE_INDEX_MODULE} (release, not stood in)": "gather_ssm_states / scatter_ssm_states_, Triton interpreter",
    "triton.runtime.interpreter masked load/store (harness fix, not the fork)": "an integer mask is read as "
    "mask != 0 (Triton 3.9's interpreter mistypes the gather's flag mask as int8)",
})
