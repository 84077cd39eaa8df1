"""Child process: run vllm-ascend's released Kimi ``_run_prefill`` on the CPU and save what it produced.

``python ascend_kimi_child.py RELEASE SEED CACHE_DTYPE OUT``; the overlay is activated by ``import
kda_patches`` with the environment the parent chose (``KDA_PATCHES=0`` baseline, ``1`` patched;
``KDA_PATCHES_STRICT=1`` in both). The release's ``vllm_ascend/ops/kimi_kda.py`` is imported under its real
name (the overlay's post-import hooks wrap it), the stand-in runner binds poisoned hybrid pages (the
overlay's startup hook prepares the plans), then every batch of :data:`BATCHES` runs through the release's
own ``_run_prefill`` of every layer. Saved: outputs, every raw cache buffer after every batch, the ledger,
what was stood in, and the class that was executed.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import torch

HEADS, HEAD_DIM, BLOCKS, LAYERS, MAX_NUM_SEQS = 2, 32, 9, 2, 8
# (cache rows, has_initial_state, token counts, keep_meta or None, index dtype). A row prefilled in one batch
# is continued (chunked prefill) by a later batch with its flag True; rows not listed are decode / idle
# rows that must keep their bytes. keep_meta drops entries (the fork compacts with a boolean mask).
BATCHES = (
    ((5, 1, 6), (False, False, False), (7, 13, 4), None, torch.int32),
    ((1, 6, 3), (True, True, False), (5, 9, 11), None, torch.int64),
    ((2, 4, 0, 7), (False, True, True, False), (6, 8, 3), (True, False, True, True), torch.int32),
    ((5,), (True,), (21,), None, torch.int64),
    ((3, 8), (True, False), (1, 2), None, torch.int32),
)


def build_layer(cls: type, name: str, generator: torch.Generator) -> object:
    """Return an instance of the release's layer class with only the attributes ``_run_prefill`` reads.

    The constructor (projections, quantization, TP) is vLLM's and is not run: the class's own methods are.
    """
    layer = object.__new__(cls)
    layer.prefix = name
    layer.head_dim = HEAD_DIM
    layer.local_num_heads = HEADS
    layer.gate_lower_bound = -5.0
    layer.A_log = torch.randn((1, 1, HEADS, 1), generator=generator)
    layer.dt_bias = torch.randn((HEADS * HEAD_DIM,), generator=generator)
    return layer


def batch_inputs(batch: tuple, generator: torch.Generator) -> tuple:
    """Return ``_run_prefill``'s arguments after ``recurrent_state`` for one batch (fresh random tensors)."""
    rows, flags, lengths, keep, index_dtype = batch
    tokens = sum(lengths)
    q, k, v, gate = (torch.randn((1, tokens, HEADS, HEAD_DIM), generator=generator).to(torch.bfloat16)
                     for _ in range(4))
    beta = torch.rand((1, tokens, HEADS), generator=generator)
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    metadata = types.SimpleNamespace(cu_seqlens_host=tuple(bounds), cu_seqlens_kern=None,
                                     keep_meta=None if keep is None else torch.tensor(keep),
                                     chunk_indices_chunk64_host=None)
    return (q, k, v, gate, beta), torch.tensor(rows, dtype=index_dtype), torch.tensor(flags), metadata


def main(release: str, seed: int, cache_dtype: str, out: str) -> None:
    from ascend_standins import (
        CLEAR_MODULE,
        INERT,
        KDA_MODULE,
        KIMI_MODULE,
        PLAN_MODULE,
        REAL,
        RUNNER_MODULE,
        STANDINS,
        install_c_ascend,
        standin_modules,
    )
    from release_loader import ReleaseStack, classes_defining
    from runner_standin import PageSpec, make_runner_module

    import kda_patches
    from kda_patches.releases.fetch import release_dir

    root = release_dir("vllm-ascend", release)
    install_c_ascend()
    release_modules = [KIMI_MODULE, CLEAR_MODULE]
    for optional in (KDA_MODULE, PLAN_MODULE, "vllm_ascend.ops.triton.batch_memcpy",
                     "vllm_ascend.ops.triton.kda_state_copy_kernel"):
        if (root / (optional.replace(".", "/") + ".py")).exists():
            release_modules.append(optional)
    stack = ReleaseStack(root, "vllm-ascend", release, release_modules, real=REAL, inert=INERT,
                         standins=standin_modules(release),
                         modules={RUNNER_MODULE: make_runner_module(root / "vllm_ascend/worker/model_runner_v1.py",
                                                                    RUNNER_MODULE, "NPUModelRunner", PLAN_MODULE)}
                         ).install()
    # The worker imports its runner before the model's layer modules (the order a real worker has).
    runner_module = importlib.import_module(RUNNER_MODULE)
    kimi = importlib.import_module(KIMI_MODULE)
    (class_name,) = classes_defining(root / "vllm_ascend/ops/kimi_kda.py", "_run_prefill")
    cls = getattr(kimi, class_name)
    generator = torch.Generator().manual_seed(seed)
    layers = {f"model.layers.{i}.self_attn": build_layer(cls, f"model.layers.{i}.self_attn", generator)
              for i in range(LAYERS)}
    runner = runner_module.NPUModelRunner(layers, MAX_NUM_SEQS, seed)
    config = {name: PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype)) for name in layers}
    error = None
    try:
        runner.initialize_kv_cache(config)
    except Exception as caught:  # the parent decides whether this release may fail here
        error = f"{type(caught).__name__}: {caught}"
    outputs, snapshots = [], []
    if error is None:
        snapshots.append({name: raw.clone() for name, raw in runner.raw_caches.items()})
        for batch in BATCHES:
            tensors, indices, flags, metadata = batch_inputs(batch, generator)
            for layer in layers.values():
                outputs.append(layer._run_prefill(*tensors, layer.kv_cache[1], indices, flags, metadata))
            snapshots.append({name: raw.clone() for name, raw in runner.raw_caches.items()})
    fork_initialize = getattr(sys.modules.get(PLAN_MODULE), "initialize_kda_state_copy", None)
    torch.save({"outputs": outputs, "snapshots": snapshots, "ledger": kda_patches.get_ledger().snapshot(),
                "bound": stack.bound, "standins": STANDINS[release], "class": class_name, "init_error": error,
                "wrapped": type(vars(cls)["_run_prefill"]).__name__,
                "fork_initialize": type(fork_initialize).__name__,
                "fork_plan": [type(getattr(layer, "_ascend_kda_state_copy", None)).__name__
                              for layer in layers.values()]}, out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
