"""Child process: vLLM 0.34.0's extensible-KV-cache rebind executed on the CPU, every case in one process.

``python rebind034_child.py ROOT SEED CASE... OUT``: ``ROOT`` is the release's folder (the parent fetches it),
``CASE`` is ``LAYER:SSM_DTYPE:MODE`` with ``LAYER`` ``qwen`` or ``k3`` (:data:`upstream034_standins.LAYERS`) and
``MODE`` ``grow`` or ``shrink`` (the extensible KV cache, vLLM 0.34's default: warmup commits fewer or more blocks
than the final count, :data:`WARMUP_BLOCKS`) or ``fixed`` (``--no-enable-extensible-kv-cache``). The parent runs
the same cases with ``KDA_PATCHES=0`` and with the overlay on (``KDA_PATCHES_GDN_OPS=overlay``, so Qwen's seam is
routed too).

The frame is :mod:`upstream034_child`'s (the release's files under their real names on the installed vLLM 0.32,
the overlay activated after the runner group is imported, as vLLM's plugin is); :mod:`rebind034_standins` adds
the rebind path, executed from the release. Each extensible case runs the startup order of 0.34's
``engine/core.py``:

1. ``pad_kv_cache_segments`` (the worker), then ``initialize_kv_cache(extensible=True)``: ``ExtensibleKVCache``
   reserves :data:`CAPACITY` blocks, commits the null block, and ``init_kv_cache`` binds every layer's views over
   the whole reservation (``shape[0]`` = capacity) through ``bind_kv_caches`` -> ``MambaBase.bind_kv_cache``; the
   overlay's startup hook prepares the plans (compiles counted here);
2. warmup: ``ensure_kv_cache_blocks`` commits :data:`WARMUP_BLOCKS` of the mode, then the batch plan runs
   through the layers (prefills on the capacity views);
3. ``Worker.extend_kv_cache(FINAL_BLOCKS)`` (the release's method, calling ``extend_kv_cache`` through
   ``gpu_worker``'s by-name alias): commit (``shrink``: fewer blocks than warmup committed, so the release
   remaps the reservation: every chunk unmapped and released, the final blocks mapped again and zeroed -- the same
   addresses), ``committed_views``, ``bind_kv_caches`` rebinds every layer (``shape[0]`` = :data:`FINAL_BLOCKS`,
   same pointer and strides), ``get_kv_connector``;
4. the batch plan again on the rebound views.

A ``fixed`` case allocates :data:`FINAL_BLOCKS` up front (``allocate_kv_cache``'s own zeroed buffer) and runs
the batch plan once; nothing is rebound.

Before each batch plan every byte of each layer's region that is not a live state row (page gaps, and on the
reservation the rows past the committed blocks) holds 0xFF (NaN in FP32 and BF16), live rows random values;
:func:`poison_problems` reports any poisoned byte changed afterwards. ``variants.compile_variant`` calls are
counted from before ``initialize_kv_cache`` on, per phase.

Saved (``torch.save``): ``cases`` -> per case ``warmup`` / ``final`` (``(outputs, snapshots)`` of the batch
plan), ``poison`` / ``poison_warmup``, ``compiles`` per phase, ``views`` (rows, pointer relative to the buffer and
strides of each layer's states before and after the rebind), ``bindings`` (whether each layer's published binding
is the same object afterwards), ``facts`` / ``facts_before``, ``counters``, ``driver`` (the stand-in driver calls),
``launches`` (upstream's two state kernels); and ``wrapped``, ``ledger``, ``status``, ``bound``, ``standins``,
``files`` (the file each function on the rebind path came from), ``connector_modules``, ``seconds``.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys
import time
import types
from typing import Any

import torch
from batch_child import counter_delta

RELEASE = "0.34.0"
CAPACITY, FINAL_BLOCKS = 24, 12  # blocks: reserved by the extensible cache, final (after extend_kv_cache)
WARMUP_BLOCKS = {"grow": 9, "shrink": 16}  # committed before the warmup prefills (rows 1-8 are used)
BLOCK_SIZE, GAP_BYTES, POISON = 16, 160, 0xFF
SECTIONS = ("gdn_state_copy", "kimi_prefill")


def parse_case(case: str) -> tuple[str, str, str]:
    """``"qwen:bfloat16:grow"`` -> ``("qwen", "bfloat16", "grow")``."""
    kind, dtype, mode = case.split(":")
    return kind, dtype, mode


class CompileCounter:
    """Counts ``kda_patches.state_copy.variants.compile_variant`` calls (under both names it is bound to)."""

    def __init__(self) -> None:
        from kda_patches.state_copy import plan, variants

        self.count = 0
        original = variants.compile_variant

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        variants.compile_variant = counted
        plan.compile_variant = counted


def prepare_layer(layer: torch.nn.Module, kind: str, cache_config: Any) -> torch.nn.Module:
    """Set what the release layer's ``get_state_shape`` / ``get_state_dtype`` / ``get_kv_cache_spec`` read."""
    from batch_plan import CONV_WIDTH, HEAD_DIM, HEADS

    values = {"model_config": types.SimpleNamespace(dtype=torch.bfloat16), "cache_config": cache_config,
              "num_spec": 0, "tp_size": 1}
    values.update({"conv_kernel_size": CONV_WIDTH, "_checkpoint_alignment": None} if kind == "qwen" else
                  {"conv_size": CONV_WIDTH, "num_heads": HEADS, "head_dim": HEAD_DIM})
    for key, value in values.items():
        object.__setattr__(layer, key, value)
    return layer


def regions(layers: dict[str, Any], full: torch.Tensor, blocks: int) -> dict[str, torch.Tensor]:
    """Return each layer's byte region of ``full`` (its ``blocks`` pages from block 0), found by pointer."""
    found = {}
    for name, layer in layers.items():
        conv = layer.kv_cache[0]  # the first state: page offset 0
        start = conv.data_ptr() - full.data_ptr()
        found[name] = full[start:start + blocks * conv.stride(0) * conv.element_size()]
    return found


def live_mask(layer: Any, region: torch.Tensor, rows: int) -> torch.Tensor:
    """Return the bytes of ``region`` that belong to the layer's state rows ``[0, rows)`` (every state)."""
    mask = torch.zeros(region.numel(), dtype=torch.bool)
    for state in layer.kv_cache:
        size = state[0].numel() * state.element_size()
        assert state[0].is_contiguous(), f"state {tuple(state.shape)} has a non-contiguous row"
        for row in range(rows):
            start = state.data_ptr() - region.data_ptr() + row * state.stride(0) * state.element_size()
            mask[start:start + size] = True
    return mask


def fill(layers: dict[str, Any], raw: dict[str, torch.Tensor], rows: int, generator: torch.Generator,
         fresh: bool) -> None:
    """Poison every byte outside the live rows; with ``fresh``, give the live rows random values."""
    for name, layer in layers.items():
        mask = live_mask(layer, raw[name], rows)
        raw[name][~mask] = POISON
        if fresh:
            for state in layer.kv_cache:
                state[:rows].copy_(torch.randn(state[:rows].shape, generator=generator))


def poison_problems(layers: dict[str, Any], raw: dict[str, torch.Tensor], rows: int) -> list[str]:
    """Return which layers have a poisoned byte (outside the live rows) changed; empty when all are intact."""
    problems = []
    for name, layer in layers.items():
        outside = raw[name][~live_mask(layer, raw[name], rows)]
        if not bool((outside == POISON).all()):
            problems.append(f"{name}: {int((outside != POISON).sum())} poisoned bytes changed")
    return problems


def view_facts(layers: dict[str, Any], full: torch.Tensor, slot: int) -> dict[str, dict[str, Any]]:
    """Rows, pointer (relative to the buffer) and strides of each layer's state ``slot``."""
    return {name: {"rows": int(layer.kv_cache[slot].shape[0]), "offset": layer.kv_cache[slot].data_ptr()
                   - full.data_ptr(), "strides": list(layer.kv_cache[slot].stride()),
                   "inner": list(layer.kv_cache[slot].shape[1:])} for name, layer in layers.items()}


def main(root_text: str, seed: int, out: str, cases: list[str]) -> None:
    started = time.monotonic()
    seconds: dict[str, float] = {}
    import rebind034_standins as rebind
    import upstream034_standins as base
    import vllm
    from ascend_gdn030_standins import count_kernel_launches, interpreter_accepts_integer_masks
    from batch_plan import MAX_NUM_SEQS
    from release_loader import ReleaseStack

    assert "kda_patches" not in sys.modules, "the overlay was activated before the release's runner group was imported"
    vllm.__version__ = RELEASE
    root = pathlib.Path(root_text)
    interpreter_accepts_integer_masks()
    base.interpreter_rounds_bf16_downcasts()
    release_modules = (*base.RELEASE_MODULES, *rebind.RELEASE_MODULES)
    early = sorted(set(release_modules) & set(sys.modules))
    assert not early, f"installed modules already imported under release names (would shadow the release): {early}"
    worker_module = types.ModuleType(rebind.GPU_WORKER)
    stack = ReleaseStack(root, "", RELEASE, release_modules, real=base.REAL, absent_inert=True,
                         standins=base.standin_modules(), lifted=base.LIFTED,
                         modules={base.RUNNER_MODULE: rebind.runner_module(root),
                                  rebind.GPU_WORKER: worker_module}).install()
    driver_calls: list[tuple] = []
    rebind.install_driver(driver_calls)
    runner_module = importlib.import_module(base.RUNNER_MODULE)
    extensible = importlib.import_module(rebind.EXTENSIBLE)
    rebind.fill_worker(worker_module, root)
    gpu_worker = importlib.import_module(rebind.GPU_WORKER)
    import kda_patches  # activated now, as vLLM's plugin is: after gpu_worker bound extend_kv_cache by name
    from kda_patches.cli import format_ledger
    from kda_patches.routing.proof import PLAN_ATTRIBUTE

    compiles = CompileCounter()
    base.install()
    tables = [count_kernel_launches(importlib.import_module(module), (kernel,)) for module, kernel in base.KERNELS]

    def launched() -> dict[str, int]:
        return {name: count for table in tables for name, count in table.items()}

    kv_interface = importlib.import_module(rebind.KV_INTERFACE)
    granule = importlib.import_module(rebind.TENSOR).granule_size(0)
    from vllm.config import CacheConfig

    base.set_conv_layout("DS")
    seconds["setup"] = time.monotonic() - started
    results, keep = {}, []  # keep: every case's runner lives to the end (its reservation is not freed mid-run)
    for index, case in enumerate(cases):
        kind, ssm_dtype, mode = parse_case(case)
        module_name, class_name, method = base.LAYERS[kind]
        cls = getattr(importlib.import_module(module_name), class_name)
        generator = torch.Generator().manual_seed(seed + 7919 * (index + 1))
        cache_config = CacheConfig(mamba_ssm_cache_dtype=ssm_dtype, mamba_block_size=BLOCK_SIZE)
        cache_config.kv_cache_layout = "LBHNC"
        vllm_config = types.SimpleNamespace(
            cache_config=cache_config, kv_transfer_config=None, num_speculative_tokens=0,
            attention_config=types.SimpleNamespace(hisparse_config=None))
        names = [f"model.layers.{2 * index + i}.{base.SUFFIX[kind]}" for i in range(2)]
        layers = {name: prepare_layer(base.build_layer(kind, cls, name, generator), kind, cache_config)
                  for name in names}
        first = next(iter(layers.values()))
        cache_config.mamba_page_size_padded = first.get_kv_cache_spec(vllm_config).page_size_bytes + GAP_BYTES
        spec = first.get_kv_cache_spec(vllm_config)  # the release's MambaSpec, a gap at the end of each page
        page = spec.page_size_bytes
        blocks = FINAL_BLOCKS if mode == "fixed" else CAPACITY
        config = kv_interface.KVCacheConfig(
            num_blocks=blocks, kv_cache_groups=[kv_interface.KVCacheGroupSpec(names, spec)],
            kv_cache_tensors=[kv_interface.KVCacheTensor(size=len(names) * blocks * page, layers=names,
                                                         layer_stride=blocks * page, block_stride=page)])
        device = torch.device("cpu") if mode == "fixed" else torch.device("cuda", 0)
        runner = runner_module.GPUModelRunner(layers, MAX_NUM_SEQS, device, vllm_config)
        keep.append(runner)
        before, calls_before, launches_before = kda_patches.get_ledger().snapshot(), len(driver_calls), launched()
        phase = {"startup": compiles.count}
        result: dict[str, Any] = {"page": page, "spec": repr(spec), "facts_before": {
            section: before.get("facts", {}).get(section, {}).get("rebind") for section in SECTIONS}}
        if mode != "fixed":
            config = extensible.pad_kv_cache_segments(config, cache_config.get_resolved_kv_cache_layout(), granule)
            worker = gpu_worker.Worker(runner, config, cache_config)
            runner.initialize_kv_cache(config, False, None, True)
            phase["startup"] = compiles.count - phase["startup"]
            extensible.ensure_kv_cache_blocks(runner, WARMUP_BLOCKS[mode])
            full = runner.extensible_kv_cache.buffer.full_view()
            raw = regions(layers, full, CAPACITY)
            fill(layers, raw, WARMUP_BLOCKS[mode], generator, fresh=True)
            mark = compiles.count
            result["warmup"] = base.run_batches(kind, layers, raw, generator)
            result["poison_warmup"] = poison_problems(layers, raw, WARMUP_BLOCKS[mode])
            result["committed_warmup"] = runner.extensible_kv_cache.num_committed_blocks
            phase["warmup"] = compiles.count - mark
            views_before = {slot: view_facts(layers, full, slot) for slot in (0, 1)}
            bindings = {name: getattr(layer, PLAN_ATTRIBUTE, None) for name, layer in layers.items()}
            mark = compiles.count
            worker.extend_kv_cache(FINAL_BLOCKS)
            phase["extend"] = compiles.count - mark
            result["views"] = {"before": views_before, "after": {slot: view_facts(layers, full, slot)
                                                                 for slot in (0, 1)}}
            result["bindings"] = {name: {"before": binding is not None,
                                         "same": getattr(layers[name], PLAN_ATTRIBUTE, None) is binding}
                                  for name, binding in bindings.items()}
            result["committed"] = runner.extensible_kv_cache.num_committed_blocks
            result["runner_num_blocks"] = runner.kv_cache_config.num_blocks
            result["worker_num_gpu_blocks"] = cache_config.num_gpu_blocks
            fill(layers, raw, FINAL_BLOCKS, generator, fresh=False)  # extend's commit zeroed what it mapped
        else:
            runner.initialize_kv_cache(config, False, None, False)
            phase["startup"] = compiles.count - phase["startup"]
            full = next(iter(runner.kv_caches_by_layer.values()))
            full = torch.empty(0, dtype=torch.uint8).set_(full.untyped_storage())
            raw = regions(layers, full, FINAL_BLOCKS)
            fill(layers, raw, FINAL_BLOCKS, generator, fresh=True)
            result["views"] = {"before": {slot: view_facts(layers, full, slot) for slot in (0, 1)}}
            bindings = {name: getattr(layer, PLAN_ATTRIBUTE, None) for name, layer in layers.items()}
        mark = compiles.count
        result["final"] = base.run_batches(kind, layers, raw, generator)
        phase["serve"] = compiles.count - mark
        result["poison"] = poison_problems(layers, raw, FINAL_BLOCKS)
        if mode == "fixed":
            result["bindings"] = {name: {"before": binding is not None,
                                         "same": getattr(layers[name], PLAN_ATTRIBUTE, None) is binding}
                                  for name, binding in bindings.items()}
        after = kda_patches.get_ledger().snapshot()
        result.update({
            "compiles": phase, "counters": counter_delta(before, after), "driver": driver_calls[calls_before:],
            "launches": {name: count - launches_before[name] for name, count in launched().items()},
            "facts": {section: {key: after.get("facts", {}).get(section, {}).get(key)
                                for key in (*names, "rebind")} for section in SECTIONS},
            "class": cls.__qualname__, "layer_file": getattr(cls, method).__code__.co_filename,
            "bind_kv_cache": type(first).bind_kv_cache.__code__.co_filename})
        results[case] = result
        seconds[case] = time.monotonic() - started - sum(seconds.values())
    snapshot = kda_patches.get_ledger().snapshot()
    wrapped = {"extensible": type(extensible.extend_kv_cache).__name__,
               "alias_is_module_attribute": gpu_worker.extend_kv_cache is extensible.extend_kv_cache,
               "worker_method_file": gpu_worker.Worker.extend_kv_cache.__code__.co_filename,
               "extend_file": getattr(extensible.extend_kv_cache, "__wrapped__",
                                      extensible.extend_kv_cache).__code__.co_filename}
    package = importlib.import_module(rebind.KV_TRANSFER)
    functions = {"extend_kv_cache": getattr(extensible.extend_kv_cache, "__wrapped__", extensible.extend_kv_cache),
                 "ExtensibleKVCache.commit": extensible.ExtensibleKVCache.commit,
                 "ExtensibleTensor.resize_segments_":
                 importlib.import_module(rebind.TENSOR).ExtensibleTensor.resize_segments_,
                 "bind_kv_caches": importlib.import_module(rebind.ATTN_UTILS).bind_kv_caches,
                 "allocate_kv_cache": importlib.import_module(rebind.WORKER_UTILS).allocate_kv_cache,
                 "create_kv_cache_views": kv_interface.create_kv_cache_views,
                 "MambaBase.bind_kv_cache": importlib.import_module(rebind.MAMBA_BASE).MambaBase.bind_kv_cache,
                 "get_kv_connector": importlib.import_module(rebind.CONNECTOR).get_kv_connector,
                 "kv_transfer.ensure_kv_transfer_initialized": package.ensure_kv_transfer_initialized,
                 "kv_transfer.has_kv_transfer_group": package.has_kv_transfer_group}
    files = {name: function.__code__.co_filename for name, function in functions.items()}
    connectors = sorted(name for name in sys.modules if name.startswith(f"{rebind.KV_TRANSFER}.kv_connector"))
    seconds["total"] = time.monotonic() - started
    torch.save({"cases": results, "ledger": snapshot, "bound": stack.bound, "wrapped": wrapped,
                "connector_modules": connectors, "files": files, "seconds": seconds,
                "standins": rebind.standins_list(),
                "status": format_ledger(snapshot)}, out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], int(sys.argv[2]), sys.argv[-1], sys.argv[3:-1])
