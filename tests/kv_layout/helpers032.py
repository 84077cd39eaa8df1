"""Real vLLM 0.32 KV-cache configs and views for the tests: vLLM's own grouping and ``allocate_kv_cache``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

# The tiny Qwen3-Next engine's real specs (checked on 0.32 CPU): GDN conv (3, 512) bf16 + ssm (4, 64, 64) fp32
# = 68608 bytes in pages padded to the attention page of 131072 bytes (block size 256).
CONV_DIM, CONV_LEN = 512, 3


def build_config(num_attention: int, num_gdn: int, num_blocks: int = 16, conv_layout: str = "SD",
                 layout_name: str = "LBHNC") -> tuple[Any, Any]:
    """Return ``(kv_cache_config, layout)`` built by vLLM 0.32's ``get_kv_cache_groups`` and
    ``get_kv_cache_config_from_groups`` for alternating GDN / full-attention layers."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    cache = SimpleNamespace(num_gpu_blocks_override=num_blocks, prefix_cache_retention_interval=None,
                            get_resolved_kv_cache_layout=lambda: layout, mamba_cache_mode="align")
    stub = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None),
                           scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
                           model_config=None, parallel_config=None, speculative_config=None)
    attention = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    conv = (CONV_DIM, CONV_LEN) if conv_layout == "DS" else (CONV_LEN, CONV_DIM)
    gdn = MambaSpec(block_size=256, shapes=(conv, (4, 64, 64)), dtypes=(torch.bfloat16, torch.float32),
                    page_size_padded=attention.page_size_bytes if num_attention else None,
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")
    specs: dict[str, Any] = {}
    for index in range(num_attention + num_gdn):
        if (index % 2 == 1 and index // 2 < num_attention) or index >= 2 * num_gdn:
            specs[f"model.layers.{index}.self_attn.attn"] = attention
        else:
            specs[f"model.layers.{index}.linear_attn"] = gdn
    config = get_kv_cache_config_from_groups(stub, get_kv_cache_groups(stub, specs), 1 << 40)
    return config, layout


def allocate(config: Any, layout: Any) -> dict[str, Any]:
    """Call the real (possibly wrapped) ``vllm.v1.worker.utils.allocate_kv_cache`` on the CPU."""
    import torch
    import vllm.v1.worker.utils as worker_utils

    kernel_block_sizes = [group.kv_cache_spec.block_size for group in config.kv_cache_groups]
    return worker_utils.allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)


def make_gdn_layer(spec: Any) -> Any:
    """Return a real ``MambaBase`` subclass instance declaring ``spec``'s states (for ``bind_kv_cache``)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    class StateLayer(MambaBase):
        def get_state_shape(self) -> Any:
            return spec.shapes

        def get_state_dtype(self) -> Any:
            return spec.dtypes

        @property
        def mamba_type(self) -> Any:
            return spec.mamba_type

    return StateLayer()
