"""Child process: run vllm-ascend 0.30's released ``AscendGatedDeltaNetAttention._forward_core`` on the CPU.

``python ascend_gdn030_child.py RELEASE VARIANT SEED CACHE_DTYPE OUT`` (the shape of :mod:`ascend_gdn_child`);
``VARIANT`` = ``fla``: the FLA NPU prefill branch (``gather_ssm_states`` -> ``DeviceOperator.fla_gdn_prefill``
-> ``scatter_ssm_states_``). The release's ``gdn.py``, ``clear_ssm_states`` and ``state_index.py`` (the fork's
Triton gather/scatter, run by the interpreter) are imported under their real names, so the overlay's hooks
wrap them; device calls are stood in (:mod:`ascend_gdn030_standins`). Layers, metadata and the batch plan
are :mod:`ascend_gdn_child`'s and :mod:`batch_plan`'s, with what 0.30's builder adds: the prefill chunk
metadata (host fields; ``prepare_chunk_indices`` is the release's) and the decode ``actual_seq_lengths`` in
its ``[query_start_loc[0], len_0, ...]`` form. Saved as by :mod:`ascend_gdn_child`, plus ``"branch"``
(prefill calls per branch) and ``"kernel_launches"`` (the fork's state-index kernels).
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
import types

import torch
from ascend_gdn_child import bind_layers, metadata_of
from batch_plan import run_forward_core_batches

CHUNK_SIZE = 64  # gdn_attn_builder._GDN_CHUNK_SIZE


def chunk_metadata(prefill_query_start_loc: torch.Tensor, prepare_chunk_indices: object) -> types.SimpleNamespace:
    """Return the host fields of 0.30's ``GDNChunkedPrefillMetadata`` (``build_device_metadata=False``).

    No segment of the batch plan is empty, so ``cu_seqlens_kern`` / ``keep_meta`` are None (as the builder's
    ``_compact_empty_segments`` leaves them).
    """
    bounds = tuple(prefill_query_start_loc.to(torch.int64).tolist())
    assert all(end > start for start, end in itertools.pairwise(bounds)), "empty segment in the plan"
    indices = prepare_chunk_indices(prefill_query_start_loc, CHUNK_SIZE)
    device_fields = dict.fromkeys(("chunk_indices_chunk64", "chunk_offsets_chunk64", "update_chunk_offsets_chunk64",
                                   "final_chunk_indices_chunk64", "chunk_indices_large_block",
                                   "block_indices_cumsum"))
    return types.SimpleNamespace(cu_seqlens_host=bounds,
                                 chunk_indices_chunk64_host=tuple(indices.to(torch.int64).reshape(-1).tolist()),
                                 **device_fields, num_decodes=0, cu_seqlens_kern=None, keep_meta=None)


def fla_metadata_of(batch: tuple, metadata_class: type, prepare_chunk_indices: object) -> tuple[object, int]:
    """Return :func:`ascend_gdn_child.metadata_of`'s metadata with the fields 0.30's builder fills differently."""
    metadata, tokens = metadata_of(batch, metadata_class)
    starts, decodes = metadata.non_spec_query_start_loc, metadata.num_decodes
    if metadata.num_prefills:
        metadata.non_spec_prefill_metadata.chunk = chunk_metadata(metadata.prefill_query_start_loc,
                                                                  prepare_chunk_indices)
    if decodes:  # gdn_attn_builder._build_actual_seq_lengths(non_spec_query_start_loc, num_decodes)
        metadata.non_spec_decode_metadata.actual_seq_lengths = torch.cat(
            [starts[:1], starts[1:decodes + 1] - starts[:decodes]])
    return metadata, tokens


def main(release: str, variant: str, seed: int, cache_dtype: str, out: str) -> None:
    import ascend_gdn030_standins as standins
    from ascend_gdn_standins import GDN_MODULE, REAL_MODULES, GDNAttentionMetadata
    from ascend_standins import CLEAR_MODULE, INERT, REAL, RUNNER_MODULE
    from release_loader import ReleaseStack
    from runner_standin import make_runner_module

    import kda_patches
    from kda_patches.releases.fetch import release_dir

    if variant != "fla":
        raise SystemExit(f"variant {variant!r}: this child runs only the FLA prefill branch ('fla')")
    root = release_dir("vllm-ascend", release)
    standins.interpreter_accepts_integer_masks()
    runner = make_runner_module(root / "vllm_ascend/worker/model_runner_v1.py", RUNNER_MODULE, "NPUModelRunner")
    stack = ReleaseStack(root, "vllm-ascend", release, [GDN_MODULE, CLEAR_MODULE, standins.STATE_INDEX_MODULE],
                         real=REAL + REAL_MODULES, inert=INERT, standins=standins.gdn030_standin_modules(release),
                         modules={RUNNER_MODULE: runner}).install()
    runner_module = importlib.import_module(RUNNER_MODULE)  # the worker's runner first
    gdn = importlib.import_module(GDN_MODULE)
    launches = standins.count_kernel_launches(sys.modules[standins.STATE_INDEX_MODULE])
    prepare_chunk_indices = sys.modules[CLEAR_MODULE].prepare_chunk_indices

    cls = gdn.AscendGatedDeltaNetAttention
    layers, runner, generator = bind_layers(cls, runner_module.NPUModelRunner, seed, cache_dtype)
    outputs, snapshots = run_forward_core_batches(
        layers, runner.raw_caches, lambda batch: fla_metadata_of(batch, GDNAttentionMetadata, prepare_chunk_indices),
        generator)
    torch.save({"outputs": outputs, "snapshots": snapshots, "ledger": kda_patches.get_ledger().snapshot(),
                "bound": stack.bound, "standins": standins.STANDINS, "class": cls.__qualname__, "init_error": None,
                "wrapped": type(vars(cls)["_forward_core"]).__name__, "fused": bool(cls._probe_fused_chunk()),
                "branch": dict(standins.BRANCH_CALLS), "kernel_launches": dict(launches)}, out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
