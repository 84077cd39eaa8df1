"""Real vLLM 0.13.0 runner skeletons for the 0.13 tests: configs from vLLM's own grouping, real methods."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

BLOCK_SIZE = 32
NUM_KV_HEADS, HEAD_SIZE = 2, 64
GDN_HEADS, GDN_DIM, CONV_WIDTH = 2, 32, 4


def _specs(num_attention: int, num_gdn: int, conv_layout: str) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    attention = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                                  dtype=torch.bfloat16)
    conv_dim = 3 * GDN_HEADS * GDN_DIM
    conv = (conv_dim, CONV_WIDTH - 1) if conv_layout == "DS" else (CONV_WIDTH - 1, conv_dim)
    shapes = (conv, (GDN_HEADS, GDN_DIM, GDN_DIM))
    dtypes = (torch.bfloat16, torch.float32)
    padded = attention.page_size_bytes if num_attention else None
    gdn = MambaSpec(block_size=BLOCK_SIZE, shapes=shapes, dtypes=dtypes, page_size_padded=padded,
                    mamba_type="gdn_attention")
    specs: dict[str, Any] = {}
    for index in range(num_attention + num_gdn):
        if (index % 2 == 1 and index // 2 < num_attention) or index >= 2 * num_gdn:
            specs[f"model.layers.{index}.self_attn.attn"] = attention
        else:
            specs[f"model.layers.{index}.linear_attn"] = gdn
    return specs


def build_runner(num_attention: int, num_gdn: int, num_blocks: int = 12, conv_layout: str = "SD") -> Any:
    """Return ``(runner, kv_cache_config, kernel_block_sizes)`` of a real 0.13 runner skeleton.

    The runner is a real ``GPUModelRunner`` with only the attributes the KV-cache methods read.
    """
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    stub = SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
                           cache_config=SimpleNamespace(num_gpu_blocks_override=num_blocks))
    specs = _specs(num_attention, num_gdn, conv_layout)
    groups = get_kv_cache_groups(stub, specs)
    config = get_kv_cache_config_from_groups(stub, groups, 1 << 40)
    runner = object.__new__(GPUModelRunner)
    runner.device = torch.device("cpu")
    runner.kv_cache_config = config
    runner.runner_only_attn_layers = set()
    runner.cache_config = SimpleNamespace(cache_dtype="auto")
    runner.attn_groups = [[AttentionGroup(GDNAttentionBackend if isinstance(g.kv_cache_spec, MambaSpec)
                                          else CPUAttentionBackend, g.layer_names, g.kv_cache_spec, gid)]
                          for gid, g in enumerate(config.kv_cache_groups)]
    kernel_block_sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    return runner, config, kernel_block_sizes


def reshape(runner: Any, config: Any, kernel_block_sizes: list[int]) -> dict[str, Any]:
    """Run the real 0.13 allocation and reshape (wrapped or not, depending on the registry state)."""
    raw = runner._allocate_kv_cache_tensors(config)
    return runner._reshape_kv_cache_tensors(config, raw, kernel_block_sizes)
