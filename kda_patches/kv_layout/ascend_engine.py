"""The engine objects a vllm-ascend release's KV-cache code reads, stood in as plain namespaces.

:func:`build_vllm_config` turns a model of :mod:`kda_patches.kv_layout.ascend_models` and a tensor-parallel size
into the ``vllm_config`` the release code reads (the engine's defaults; see :data:`STOOD_IN`), with the
``ModelConfig`` rules vLLM applies (KV heads per TP, MLA head size). :class:`ReleaseLogger` stands in for vLLM's
logger and :func:`engine_environment` clears the engines' environment variables while release code runs.
:mod:`kda_patches.kv_layout.ascend_stack` executes the release code against these objects.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

NUM_BLOCKS = 64  # num_gpu_blocks_override: the block ids every view is proven for
MAX_MODEL_LEN = 4096

STOOD_IN = {
    "vllm_config": "a namespace with the engine defaults the executed code reads (cache, parallel, scheduler, "
                   "model configs); model_config's get_num_kv_heads / get_head_size follow vLLM's rules "
                   "(KV heads divided by TP, at least one; MLA: one head of kv_lora_rank + qk_rope_head_dim)",
    "device": "the NPU is torch's meta device: every view's shape, strides and storage offset as on the device",
    "ModelRegistry.resolve_model_cls": "the class the fork registers (or vLLM's registry names) for the "
                                       "architecture, with the release's own state-shape/dtype classmethods",
    "layers": "Attention / MLAAttention / MambaBase objects without __init__: the attributes their constructor "
              "sets (heads per TP, head sizes, dtypes, backend); state layers' get_state_shape/get_state_dtype "
              "are the model class's classmethods (what the fork sizes pages from)",
    "runner": "NPUModelRunner without __init__: device, configs, attn_groups (initialize_attn_backend: one per "
              "KV-cache group, attention groups with the fork's backend, state groups with none -- their reshape "
              "branch reads none), use_hybrid_blocks, feature switches off (sparse, compress, DCP, KV offload, "
              "KV transfer); the layout resolution sees the attention backend's declared layouts only",
    "vllm.logger": "a standard-library logger",
    "CacheConfig": "only its DEFAULT_BLOCK_SIZE, read from the release's class (a pydantic config class)",
    "vllm_version_is": "answers for the paired vLLM release",
    "device type": "get_ascend_device_type / get_current_hardware_profile answer for an A3 (the fork's own "
                   "AscendDeviceType member and hardware profile table)",
}


class ReleaseLogger(logging.LoggerAdapter):
    """vLLM's logger interface (``info_once`` and friends) over a standard-library logger."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(f"kda_patches.ascend_proof.{name}"), {})

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.info(msg, *args)

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.warning(msg, *args)

    def debug_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.debug(msg, *args)


class ModelConfig(SimpleNamespace):
    """The parts of vLLM's ``ModelConfig`` the executed code reads."""

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        if self.use_mla:
            return 1
        total = self.hf_text_config.num_key_value_heads
        return max(1, total // parallel_config.tensor_parallel_size)

    def get_total_num_kv_heads(self) -> int:
        return 1 if self.use_mla else self.hf_text_config.num_key_value_heads

    def get_head_size(self) -> int:
        text = self.hf_text_config
        if self.use_mla:
            return text.kv_lora_rank + text.qk_rope_head_dim
        return text.head_dim

    def get_num_layers(self, parallel_config: Any = None) -> int:
        return self.hf_text_config.num_hidden_layers

    def get_mamba_chunk_size(self) -> int | None:
        return None


class VllmConfig(SimpleNamespace):
    """The parts of vLLM's ``VllmConfig`` the executed code reads."""

    def with_hf_config(self, hf_config: Any, architectures: Any = None) -> VllmConfig:
        clone = copy.copy(self)
        clone.model_config = copy.copy(self.model_config)
        clone.model_config.hf_config = hf_config
        return clone


def _namespace(value: Any) -> Any:
    """``value`` with every dict turned into a namespace, except ``linear_attn_config`` (read as a dict)."""
    if isinstance(value, dict):
        return SimpleNamespace(**{key: _namespace(item) if key != "linear_attn_config" else dict(item)
                                  for key, item in value.items()})
    return value


def build_vllm_config(model: dict[str, Any], tp: int) -> VllmConfig:
    """The engine configuration of ``model`` at tensor parallel ``tp`` (engine defaults; see STOOD_IN).

    Args:
        model: a model of :data:`kda_patches.kv_layout.ascend_models.MODELS`.
        tp: the tensor-parallel size.

    Returns:
        The ``vllm_config`` stand-in; block size and Mamba page padding are left for the release to choose.
    """
    import torch

    text = _namespace(model["text_config"])
    text.architectures = [model["architecture"]]
    if model["model_type"] in ("kimi_k3", "qwen3_5"):
        hf_config = SimpleNamespace(model_type=model["model_type"], architectures=[model["architecture"]],
                                    text_config=text)
    else:
        hf_config = text
    dtype = getattr(torch, model["dtype"])
    model_config = ModelConfig(
        hf_config=hf_config, hf_text_config=text, dtype=dtype, architecture=model["architecture"],
        architectures=[model["architecture"]], use_mla=model["attention"] == "mla", is_hybrid=True,
        max_model_len=MAX_MODEL_LEN, original_max_model_len=MAX_MODEL_LEN, model_type=model["model_type"],
        supports_mamba_prefix_caching=False, enforce_eager=False, quantization=None, hf_config_path=None,
        is_deepseek_mla=False, convert_type="none", runner_type="generate", is_multimodal_model=False)
    cache_config = SimpleNamespace(
        block_size=None, user_specified_block_size=False, cache_dtype="auto", mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype="auto", mamba_page_size_padded=None, mamba_block_size=None,
        user_specified_mamba_block_size=False, enable_prefix_caching=True, mamba_cache_mode="none",
        num_gpu_blocks_override=NUM_BLOCKS, kv_cache_layout=None, use_kda_recoverssm=False,
        kv_cache_dtype_skip_layers=None, skip_page_size_padded=None, prefix_cache_retention_interval=None,
        calculate_kv_scales=False, kv_sharing_fast_prefill=False, sliding_window=None)
    parallel_config = SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1, decode_context_parallel_size=1,
        prefill_context_parallel_size=1, cp_kv_cache_interleave_size=1, enable_expert_parallel=False, rank=0)
    scheduler_config = SimpleNamespace(disable_hybrid_kv_cache_manager=False, enable_chunked_prefill=True,
                                       max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=MAX_MODEL_LEN)
    return VllmConfig(
        model_config=model_config, cache_config=cache_config, parallel_config=parallel_config,
        scheduler_config=scheduler_config, speculative_config=None, kv_transfer_config=None,
        ec_transfer_config=None, num_speculative_tokens=0, quant_config=None, lora_config=None,
        attention_config=SimpleNamespace(hisparse_config=None, backend=None),
        compilation_config=SimpleNamespace(static_forward_context={}), additional_config={},
        kv_events_config=None)




@contextlib.contextmanager
def engine_environment() -> Iterator[None]:
    """Run the release code with no ``VLLM_*`` / ``ASCEND*`` variable set (the engines' defaults).

    Yields:
        None; the removed variables are restored on exit.
    """
    saved = {key: value for key, value in os.environ.items() if key.startswith(("VLLM_", "ASCEND"))}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)
