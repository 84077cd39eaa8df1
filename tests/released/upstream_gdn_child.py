"""Child process: run vLLM's ``QwenGatedDeltaNetAttention`` / ``OlmoHybridGatedDeltaNetAttention._forward_core``.

``python upstream_gdn_child.py LAYER SOURCE SEED CACHE_DTYPE CONV_LAYOUT OUT`` (``SOURCE``: ``installed`` or a vLLM
release, whose ``qwen_gdn_linear_attn.py`` then runs on the installed vLLM, as in :mod:`upstream_kimi_child`;
0.33's metadata field ``flashinfer_checkpoint_plan`` is set to None on 0.32's metadata class, meaning no
FlashInfer checkpoint plan). Same frame as :mod:`upstream_kimi_child`:
overlay activated first, device kernels stood in at the names the layer module imports
(:mod:`gdn_standins`), the real module imported (the overlay's hooks wrap ``_forward_core``), the stand-in
``GPUModelRunner`` binds poisoned pages (the overlay's startup hook prepares the plans), and the layer's
own ``_forward_core`` runs inside a real ``ForwardContext`` with real ``GDNAttentionMetadata``: prefill,
mixed decode + prefill (decodes peeled off first, as the builder lays them out), decode-only, continued.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys

import torch
from batch_plan import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, LAYERS, MAX_NUM_SEQS, run_forward_core_batches


def build_layer(cls: type, name: str, generator: torch.Generator) -> torch.nn.Module:
    """Return the real Qwen GDN layer class, constructed without vLLM's config (only what it reads is set)."""
    from gdn_standins import chunk_gated_delta_rule

    projection = HEADS * HEAD_DIM
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    conv = torch.nn.Module()
    object.__setattr__(conv, "weight", torch.randn((3 * projection, 1, CONV_WIDTH), generator=generator) * 0.5)
    object.__setattr__(conv, "bias", None)
    values = {"prefix": name, "activation": "silu", "num_k_heads": HEADS, "num_v_heads": HEADS, "tp_size": 1,
              "head_k_dim": HEAD_DIM, "head_v_dim": HEAD_DIM, "key_dim": projection, "value_dim": projection,
              "enable_packed_recurrent_decode": False, "allow_neg_eigval": True,
              "chunk_gated_delta_rule": chunk_gated_delta_rule,
              "A_log": torch.randn(HEADS, generator=generator) * 0.5,
              "dt_bias": torch.randn(HEADS, generator=generator), "conv1d": conv}
    for key, value in values.items():
        object.__setattr__(layer, key, value)
    return layer


def metadata_of(batch: tuple, extra_fields: dict | None = None) -> tuple[object, int]:
    """Return the batch's real ``GDNAttentionMetadata`` (prefill tail fields as the builder sets them)."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    rows, flags, lengths, decodes, index_dtype = batch
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    tail = [bound - bounds[decodes] for bound in bounds[decodes:]]
    prefills = len(rows) - decodes
    indices = torch.tensor(rows, dtype=index_dtype)
    has_initial = torch.tensor(flags)
    metadata = GDNAttentionMetadata(
        num_prefills=prefills, num_prefill_tokens=bounds[-1] - decodes, num_decodes=decodes,
        num_decode_tokens=decodes, num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=bounds[-1],
        has_initial_state=has_initial, non_spec_query_start_loc=torch.tensor(bounds, dtype=torch.int32),
        non_spec_state_indices_tensor=indices,
        prefill_query_start_loc=torch.tensor(tail, dtype=torch.int32) if prefills else None,
        prefill_state_indices=indices[decodes:] if prefills else None,
        prefill_has_initial_state=has_initial[decodes:] if prefills else None)
    for key, value in (extra_fields or {}).items():
        object.__setattr__(metadata, key, value)
    return metadata, bounds[-1]


def main(kind: str, source: str, seed: int, cache_dtype: str, conv_layout: str, out: str) -> None:
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = conv_layout
    import gdn_standins
    from ascend_standins import REAL
    from release_loader import ReleaseStack
    from runner_standin import PageSpec, make_runner_module
    from upstream_standins import RUNNER_MODULE

    import kda_patches

    vllm = importlib.import_module("vllm")  # after the overlay's activation above (not reordered by isort)

    release: tuple[str, ...] = ()
    root = pathlib.Path(vllm.__file__).parent.parent
    extra_fields = {}
    if source != "installed":
        from kda_patches.releases.fetch import release_dir

        root, release = release_dir("vllm", source), (gdn_standins.LAYERS[kind][0],)
        vllm.__version__ = source  # the overlay reads the stack's version here (the layer is the release's)
        extra_fields = {"flashinfer_checkpoint_plan": None}
    runner = make_runner_module(root / "vllm/v1/worker/gpu_model_runner.py", RUNNER_MODULE, "GPUModelRunner")
    stack = ReleaseStack(root, "", vllm.__version__, release, real=("vllm", "transformers", *REAL),
                         absent_inert=True, modules={RUNNER_MODULE: runner}).install()
    gdn_standins.install_upstream()
    runner_module = importlib.import_module(RUNNER_MODULE)  # the worker's runner first
    module_name, class_name, standins = gdn_standins.LAYERS[kind]
    layer_module = importlib.import_module(module_name)
    if kind == "olmo":  # its gating is a Triton kernel vLLM's CPU build disables; not an overlay target
        layer_module.fused_olmo_hybrid_gdn_gating = gdn_standins.fused_olmo_hybrid_gdn_gating

    cls = getattr(layer_module, class_name)
    generator = torch.Generator().manual_seed(seed)
    layers = {f"model.layers.{i}.linear_attn": build_layer(cls, f"model.layers.{i}.linear_attn", generator)
              for i in range(LAYERS)}
    runner = runner_module.GPUModelRunner(layers, MAX_NUM_SEQS, seed)
    config = {name: PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH,
                             conv_layout=conv_layout) for name in layers}
    runner.initialize_kv_cache(config, False, None)
    outputs, snapshots = run_forward_core_batches(layers, runner.raw_caches,
                                                  lambda batch: metadata_of(batch, extra_fields), generator)
    layer_file = cls._forward_core.__code__.co_filename
    torch.save({"layer_file": layer_file, "outputs": outputs, "snapshots": snapshots,
                "ledger": kda_patches.get_ledger().snapshot(),
                "bound": stack.bound, "standins": standins, "class": cls.__qualname__,
                "init_error": None, "wrapped": type(vars(cls)["_forward_core"]).__name__,
                "conv": layer_module.causal_conv1d_fn.__name__}, out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
