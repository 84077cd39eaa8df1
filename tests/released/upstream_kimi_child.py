"""Child process: run vLLM's ``KimiK3DeltaAttention._forward`` (or Kimi Linear's GDN one) on the CPU.

``python upstream_kimi_child.py LAYER SOURCE SEED CACHE_DTYPE CONV_LAYOUT OUT``; ``LAYER`` = ``k3``
(``vllm.models.kimi_k3.nvidia.kda.KimiK3DeltaAttention``, ``kimi_prefill``) or ``linear``
(``...mamba.gdn.kimi_gdn_linear_attn.KimiGatedDeltaNetAttention``, ``gdn_state_copy``; same kernels);
``CONV_LAYOUT`` = ``SD`` / ``DS`` (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``). ``SOURCE`` is ``installed``
(vLLM 0.32, the real module) or a vLLM release such as ``0.33.0``: then that release's layer file is
executed under the real module name on top of the installed vLLM (its other imports are the installed
modules; names the installed vLLM lacks are inert), with ``vllm.__version__`` reporting the release so the
overlay picks that release's targets.

The overlay is activated first (``import kda_patches``; the parent sets ``KDA_PATCHES=0|1``, STRICT in
both); the CUDA-only kernels are stood in at their module-level names (:mod:`upstream_standins`), then the
layer module is imported (the overlay's hooks wrap its ``_forward`` and its ``gather_initial_states``),
the stand-in ``GPUModelRunner`` binds poisoned pages (the overlay's startup hook prepares the plans), and
every batch of :data:`BATCHES` runs through the layer's own ``_forward`` inside a real ``ForwardContext``
with real ``KimiK3KDAMetadata``: fresh prefills, a mixed decode + prefill batch, a decode-only batch (must
pass through untouched), chunked continuations.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys

import torch
from batch_plan import BATCHES, BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, LAYERS, MAX_NUM_SEQS


def build_layer(cls: type, name: str, generator: torch.Generator) -> torch.nn.Module:
    """Return the real layer class, constructed without vLLM's config (only what ``_forward`` reads is set)."""
    from upstream_standins import GatedRMSNorm

    projection = HEADS * HEAD_DIM
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    values = {"prefix": name, "head_dim": HEAD_DIM, "local_projection_size": projection, "gate_lower_bound": -5.0,
              "kda_spec_decode_backend": "triton", "kda_decode_backend": "triton", "kda_prefill_backend": "triton",
              "decode_conv1d_weight": None, "decode_norm_weight": None, "use_recoverssm": False,
              "A_log": torch.randn(HEADS, generator=generator), "dt_bias": torch.randn(projection, generator=generator),
              "o_norm": GatedRMSNorm(torch.rand(HEAD_DIM, generator=generator) + 0.5)}
    for key, value in values.items():
        object.__setattr__(layer, key, value)
    conv = torch.nn.Module()
    object.__setattr__(conv, "weight", torch.randn((3 * projection, 1, CONV_WIDTH), generator=generator) * 0.5)
    object.__setattr__(conv, "bias", None)
    object.__setattr__(layer, "conv1d", conv)
    return layer


def metadata_of(batch: tuple) -> tuple[object, tuple[int, ...]]:
    """Return the batch's real ``KimiK3KDAMetadata`` and its token offsets."""
    from vllm.models.kimi_k3.nvidia.kda_metadata import KimiK3KDAMetadata

    rows, flags, lengths, decodes, index_dtype = batch
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    tokens = bounds[-1]
    prefills = len(rows) - decodes
    return KimiK3KDAMetadata(
        num_prefills=prefills, num_prefill_tokens=tokens - decodes, num_decodes=decodes, num_decode_tokens=decodes,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=tokens,
        has_initial_state=torch.tensor(flags), non_spec_query_start_loc=torch.tensor(bounds, dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor(rows, dtype=index_dtype)), tuple(bounds)


def run_forward_batches(layers: dict, raw_caches: dict, generator: torch.Generator
                        ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Run every batch of :data:`BATCHES` through each Kimi layer's ``_forward`` in vLLM's forward context.

    Returns:
        ``(outputs, snapshots)``: one output per (batch, layer); ``len(BATCHES) + 1`` raw-cache snapshots.
    """
    from vllm.forward_context import ForwardContext, override_forward_context  # after the child's stack install

    outputs, snapshots = [], [{name: raw.clone() for name, raw in raw_caches.items()}]
    projection = HEADS * HEAD_DIM
    for batch in BATCHES:
        metadata, bounds = metadata_of(batch)
        tokens = bounds[-1]
        mixed_qkv = torch.randn((tokens, 3 * projection), generator=generator).to(torch.bfloat16)
        g1 = torch.randn((1, tokens, HEADS, HEAD_DIM), generator=generator).to(torch.bfloat16)
        g2 = torch.randn((tokens, HEADS, HEAD_DIM), generator=generator).to(torch.bfloat16)
        beta = torch.randn((1, tokens, HEADS), generator=generator).to(torch.bfloat16)
        for name, layer in layers.items():
            core = torch.zeros((1, tokens, HEADS, HEAD_DIM), dtype=torch.bfloat16)
            context = ForwardContext(no_compile_layers=layers, attn_metadata={name: metadata}, slot_mapping={})
            with override_forward_context(context):
                layer._forward(mixed_qkv, g1, g2, beta, core)
            outputs.append(core)
        snapshots.append({name: raw.clone() for name, raw in raw_caches.items()})
    return outputs, snapshots


def main(kind: str, source: str, seed: int, cache_dtype: str, conv_layout: str, out: str) -> None:
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = conv_layout
    import upstream_standins
    from ascend_standins import REAL
    from release_loader import ReleaseStack
    from runner_standin import PageSpec, make_runner_module

    import kda_patches

    vllm = importlib.import_module("vllm")  # after the overlay's activation above (not reordered by isort)

    release: tuple[str, ...] = ()
    root = pathlib.Path(vllm.__file__).parent.parent
    if source != "installed":
        from kda_patches.releases.fetch import release_dir

        root, release = release_dir("vllm", source), (upstream_standins.LAYERS[kind][0],)
        vllm.__version__ = source  # the overlay reads the stack's version here (the layer is the release's)
    runner = make_runner_module(root / "vllm/v1/worker/gpu_model_runner.py", upstream_standins.RUNNER_MODULE,
                                "GPUModelRunner")
    stack = ReleaseStack(root, "", vllm.__version__, release, real=("vllm", *REAL), absent_inert=True,
                         modules={upstream_standins.RUNNER_MODULE: runner}).install()
    upstream_standins.install()  # after the stack: importing the kernels' package may import the layer module
    runner_module = importlib.import_module(upstream_standins.RUNNER_MODULE)  # the worker's runner first
    module_name, class_name, _ = upstream_standins.LAYERS[kind]
    layer_module = importlib.import_module(module_name)
    cls = getattr(layer_module, class_name)
    generator = torch.Generator().manual_seed(seed)
    layers = {f"model.layers.{i}.self_attn": build_layer(cls, f"model.layers.{i}.self_attn", generator)
              for i in range(LAYERS)}
    runner = runner_module.GPUModelRunner(layers, MAX_NUM_SEQS, seed)
    config = {name: PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH,
                             conv_layout=conv_layout) for name in layers}
    runner.initialize_kv_cache(config, False, None)
    outputs, snapshots = run_forward_batches(layers, runner.raw_caches, generator)
    layer_file = cls._forward.__code__.co_filename
    torch.save({"layer_file": layer_file, "outputs": outputs, "snapshots": snapshots,
                "ledger": kda_patches.get_ledger().snapshot(),
                "bound": stack.bound, "standins": upstream_standins.STANDINS, "class": cls.__qualname__,
                "init_error": None, "wrapped": type(vars(cls)["_forward"]).__name__,
                "gather_wrapped": type(layer_module.gather_initial_states).__name__,
                "conv": layer_module.causal_conv1d_fn.__name__}, out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
