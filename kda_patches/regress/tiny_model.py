"""The tiny random-weight Qwen3-Next model of the default A/B workload, built at run time.

Qwen3-Next mixes Gated DeltaNet (linear-attention) layers with full-attention layers, which is
exactly what ``gdn_host_flags`` and the KV-cache layout patches touch. The model is built with
transformers from a fixed seed (no download) and saved with ``save_pretrained`` into a cache
directory keyed by a hash of its configuration, the seed and the transformers version, so every
process of every run serves byte-identical weights. The directory also holds a word-level
tokenizer built offline (token ``i`` is the word ``w<i>``; ``<s>``=0, ``</s>``=1), so text prompts
and vLLM's own ``vllm bench`` (which tokenizes its random prompts) work on it too. The vocabulary
is 10240 because ``vllm bench latency`` draws prompt ids below 10000. Building imports torch,
transformers and tokenizers; importing this module does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "kda-patches")
MODEL_SEED = 20261129
TOKENIZER_FORMAT = 1  # part of the cache key: bump when the tokenizer files change

# Constraints from vLLM's CPU GDN kernels: linear key head dim == value head dim, a multiple of 32.
TINY_QWEN3_NEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 10240,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "max_position_embeddings": 1024,
    "initializer_range": 0.05,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def resolve_cache_dir(cache_dir: str | None) -> str:
    """Return the absolute cache directory (``~/.cache/kda-patches`` when ``cache_dir`` is None)."""
    return os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR))


def compute_model_key(config: dict[str, Any], seed: int) -> str:
    """Return a short hash naming a model built from ``config`` and ``seed`` with this transformers.

    Args:
        config: keyword arguments of ``Qwen3NextConfig``.
        seed: the torch seed the weights are drawn from.
    Returns:
        12 hex digits.
    """
    import transformers

    payload = json.dumps({"config": config, "seed": seed, "transformers": transformers.__version__,
                          "tokenizer": TOKENIZER_FORMAT}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def build_tiny_model(target_dir: str, config: dict[str, Any], seed: int) -> None:
    """Draw the weights from ``seed`` and ``save_pretrained`` a bf16 Qwen3-Next into ``target_dir``.

    Args:
        target_dir: an empty or missing directory to write into.
        config: keyword arguments of ``Qwen3NextConfig`` (text config, built directly).
        seed: the torch seed.
    """
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model_config = Qwen3NextConfig(**config)
    model = Qwen3NextForCausalLM(model_config).to(torch.bfloat16)
    model.save_pretrained(target_dir, safe_serialization=True)
    build_tiny_tokenizer(target_dir, int(config["vocab_size"]))


def build_tiny_tokenizer(target_dir: str, vocab_size: int) -> None:
    """Save a word-level fast tokenizer whose token ``i`` is ``w<i>`` (``<s>``=0 bos/pad/unk, ``</s>``=1 eos).

    Decoding joins words with spaces and encoding splits on whitespace, so decode-then-encode
    (what ``vllm bench``'s random dataset does) returns the same ids.

    Args:
        target_dir: the model directory.
        vocab_size: number of tokens (the model's ``vocab_size``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1} | {f"w{index}": index for index in range(2, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<s>", unk_token="<s>")
    fast.save_pretrained(target_dir)


def fingerprint_model(model_dir: str) -> str:
    """Return the sha256 of every ``*.safetensors`` file of ``model_dir`` (sorted by name)."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with open(os.path.join(model_dir, name), "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def ensure_tiny_model(cache_dir: str | None = None, config: dict[str, Any] | None = None,
                      seed: int = MODEL_SEED) -> str:
    """Return the directory of the tiny model, building it first when the cache lacks it.

    The build goes to a temporary sibling directory that is renamed into place, so concurrent
    builders and interrupted builds never leave a half-written model behind.

    Args:
        cache_dir: cache root (default ``~/.cache/kda-patches``).
        config: ``Qwen3NextConfig`` keyword arguments (default :data:`TINY_QWEN3_NEXT_CONFIG`).
        seed: weight seed (default :data:`MODEL_SEED`).
    Returns:
        The absolute path of a directory loadable by ``vllm.LLM(model=...)``.
    """
    config = dict(TINY_QWEN3_NEXT_CONFIG if config is None else config)
    models_dir = os.path.join(resolve_cache_dir(cache_dir), "models")
    final_dir = os.path.join(models_dir, f"tiny-qwen3-next-{compute_model_key(config, seed)}")
    if os.path.isfile(os.path.join(final_dir, "config.json")):
        return final_dir
    os.makedirs(models_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".building-", dir=models_dir)
    try:
        build_tiny_model(staging, config, seed)
        try:
            os.rename(staging, final_dir)
        except OSError:
            if not os.path.isfile(os.path.join(final_dir, "config.json")):
                raise
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return final_dir
