"""Stand-ins for the device-only calls of vllm-ascend's released Kimi KDA code, and the per-release tables.

Only what cannot run on a CPU is stood in: the AscendC / fla_npu kernels (``torch.ops._C_ascend.*``,
``fla_npu.ops.ascendc.*``) by torch equivalents built on fla-core's naive KDA reference, vLLM's Triton
``l2norm_fwd`` by its torch formula, ``torch_npu`` / ``torch.npu`` by a namespace that does nothing, and
``vllm.triton_utils`` by the real ``triton`` (what it is on a device with Triton; on this CPU build of
vLLM it is a placeholder). Everything else the executed path calls is the release's own code, including
``clear_ssm_states`` and its Triton kernel (run by the Triton interpreter). :data:`STANDINS` is the
written list, per release.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from typing import Any

import torch
from release_loader import placeholder

REAL = ("torch", "einops", "triton", "numpy", "functools", "collections", "contextlib", "typing", "types",
        "copy", "math", "dataclasses", "enum", "itertools", "abc", "os", "logging", "__future__", "inspect")
INERT = ("vllm", "vllm_ascend", "fla_npu")  # every name not stood in or executed below is a placeholder

KIMI_MODULE = "vllm_ascend.ops.kimi_kda"
CLEAR_MODULE = "vllm_ascend.ops.triton.fla.utils"
KDA_MODULE = "vllm_ascend.ops.kda"  # 0.28+: run_chunk_kda / run_recurrent_kda
PLAN_MODULE = "vllm_ascend.ops.kda_state_copy_plan"  # 0.30: the fork's own plan
RUNNER_MODULE = "vllm_ascend.worker.model_runner_v1"


def spans_of(cu_seqlens: Any) -> list[tuple[int, int]]:
    """Return the ``(start, end)`` token spans of packed sequences from host or device offsets."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return list(itertools.pairwise(int(b) for b in bounds))


def l2norm_fwd(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch form of vLLM's Triton ``l2norm_fwd``: ``x / sqrt(sum(x^2) + eps)`` over the last dim."""
    y = x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def token_gate(g: torch.Tensor, A_log: Any, dt_bias: Any, safe_gate: bool, lower_bound: float) -> torch.Tensor:
    """Per-token log-space decay of the raw gate ``g [T, H, K]`` (fla-core's naive KDA gates)."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    A_log = A_log.reshape(-1) if A_log is not None else None
    if safe_gate:
        return naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound)
    return naive_kda_gate(g, A_log, dt_bias)


def kda_gate_cumsum(g: torch.Tensor, chunk_size: int, A_log: Any = None, dt_bias: Any = None, cu_seqlens: Any = None,
                    use_gate_in_kernel: bool = False, safe_gate: bool = False, lower_bound: float = -5.0,
                    layout: str = "BSND") -> torch.Tensor:
    """Stand-in of ``torch.ops._C_ascend.kda_gate_cumsum`` (0.26): the gate's cumulative sum inside each chunk."""
    gate = token_gate(g[0], A_log, dt_bias, safe_gate, lower_bound) if use_gate_in_kernel else g[0].float()
    out = torch.empty_like(gate)
    for start, end in spans_of(cu_seqlens):
        for chunk in range(start, end, chunk_size):
            stop = min(chunk + chunk_size, end)
            out[chunk:stop] = gate[chunk:stop].cumsum(0)
    return out.unsqueeze(0)


def chunk_kda_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float, chunk_size: int, *, layout: str = "BSND", initial_state: torch.Tensor | None = None,
                  output_final_state: bool = True, cu_seqlens: Any = None, chunk_indices: Any = None,
                  safe_gate: bool = False, lower_bound: float = -5.0, use_gate_in_kernel: bool = False,
                  A_log: Any = None, dt_bias: Any = None, state_v_first: bool = False, **unused: Any
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in of the AscendC/fla_npu ``chunk_kda_fwd``: fla-core's ``naive_recurrent_kda`` per sequence.

    ``g`` is the raw gate when ``use_gate_in_kernel`` (0.27+), else 0.26's chunk-local cumsum (undone
    here). ``initial_state`` is ``[S, H, V, K]`` when ``state_v_first`` else ``[S, H, K, V]``; the final
    state comes back in the same layout, FP32. Returns ``(out [1, T, H, V] in v's dtype, final)``.
    """
    from fla.ops.kda.naive import naive_recurrent_kda

    if use_gate_in_kernel:
        gate = token_gate(g[0], A_log, dt_bias, safe_gate, lower_bound)
    else:
        gate = g[0].float().clone()
        for start, end in spans_of(cu_seqlens):
            for chunk in range(start, end, chunk_size):
                stop = min(chunk + chunk_size, end)
                gate[chunk + 1:stop] = g[0, chunk + 1:stop].float() - g[0, chunk:stop - 1].float()
    outs, finals = [], []
    for row, (start, end) in enumerate(spans_of(cu_seqlens)):
        state = initial_state[row].float()
        state = state.transpose(-1, -2) if state_v_first else state
        out, final = naive_recurrent_kda(q[:, start:end], k[:, start:end], v[:, start:end], gate[None, start:end],
                                         beta[:, start:end], scale=scale, initial_state=state[None],
                                         output_final_state=True)
        outs.append(out)
        finals.append(final[0].transpose(-1, -2) if state_v_first else final[0])
    return torch.cat(outs, dim=1).to(v.dtype), torch.stack(finals).contiguous()


def make_torch_npu() -> types.ModuleType:
    """Return the ``torch_npu`` stand-in; importing it installs ``torch.npu`` (as the real one does)."""
    npu = types.ModuleType("torch.npu")
    npu.Stream = type("Stream", (), {})
    npu.device = lambda *args, **kwargs: contextlib.nullcontext()
    npu.synchronize = lambda *args, **kwargs: None
    npu.current_device = lambda: 0
    torch.npu = npu
    module = types.ModuleType("torch_npu")
    module.npu = npu
    return module


def c_ascend() -> types.SimpleNamespace:
    """Return the stood-in ``torch.ops._C_ascend`` namespace (what the fork's .so registers), installed once."""
    namespace = vars(torch.ops).get("_C_ascend")  # torch.ops.<name> would create an op namespace of torch's
    if not isinstance(namespace, types.SimpleNamespace):
        namespace = types.SimpleNamespace()
        torch.ops._C_ascend = namespace
    return namespace


def install_c_ascend() -> types.SimpleNamespace:
    """Install the stood-in Kimi prefill kernels in ``torch.ops._C_ascend`` (what the fork's .so registers)."""
    namespace = c_ascend()
    namespace.__dict__.update(chunk_kda_fwd=chunk_kda_fwd, kda_gate_cumsum=kda_gate_cumsum)
    return namespace


def triton_utils() -> dict[str, Any]:
    """``vllm.triton_utils`` as it is on a device with Triton: the real ``triton`` / ``triton.language``."""
    import triton
    import triton.language as tl

    return {"HAS_TRITON": True, "triton": triton, "tl": tl,
            "tldevice": getattr(getattr(tl, "extra", None), "libdevice", None)}


def standin_modules(version: str) -> dict[str, dict[str, Any]]:
    """Return the stand-in import table of vllm-ascend ``version`` (module -> {name: object})."""
    l2norm = {"l2norm_fwd": l2norm_fwd}
    return {
        "torch_npu": {"": make_torch_npu()},
        "vllm.triton_utils": triton_utils(),
        "vllm.model_executor.layers.fla.ops.l2norm": l2norm,
        "vllm.third_party.flash_linear_attention.ops.l2norm": l2norm,
        "vllm.distributed": {"get_pcp_group": lambda: types.SimpleNamespace(world_size=1),
                             "get_tensor_model_parallel_rank": placeholder("vllm.distributed",
                                                                           "get_tensor_model_parallel_rank")},
        "vllm.compilation.breakable_cudagraph": {"eager_break_during_capture": lambda fn: fn},
        # vllm-ascend 0.30's plan module: Dynamo custom-op registration (eager calls bypass it) and the
        # device-class query (this is not a 950/A5).
        "vllm.utils.torch_utils": {"direct_register_custom_op": lambda **kwargs: None, "*": True},
        "vllm_ascend.utils": {"is_950": lambda: False, "*": True},
        "fla_npu.ops.ascendc": {"chunk_kda_fwd": chunk_kda_fwd,
                                **{name: placeholder("fla_npu.ops.ascendc", name)
                                   for name in ("recurrent_kda", "causal_conv1d_fn", "causal_conv1d_update")}},
    }


# The written list: every stood-in name per release (torch.ops._C_ascend is installed, not imported).
_COMMON = {
    "torch_npu / torch.npu": "namespace: Stream class, device() -> nullcontext, synchronize() no-op",
    "vllm.triton_utils.{triton,tl,HAS_TRITON}": "the real triton (vLLM's CPU build disables it)",
    "vllm.*.l2norm.l2norm_fwd": "torch x*rsqrt(sum(x^2)+1e-6) (vLLM's is a Triton kernel)",
    "vllm.compilation.breakable_cudagraph.eager_break_during_capture": "identity decorator (graph capture)",
}
STANDINS: dict[str, dict[str, str]] = {
    "0.26.0rc1": {**_COMMON,
                  "vllm.distributed.get_pcp_group": "world_size=1",
                  "torch.ops._C_ascend.kda_gate_cumsum": "fla-core naive_kda_lowerbound_gate + chunk-local cumsum",
                  "torch.ops._C_ascend.chunk_kda_fwd": "fla-core naive_recurrent_kda per sequence ([H,K,V] state)"},
    "0.27.1rc1": {**_COMMON,
                  "torch.ops._C_ascend.chunk_kda_fwd": "fla-core naive_recurrent_kda per sequence, gate in kernel, "
                  "state_v_first"},
}
STANDINS["0.28.0rc1"] = STANDINS["0.29.0rc1"] = dict(STANDINS["0.27.1rc1"])
STANDINS["0.30.0rc1"] = STANDINS["0.30.0rc2"] = {
    **_COMMON, "fla_npu.ops.ascendc.chunk_kda_fwd": STANDINS["0.27.1rc1"]["torch.ops._C_ascend.chunk_kda_fwd"],
    "vllm.utils.torch_utils.direct_register_custom_op": "no-op (registers the plan's Dynamo ops; eager bypasses)",
    "vllm_ascend.utils.is_950": "False (device class query)"}
