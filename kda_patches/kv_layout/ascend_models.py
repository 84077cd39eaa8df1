"""Real models' cache-relevant configuration, written as data, with where each number comes from.

Only what sizes the KV cache is here: attention heads and head sizes, the linear-attention (GDN / KDA) state
geometry, which layers are which, the dtypes. :func:`kda_patches.kv_layout.ascend_engine.build_vllm_config` turns
each dict into the ``hf_config`` / ``hf_text_config`` objects the released code reads.

Sources (read 2026-12):

- **Kimi K3** (``moonshotai/Kimi-K3``, ``KimiK3ForConditionalGeneration`` with a ``kimi_linear`` text config):
  its ``config.json`` as reproduced verbatim in a public model report found with the code search (stored file id
  62826164383): 93 layers; ``full_attn_layers`` (1-based) 4, 8, ..., 92 and 93 (24 MLA layers), the other 69 are
  KDA; ``num_attention_heads`` 96, ``num_key_value_heads`` 96, ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64,
  ``qk_nope_head_dim`` 128, ``v_head_dim`` 128, ``q_lora_rank`` 1536; ``linear_attn_config``: ``num_heads`` 96,
  ``head_dim`` 128, ``short_conv_kernel_size`` 4; dtype bfloat16; no ``mamba_ssm_dtype``. A second public
  fixture of the same config (stored file id 57926167168) agrees on heads, ``kv_lora_rank`` and layer count. The
  class defaults of ``KimiLinearConfig`` in the vLLM release cache (``vllm/transformers_utils/configs/
  kimi_linear.py``) are those of a small model and are not used.
- **Qwen3.6-27B** (``Qwen3_5ForConditionalGeneration``, text config ``qwen3_5_text``): public configs of the
  27B checkpoint found with the code search (stored file ids 59831548536, 55568797625, 61410807965): 64 layers,
  ``full_attention_interval`` 4 (layers 3, 7, ... are full attention: 16 of them), ``num_attention_heads`` 24,
  ``num_key_value_heads`` 4, ``head_dim`` 256, ``linear_num_value_heads`` 48, ``linear_num_key_heads`` 16,
  ``linear_key_head_dim`` / ``linear_value_head_dim`` 128, ``linear_conv_kernel_dim`` 4, ``mamba_ssm_dtype``
  float32, dtype bfloat16. The vLLM release cache's ``Qwen3_5TextConfig`` defaults (``vllm/transformers_utils/
  configs/qwen3_5.py``: 16 heads, 32 value heads) are a smaller model's and are not used.
- **Qwen3-Next-80B-A3B** (``Qwen3NextForCausalLM``): the class defaults of ``Qwen3NextConfig`` in the vLLM
  release cache (``vllm/transformers_utils/configs/qwen3_next.py``, the 80B-A3B values): 48 layers,
  ``full_attention_interval`` 4 (12 full-attention layers), ``num_attention_heads`` 16, ``num_key_value_heads``
  2, ``head_dim`` 256, ``linear_num_value_heads`` 32, ``linear_num_key_heads`` 16, head dims 128, conv kernel 4;
  no ``mamba_ssm_dtype``; dtype bfloat16.

Layer names follow the prefixes the released model files register (``{prefix}.linear_attn`` for GDN,
``{prefix}.self_attn.attn`` for the attention layer in Qwen; ``{prefix}.self_attn`` for KDA and
``{prefix}.self_attn.attn`` for MLA in Kimi K3, under ``language_model.model.layers.``).
"""

from __future__ import annotations

from typing import Any

_K3_FULL_ATTN_LAYERS_1_BASED = [*range(4, 93, 4), 93]

MODELS: dict[str, dict[str, Any]] = {
    "Kimi K3": {
        "architecture": "KimiK3ForConditionalGeneration",
        "model_type": "kimi_k3",
        "dtype": "bfloat16",
        "attention": "mla",
        "layer_prefix": "language_model.model.layers.",
        "num_layers": 93,
        # 0-based indices of the MLA layers; every other layer is KDA
        "attention_layers": [index - 1 for index in _K3_FULL_ATTN_LAYERS_1_BASED],
        "state_layer_suffix": "self_attn",
        "attention_layer_suffix": "self_attn.attn",
        "text_config": {
            "model_type": "kimi_linear",
            "num_hidden_layers": 93,
            "hidden_size": 7168,
            "num_attention_heads": 96,
            "num_key_value_heads": 96,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,
            "linear_attn_config": {
                "full_attn_layers": _K3_FULL_ATTN_LAYERS_1_BASED,
                "kda_layers": [index for index in range(1, 94) if index not in _K3_FULL_ATTN_LAYERS_1_BASED],
                "num_heads": 96,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
                "use_full_rank_gate": True,
            },
            "num_nextn_predict_layers": 0,
        },
    },
    "Qwen3.6-27B": {
        "architecture": "Qwen3_5ForConditionalGeneration",
        "model_type": "qwen3_5",
        "dtype": "bfloat16",
        "attention": "gqa",
        "layer_prefix": "language_model.model.layers.",
        "num_layers": 64,
        "attention_layers": [index for index in range(64) if index % 4 == 3],
        "state_layer_suffix": "linear_attn",
        "attention_layer_suffix": "self_attn.attn",
        "text_config": {
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 64,
            "hidden_size": 5120,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "full_attention_interval": 4,
            "linear_num_value_heads": 48,
            "linear_num_key_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32",
            "layer_types": ["full_attention" if index % 4 == 3 else "linear_attention" for index in range(64)],
        },
    },
    "Qwen3-Next-80B": {
        "architecture": "Qwen3NextForCausalLM",
        "model_type": "qwen3_next",
        "dtype": "bfloat16",
        "attention": "gqa",
        "layer_prefix": "model.layers.",
        "num_layers": 48,
        "attention_layers": [index for index in range(48) if index % 4 == 3],
        "state_layer_suffix": "linear_attn",
        "attention_layer_suffix": "self_attn.attn",
        "text_config": {
            "model_type": "qwen3_next",
            "num_hidden_layers": 48,
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "full_attention_interval": 4,
            "linear_num_value_heads": 32,
            "linear_num_key_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "layer_types": ["full_attention" if index % 4 == 3 else "linear_attention" for index in range(48)],
        },
    },
}


def layer_names(model: dict[str, Any]) -> list[tuple[str, str]]:
    """Return ``(name, kind)`` of every cache layer in model order; kind is ``attention`` or ``state``."""
    names = []
    for index in range(model["num_layers"]):
        if index in model["attention_layers"]:
            names.append((f"{model['layer_prefix']}{index}.{model['attention_layer_suffix']}", "attention"))
        else:
            names.append((f"{model['layer_prefix']}{index}.{model['state_layer_suffix']}", "state"))
    return names
