"""Stand-in model runner modules (``vllm_ascend.worker.model_runner_v1``, ``vllm.v1.worker.gpu_model_runner``).

The real ``initialize_kv_cache`` cannot run here: its body drives ~20 other runner subsystems (attention
backends, input batch, drafters, KV transfer, sparse offload). So the runner module is ours, but its
``initialize_kv_cache`` takes exactly the parameters the release's has
(read from the release file), so the overlay's startup hook -- and its signature check -- meet the
release's shape; every other method of the release's class is present as a stub with its release
signature (calling one raises), so the overlay's other runner targets meet the release's attributes.
It allocates hybrid pages (conv state, then recurrent state, then a gap, per block), poisons
everything that is not a live recurrent-state row with NaN bit patterns, binds
``layer.kv_cache = (conv_state, recurrent_state)``, and -- where the release's runner does
(vllm-ascend 0.30) -- then calls the fork's own ``initialize_kda_state_copy``, like the release.
"""

from __future__ import annotations

import importlib
import pathlib
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from release_loader import method_stubs, read_parameters

GAP_POISON = {torch.float32: 0x7FC0BEEF, torch.bfloat16: 0x7FC1}  # quiet NaNs with payloads
CONV_POISON = {torch.float32: -0x3F3F40, torch.bfloat16: -0x3D}  # 0xFFC0C0C0 / 0xFFC3: negative NaNs
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@dataclass
class PageSpec:
    """One layer's hybrid cache: ``num_blocks`` pages of [conv | recurrent | gap] plus a leading offset."""

    num_blocks: int
    heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    conv_width: int = 4
    gap: int = 40
    offset: int = 24
    conv_layout: str = "DS"  # DS: (dim, width-1) per block; SD: (width-1, dim), vLLM's VLLM_SSM_CONV_STATE_LAYOUT


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor``'s raw bits as integers (NaN patterns compare bit for bit)."""
    return tensor.view(BITS[tensor.dtype])


def allocate_pages(spec: PageSpec, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(raw, conv_state [N, 3*H*D, W-1], recurrent_state [N, H, V, K])`` views of one poisoned buffer.

    Gaps and the offset hold ``GAP_POISON``, the conv state (the page's other state, untouched by prefill
    state copies) ``CONV_POISON``; recurrent rows hold random values.
    """
    channels = 3 * spec.heads * spec.head_dim
    conv = channels * (spec.conv_width - 1)
    payload = spec.heads * spec.head_dim * spec.head_dim
    page = conv + payload + spec.gap
    raw = torch.empty(spec.offset + spec.num_blocks * page, dtype=spec.dtype)
    bits(raw).fill_(GAP_POISON[spec.dtype])
    if spec.conv_layout == "DS":
        conv_state = raw.as_strided((spec.num_blocks, channels, spec.conv_width - 1),
                                    (page, spec.conv_width - 1, 1), spec.offset)
    else:
        conv_state = raw.as_strided((spec.num_blocks, spec.conv_width - 1, channels), (page, channels, 1), spec.offset)
    bits(conv_state).fill_(CONV_POISON[spec.dtype])
    state = raw.as_strided((spec.num_blocks, spec.heads, spec.head_dim, spec.head_dim),
                           (page, spec.head_dim * spec.head_dim, spec.head_dim, 1), spec.offset + conv)
    state.copy_(torch.randn(state.shape, generator=generator))
    return raw, conv_state, state


def poison_problems(raw: torch.Tensor, spec: PageSpec, conv_rows: Iterable[int] = ()) -> list[str]:
    """Return what is wrong with the poisoned regions of ``raw`` (gaps, offset, conv state); empty when intact.

    ``conv_rows`` are blocks whose conv state the executed code legitimately wrote (its own convolution).
    """
    channels = 3 * spec.heads * spec.head_dim
    conv = channels * (spec.conv_width - 1)
    page = conv + spec.heads * spec.head_dim * spec.head_dim + spec.gap
    values = bits(raw)
    pages = values[spec.offset:].view(spec.num_blocks, page)
    problems = []
    if not bool((values[:spec.offset] == GAP_POISON[spec.dtype]).all()):
        problems.append("storage offset overwritten")
    if not bool((pages[:, page - spec.gap:] == GAP_POISON[spec.dtype]).all()):
        problems.append("page gap overwritten")
    untouched = [block for block in range(spec.num_blocks) if block not in set(conv_rows)]
    if not bool((pages[untouched, :conv] == CONV_POISON[spec.dtype]).all()):
        problems.append("conv state (the page's other state) overwritten")
    return problems


class StandInRunner:
    """Owns the layers (``compilation_config.static_forward_context``), ``max_num_seqs`` and the raw pages."""

    fork_plan_module: str | None = None  # a release whose runner calls initialize_kda_state_copy after binding

    def __init__(self, layers: dict[str, Any], max_num_seqs: int, seed: int) -> None:
        self.compilation_config = types.SimpleNamespace(static_forward_context=dict(layers))
        self.scheduler_config = types.SimpleNamespace(max_num_seqs=max_num_seqs)
        self.generator = torch.Generator().manual_seed(seed)
        self.raw_caches: dict[str, torch.Tensor] = {}

    def bind_caches(self, kv_cache_config: dict[str, PageSpec]) -> None:
        """Allocate and bind every layer's pages; then run the fork's own plan initialization where it has one."""
        for name, spec in kv_cache_config.items():
            raw, conv_state, state = allocate_pages(spec, self.generator)
            self.raw_caches[name] = raw
            self.compilation_config.static_forward_context[name].kv_cache = (conv_state, state)
        if self.fork_plan_module is not None:
            plan = importlib.import_module(self.fork_plan_module)
            plan.initialize_kda_state_copy(self.compilation_config.static_forward_context,
                                           self.scheduler_config.max_num_seqs)


def _initialize_2(self: StandInRunner, kv_cache_config: dict[str, PageSpec]) -> None:
    self.bind_caches(kv_cache_config)


def _initialize_3(self: StandInRunner, kv_cache_config: dict[str, PageSpec],
                  kv_cache_allocation_context: Any = None) -> None:
    self.bind_caches(kv_cache_config)


def _initialize_3p(self: StandInRunner, kv_cache_config: dict[str, PageSpec], is_profiling: bool = False) -> None:
    self.bind_caches(kv_cache_config)


def _initialize_4(self: StandInRunner, kv_cache_config: dict[str, PageSpec], is_profiling: bool = False,
                  kv_cache_allocation_context: Any = None) -> None:
    self.bind_caches(kv_cache_config)


def _initialize_5(self: StandInRunner, kv_cache_config: dict[str, PageSpec], is_profiling: bool = False,
                  kv_cache_allocation_context: Any = None, extensible: bool = False) -> None:
    self.bind_caches(kv_cache_config)


_BY_PARAMETERS = {("self", "kv_cache_config"): _initialize_2,
                  ("self", "kv_cache_config", "kv_cache_allocation_context"): _initialize_3,
                  ("self", "kv_cache_config", "is_profiling"): _initialize_3p,
                  ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context"): _initialize_4,
                  ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context", "extensible"):
                  _initialize_5}


def make_runner_module(path: pathlib.Path, module_name: str, class_name: str,
                       fork_plan_module: str | None = None) -> types.ModuleType:
    """Return a fresh stand-in runner module whose ``initialize_kv_cache`` has the parameters of ``path``'s.

    Args:
        path: the release's (or the installed) runner file, read with ``ast`` only.
        module_name: the module's real name; class_name: the runner class's name in it.
        fork_plan_module: module whose ``initialize_kda_state_copy`` the runner calls after binding (when the
            release's runner does so), else None.
    Raises:
        NotImplementedError: the file's signature is one this stand-in does not know (update it).
    """
    parameters = read_parameters(path, f"{class_name}.initialize_kv_cache")
    if parameters not in _BY_PARAMETERS:
        raise NotImplementedError(f"{path}: {class_name}.initialize_kv_cache{parameters} is not stood in")
    if fork_plan_module is not None and "initialize_kda_state_copy" not in path.read_text():
        fork_plan_module = None
    module = types.ModuleType(module_name)
    # Every other method of the release's class as a stub with its signature, so the overlay's other
    # runner targets (kv_cache_layout) see what they would see on the real class.
    stubs = method_stubs(path, class_name, skip=("__init__", "initialize_kv_cache"))
    runner = type(class_name, (StandInRunner,), {
        **stubs, "__module__": module_name, "initialize_kv_cache": _BY_PARAMETERS[parameters],
        "fork_plan_module": fork_plan_module})
    setattr(module, class_name, runner)
    return module
