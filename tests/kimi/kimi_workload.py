"""The reference Kimi prefill workload: deterministic batches through the reference layers, baseline or patched.

Used three ways: in-process by the pytest suite, as an A/B workload in fresh interpreters
(``run_ab(Workload(target="kimi_workload:run_reference_workload"), pythonpath=(tests/kimi,))`` -- the
baseline gets ``KDA_PATCHES=0``, the patched run ``KDA_PATCHES=1``), and by the H200 script with realistic
shapes. Batches vary the sequence count, the lengths (chunk-size multiples and not), the
``has_initial_state`` flags and the cache rows; later batches reuse rows written by earlier ones, so a
wrong scatter shows up in a later gather. All rows are valid: pad/invalid indices are the one place where
patched and baseline legitimately differ, and have their own test.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch

REFERENCE_MODULES = ("kimi_variant_layer", "kimi_ascend_layer", "kimi_upstream_layer", "kimi_runner")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
# (sequences, shortest, longest): 1..64 sequences, lengths 1..1024, chunk-size multiples and not.
CPU_BATCHES: tuple[tuple[int, int, int], ...] = ((1, 1, 1), (5, 63, 129), (6, 1, 1024), (64, 1, 96))
SMALL_BATCHES: tuple[tuple[int, int, int], ...] = ((1, 1, 1), (5, 63, 129), (12, 1, 200))


@dataclass
class Batch:
    """One prefill batch: inputs, cache rows and flags (all on the target device)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    raw_gate: torch.Tensor
    beta: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    cu_seqlens: tuple[int, ...]
    cu_seqlens_device: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Total tokens of the batch."""
        return self.cu_seqlens[-1]


def reference_patch(name: str = "kimi_prefill_reference", variant: bool = False) -> Any:
    """Return the kimi_prefill record built for the reference modules (``variant``: the index_select fork)."""
    from kda_patches.patches import kimi_prefill
    from kda_patches.routing import eras

    runners = (("kimi_runner", "GPUModelRunner", eras.VLLM_RUNNER_PARAMETERS),
               ("kimi_runner", "NPUModelRunner", eras.ASCEND_RUNNER_PARAMETERS))
    if variant:
        return kimi_prefill.build_patch(name, ascend=("kimi_variant_layer", "IndexSelectKimiK3DeltaAttention"),
                                        runners=runners)
    return kimi_prefill.build_patch(name, ascend=("kimi_ascend_layer", "AscendKimiK3DeltaAttention"),
                                    upstream=("kimi_upstream_layer", "KimiK3DeltaAttention"), runners=runners)


def load_reference_modules(patch: Any = None, strict: bool = False) -> dict[str, Any]:
    """Forget the reference modules, register ``patch`` (if any), then import them afresh and return them.

    The patch is registered while its modules are not imported, so it is applied by the post-import
    hooks when they load -- the path the real stacks take.
    """
    for name in REFERENCE_MODULES:
        sys.modules.pop(name, None)
    if patch is not None:
        from kda_patches.registry import register_patch, revert_patch

        revert_patch(patch)  # a record of the same name from an earlier load would make registering a no-op
        register_patch(patch, strict=strict)
    return {name: importlib.import_module(name) for name in REFERENCE_MODULES}


def make_batch(generator: torch.Generator, rng: random.Random, lengths: list[int], rows: list[int],
               flags: list[bool], heads: int, head_dim: int, index_dtype: torch.dtype, input_dtype: torch.dtype,
               device: torch.device) -> Batch:
    """Return a batch with random inputs for sequences of ``lengths`` stored in cache ``rows``."""
    total = sum(lengths)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=generator.device).to(device=device, dtype=input_dtype)

    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return Batch(q=draw(1, total, heads, head_dim), k=draw(1, total, heads, head_dim),
                 v=draw(1, total, heads, head_dim), raw_gate=draw(1, total, heads, head_dim),
                 beta=torch.rand(1, total, heads, generator=generator, device=generator.device).to(device=device,
                                                                                                    dtype=input_dtype),
                 state_indices=torch.tensor(rows, dtype=index_dtype, device=device),
                 has_initial_state=torch.tensor(flags, dtype=torch.bool, device=device),
                 cu_seqlens=tuple(cu), cu_seqlens_device=torch.tensor(cu, dtype=torch.int32, device=device))


def make_batches(seed: int, num_rows: int, heads: int, head_dim: int, index_dtype: torch.dtype,
                 input_dtype: torch.dtype, device: torch.device,
                 shapes: tuple[tuple[int, int, int], ...] = CPU_BATCHES) -> list[Batch]:
    """Return deterministic batches: per ``(num_seqs, min_len, max_len)`` random lengths, rows and flags.

    The first and last sequence of each batch take ``min_len`` and ``max_len``; flags are mixed (the first
    false, the second true when there are two). Inputs are drawn on ``device`` (CUDA draws differ from CPU
    draws; each is deterministic).
    """
    rng = random.Random(seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    batches = []
    for num_seqs, low, high in shapes:
        lengths = [rng.randint(low, high) for _ in range(num_seqs)]
        lengths[0], lengths[-1] = low, high
        flags = [rng.random() < 0.6 for _ in range(num_seqs)]
        flags[0] = False
        if num_seqs > 1:
            flags[1] = True
        rows = rng.sample(range(num_rows), num_seqs)
        batches.append(make_batch(generator, rng, lengths, rows, flags, heads, head_dim, index_dtype, input_dtype,
                                  device))
    return batches


def fill_state(state: torch.Tensor, seed: int) -> None:
    """Overwrite every cache row (not the gaps) with deterministic values of the cache dtype."""
    generator = torch.Generator(device=state.device).manual_seed(seed)
    state.copy_(torch.randn(state.shape, generator=generator, device=state.device).to(state.dtype))


def run_ascend_batch(layer: Any, batch: Batch, state: torch.Tensor, chunk_metadata: Any) -> torch.Tensor:
    """Call the ascend-shaped layer's ``_run_prefill`` for one batch (as its ``_forward`` would)."""
    metadata = chunk_metadata(cu_seqlens_host=batch.cu_seqlens, cu_seqlens_kern=batch.cu_seqlens_device)
    return layer._run_prefill(batch.q, batch.k, batch.v, batch.raw_gate, batch.beta, state, batch.state_indices,
                              batch.has_initial_state, metadata)


def run_upstream_batch(layer: Any, batch: Batch, metadata_class: Any) -> torch.Tensor:
    """Call the upstream-shaped layer's ``_forward`` for one prefill batch under a real vLLM forward context."""
    from vllm.forward_context import ForwardContext, override_forward_context

    metadata = metadata_class(num_prefills=len(batch.cu_seqlens) - 1, num_decodes=0,
                              has_initial_state=batch.has_initial_state,
                              non_spec_state_indices_tensor=batch.state_indices,
                              non_spec_query_start_loc=batch.cu_seqlens_device, cu_seqlens_host=batch.cu_seqlens)
    mixed_qkv = torch.cat([part[0].flatten(1) for part in (batch.q, batch.k, batch.v)], dim=-1)
    out = torch.zeros_like(batch.v)
    context = ForwardContext(no_compile_layers={layer.prefix: layer}, attn_metadata={layer.prefix: metadata},
                             slot_mapping={})
    with override_forward_context(context):
        layer._forward(mixed_qkv, batch.raw_gate, None, batch.beta, out)
    return out


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (exact comparison, NaN payloads and -0 included)."""
    raw = tensor.detach().contiguous().cpu()
    return hashlib.sha256(raw.view(torch.uint8).numpy().tobytes()).hexdigest()


def raw_bits(raw: torch.Tensor) -> torch.Tensor:
    """The raw cache buffer reinterpreted as integers of the same width (every byte, gaps included)."""
    return raw.detach().cpu().view(torch.int16 if raw.element_size() == 2 else torch.int32)


@dataclass
class World:
    """A runner, its reference layers (by name) and the cache config it initializes them with."""

    runner: Any
    layers: dict[str, Any]
    config: Any
    modules: dict[str, Any]
    upstream: bool


def layer_class(modules: dict[str, Any], upstream: bool = False, variant: bool = False) -> Any:
    """Return the reference layer class: upstream-shaped, the index_select fork, or the ascend-shaped one."""
    if upstream:
        return modules["kimi_upstream_layer"].KimiK3DeltaAttention
    if variant:
        return modules["kimi_variant_layer"].IndexSelectKimiK3DeltaAttention
    return modules["kimi_ascend_layer"].AscendKimiK3DeltaAttention


def build_world(modules: dict[str, Any], *, upstream: bool = False, variant: bool = False,
                cache_dtype: torch.dtype = torch.float32, num_layers: int = 1, num_rows: int = 80, heads: int = 2,
                head_dim: int = 8, max_num_seqs: int = 64, seed: int = 0, device: str | torch.device = "cpu",
                specs: dict[int, Any] | None = None, runner: str = "GPUModelRunner") -> World:
    """Build reference layers and a runner (nothing allocated yet; see :func:`start_world`).

    Args:
        modules: from :func:`load_reference_modules`.
        specs: layer number -> :class:`kimi_runner.StateCacheSpec` overriding the default spec.
        runner: ``"GPUModelRunner"`` or ``"NPUModelRunner"`` (the reference runner classes).
    """
    cls = layer_class(modules, upstream, variant)
    target = torch.device(device)
    layers = {f"model.layers.{number}.self_attn": cls(f"model.layers.{number}.self_attn", heads, head_dim,
                                                      seed=seed + number, device=target)
              for number in range(num_layers)}
    runner_module = modules["kimi_runner"]
    specs = specs or {}
    config = runner_module.KVCacheConfig({name: specs.get(number, runner_module.StateCacheSpec(num_rows, cache_dtype))
                                          for number, name in enumerate(layers)})
    return World(getattr(runner_module, runner)(layers, max_num_seqs, target), layers, config, modules, upstream)


def start_world(world: World, seed: int = 0) -> None:
    """Initialize the KV cache through the runner (the startup hook publishes plans when patched); fill states."""
    world.runner.initialize_kv_cache(world.config)
    for number, layer in enumerate(world.layers.values()):
        fill_state(layer.kv_cache[1], seed + 100 + number)


def run_batch(world: World, layer: Any, batch: Batch) -> torch.Tensor:
    """Run one prefill batch through ``layer`` the way its fork does (``_run_prefill`` or ``_forward``)."""
    if world.upstream:
        return run_upstream_batch(layer, batch, world.modules["kimi_upstream_layer"].KDAMetadata)
    return run_ascend_batch(layer, batch, layer.kv_cache[1], world.modules["kimi_ascend_layer"].PrefillChunkMetadata)


def run_world(world: World, seed: int = 0, index_dtype: torch.dtype = torch.int32,
              shapes: tuple[tuple[int, int, int], ...] = CPU_BATCHES) -> list[torch.Tensor]:
    """Run the deterministic batches through every layer of ``world``; return the outputs in order."""
    outputs = []
    for number, layer in enumerate(world.layers.values()):
        state = layer.kv_cache[1]
        for batch in make_batches(seed + number, state.shape[0], layer.num_heads, layer.head_dim, index_dtype,
                                  torch.bfloat16, state.device, shapes):
            outputs.append(run_batch(world, layer, batch))
    return outputs


def prefill_counters() -> dict[str, int]:
    """Return a copy of this process's ``kimi_prefill`` ledger counters."""
    from kda_patches.ledger import get_ledger

    return get_ledger().counters("kimi_prefill")


def run_reference_workload(cache_dtype: str = "float32", index_dtype: str = "int32", seed: int = 0,
                           num_rows: int = 80, heads: int = 2, head_dim: int = 8, num_layers: int = 2,
                           upstream: bool = False, device: str = "cpu", shapes: str = "full") -> dict[str, Any]:
    """Run the reference workload once; the overlay decides (from ``KDA_PATCHES*``) whether it is patched.

    ``shapes`` picks the batch set: ``"full"`` (:data:`CPU_BATCHES`) or ``"small"`` (:data:`SMALL_BATCHES`).

    When the ``kimi_prefill`` patch is enabled in this process, its record is rebuilt for the reference
    modules (same name, so the ledger counts under ``kimi_prefill``) and registered before they are
    imported; the runner's startup hook then publishes the plans.

    Returns:
        ``{"outputs": [sha256 per layer and batch], "caches": {layer: raw bits}, "tokens": int}``.
    """
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kda_patches import current_flags
    from kda_patches.patches import kimi_prefill
    from kda_patches.registry import revert_patch

    flags = current_flags()
    patch = None
    if flags.patch_enabled("kimi_prefill"):
        revert_patch(kimi_prefill.PATCH)  # the real stacks' targets: replaced by the reference modules'
        patch = reference_patch("kimi_prefill")
    modules = load_reference_modules(patch, flags.strict)
    world = build_world(modules, upstream=upstream, cache_dtype=DTYPES[cache_dtype], num_layers=num_layers,
                        num_rows=num_rows, heads=heads, head_dim=head_dim, seed=seed, device=device)
    start_world(world, seed)
    outputs = run_world(world, seed, DTYPES[index_dtype], CPU_BATCHES if shapes == "full" else SMALL_BATCHES)
    return {"outputs": [digest(out) for out in outputs], "tokens": sum(out.shape[1] for out in outputs),
            "caches": {name: raw_bits(raw) for name, raw in world.runner.raw_caches.items()}}
