"""What :mod:`rebind034_child` executes of vLLM 0.34.0's extensible-KV-cache rebind, and what it stands in.

On top of :mod:`upstream034_standins` (the four seam layers, upstream's state ops, the V2 runner stand-in), the
rebind path is executed from the release (:data:`RELEASE_MODULES`):

- ``vllm.v1.worker.extensible_kv_cache``: ``ExtensibleKVCache`` (its ``allocate``, ``commit``,
  ``committed_kv_cache_tensors``, ``committed_views``), ``pad_kv_cache_segments``, ``ensure_kv_cache_blocks``,
  ``kv_cache_export_handle_types``, ``registers_kv_cache_memory`` and ``extend_kv_cache`` itself;
- ``vllm.utils.extensible_tensor`` (``ExtensibleTensor``, its granule bookkeeping and DLPack views) over
  ``vllm.utils.vmm_driver`` whose driver calls are the one thing stood in (:func:`cpu_vmm_driver`);
- ``vllm.v1.worker.gpu.attn_utils`` (``init_kv_cache``, ``bind_kv_caches``, ``get_shared_kv_cache_layers``),
  ``vllm.v1.worker.utils`` (``allocate_kv_cache``, ``layer_spec_for_tensor``, ``map_kv_caches_to_kernel_blocks``,
  ``bind_kv_cache_to_layers``), ``vllm.v1.kv_cache_interface`` (``KVCacheConfig``, ``KVCacheTensor``,
  ``MambaSpec``, ``create_kv_cache_views``), ``vllm.model_executor.layers.mamba.abstract`` (``MambaBase``:
  ``bind_kv_cache`` with ``state_alignment``, ``get_kv_cache_spec``) and ``...attention_layer_base``;
- ``vllm.v1.worker.gpu.kv_connector`` (``get_kv_connector``) and
  ``vllm.distributed.kv_transfer.kv_transfer_state`` (``ensure_kv_transfer_initialized``,
  ``has_kv_transfer_group``; the package's ``__init__``, byte-identical in 0.32 and 0.34, is the installed one):
  real, with their KV-connector imports real too -- the installed layers' own imports bring vLLM's KV-transfer
  stack into every released-code child anyway (``layers.linear`` -> ... -> ``v1.attention.backends.utils`` ->
  ``kv_connector.utils``), so leaving it out would save nothing;
- ``Worker.extend_kv_cache`` of ``vllm/v1/worker/gpu_worker.py``, compiled as written
  (:func:`release_loader.release_function`) into a stand-in ``vllm.v1.worker.gpu_worker`` module that holds
  ``extend_kv_cache`` by name, as the release's ``from vllm.v1.worker.extensible_kv_cache import extend_kv_cache``
  does: the alias the overlay must rebind.

:data:`STANDINS` is the written list (printed by the test with what each release file bound).
"""

from __future__ import annotations

import importlib
import pathlib
import types
from typing import Any

import torch
import upstream034_standins as base
from release_loader import release_function
from runner_standin import make_runner_module

EXTENSIBLE = "vllm.v1.worker.extensible_kv_cache"
TENSOR = "vllm.utils.extensible_tensor"
VMM = "vllm.utils.vmm_driver"
ATTN_UTILS = "vllm.v1.worker.gpu.attn_utils"
WORKER_UTILS = "vllm.v1.worker.utils"
KV_INTERFACE = "vllm.v1.kv_cache_interface"
MAMBA_BASE = "vllm.model_executor.layers.mamba.abstract"
LAYER_BASE = "vllm.model_executor.layers.attention_layer_base"
CONNECTOR = "vllm.v1.worker.gpu.kv_connector"
KV_TRANSFER = "vllm.distributed.kv_transfer"
GPU_WORKER = "vllm.v1.worker.gpu_worker"
GPU_WORKER_FILE = "vllm/v1/worker/gpu_worker.py"
KV_TRANSFER_STATE = f"{KV_TRANSFER}.kv_transfer_state"
RELEASE_MODULES = (EXTENSIBLE, TENSOR, VMM, ATTN_UTILS, WORKER_UTILS, KV_INTERFACE, MAMBA_BASE, LAYER_BASE,
                   CONNECTOR, KV_TRANSFER_STATE)
GRANULE = 2 << 20  # what the CUDA driver reports on an H200 (and ExtensibleTensor's floor)
KDL_CPU = 1  # DLPack device type of host memory

STANDINS = {
    f"{VMM}.get_vmm_driver (its driver calls only)": "a VmmDriver subclass (the release's class) whose ctypes "
    "calls are host-memory bookkeeping: reserve = one host buffer (poisoned bytes), create/map/set_access/unmap/"
    "release/free_reserved recorded, granularity 2 MiB, DLPack device kDLCPU; every call is listed per case",
    "torch.accelerator.synchronize (called by _VirtualBuffer.release_physical when a shrinking commit remaps)":
    "recorded, nothing to wait for (host memory)",
    "GPUModelRunner.device (extensible cases)": "cuda:0, the device ExtensibleTensor requires; the stand-in "
    "driver backs the reservation with host memory, so the views are CPU tensors (runner.kv_caches, filtered by "
    "device in extend_kv_cache, is empty; nothing reads it here)",
    f"{base.RUNNER_MODULE}.GPUModelRunner (stand-in class)": "runner_standin's V2 runner with 0.34's method "
    "signatures (read from the release file); __init__ sets device, vllm_config, cache_config, speculator None",
    f"{base.RUNNER_MODULE}.GPUModelRunner.initialize_kv_cache (stand-in body)": "runs the release's KV-cache lines "
    "of it: ExtensibleKVCache(config, self.device, layout, kv_cache_export_handle_types(...)) when extensible, "
    "init_kv_cache(..., allocate=extensible_kv_cache.allocate) -> allocate_kv_cache -> bind_kv_caches -> "
    "MambaBase.bind_kv_cache, kv_caches_by_layer, get_kv_connector; attention backends, block tables, CUDA "
    "graphs and model state are not built (attn_groups empty, kernel_block_sizes [block_size])",
    f"{GPU_WORKER} (stand-in module)": "holds extend_kv_cache by name (the release's import) and Worker with the "
    "release's Worker.extend_kv_cache compiled as written; the worker's sizing (measure_kv_cache_blocks: device "
    "memory after warmup) is not run: the final block count is the case's",
    "worker startup steps (stand-in sequence)": "pad_kv_cache_segments(config, layout, granule_size(0)) and "
    "ensure_kv_cache_blocks(runner, n) before the warmup prefills, as gpu_worker / the warmup do (both the "
    "release's functions); the KV cache config is built from the release layer's own get_kv_cache_spec "
    "(MambaSpec, page_size_padded leaves a gap per page) instead of vLLM's planner",
    "<layer> state attributes (set by the child, as __init__ would)": "model_config (dtype bfloat16), cache_config "
    "(the case's real CacheConfig: mamba_ssm_cache_dtype), conv_kernel_size / conv_size, num_heads / head_dim (K3), "
    "num_spec 0, tp_size 1, Qwen's _checkpoint_alignment None (no FlashInfer checkpoints): what the release's "
    "get_state_shape / get_state_dtype / get_kv_cache_spec read",
    "vllm_config (namespace)": "the fields the executed path reads: kv_transfer_config None, "
    "attention_config.hisparse_config None, num_speculative_tokens 0, compilation_config (static_forward_context = "
    "the layers), cache_config: installed 0.32's real CacheConfig (kv_cache_layout LBHNC, use_replayssm False, "
    "mamba_block_size 16, mamba_page_size_padded = the states + 160 bytes)",
}


def standins_list() -> dict[str, str]:
    """Return the written list for the rebind child: the released layers' stand-ins (:mod:`upstream034_standins`,
    less its runner and ``extend_kv_cache`` stub, which this child replaces) and :data:`STANDINS`."""
    replaced = (base.EXTENSIBLE_MODULE, f"{base.RUNNER_MODULE}.GPUModelRunner")
    layers = {name: what for kind in ("qwen", "k3") for name, what in base.STANDINS[kind].items()
              if not name.startswith(replaced)}
    return {**layers, **STANDINS}


def cpu_vmm_driver(vmm: types.ModuleType, calls: list[tuple]) -> Any:
    """Return a driver of the release's ``VmmDriver`` class whose driver calls use host memory (and are listed)."""

    class CpuVmmDriver(vmm.VmmDriver):
        dlpack_device_type = KDL_CPU

        def __init__(self) -> None:  # no driver library: nothing to load
            self.buffers: dict[int, torch.Tensor] = {}

        def ensure_context(self, device_index: int) -> None:
            calls.append(("ensure_context", device_index))

        def granularity(self, device_index: int) -> int:
            return GRANULE

        def reserve(self, size: int) -> int:
            buffer = torch.full((size,), 0xFF, dtype=torch.uint8)  # unbacked bytes read as NaN in FP32 and BF16
            self.buffers[buffer.data_ptr()] = buffer
            calls.append(("reserve", size))
            return buffer.data_ptr()

        def free_reserved(self, ptr: int, size: int) -> None:
            calls.append(("free_reserved", size))
            self.buffers.pop(ptr, None)

        def create(self, size: int, device_index: int, export_handle_types: int = 0) -> int:
            calls.append(("create", size, export_handle_types))
            return len(calls)

        def map(self, ptr: int, size: int, handle: int) -> None:
            calls.append(("map", self._offset(ptr), size))

        def set_access(self, ptr: int, size: int, device_index: int) -> None:
            calls.append(("set_access", self._offset(ptr), size))

        def unmap(self, ptr: int, size: int) -> None:
            calls.append(("unmap", self._offset(ptr), size))

        def release(self, handle: int) -> None:
            calls.append(("release", handle))

        def _offset(self, ptr: int) -> int:
            base_ptr = max(start for start in self.buffers if start <= ptr)
            return ptr - base_ptr

    return CpuVmmDriver()


def install_driver(calls: list[tuple]) -> None:
    """Import the release's ``vmm_driver`` and make ``get_vmm_driver`` return the host-memory driver (before
    ``extensible_tensor`` binds the name); ``torch.accelerator.synchronize`` is recorded (no device here)."""
    vmm = importlib.import_module(VMM)
    driver = cpu_vmm_driver(vmm, calls)
    vmm.get_vmm_driver = lambda: driver
    torch.accelerator.synchronize = lambda device=None: calls.append(("synchronize", device))


def fill_worker(module: types.ModuleType, root: pathlib.Path) -> None:
    """Fill the stand-in ``gpu_worker``: ``extend_kv_cache`` by name and ``Worker.extend_kv_cache`` (the release's).

    Call after the release's ``extensible_kv_cache`` is imported and before the overlay activates (so that the
    overlay finds the alias, as in vLLM, where ``gpu_worker`` is imported long before the plugin loads).
    """
    module.__file__ = str(root / GPU_WORKER_FILE)
    module.extend_kv_cache = importlib.import_module(EXTENSIBLE).extend_kv_cache
    method = release_function(root / GPU_WORKER_FILE, "Worker.extend_kv_cache", module.__dict__)

    def __init__(self: Any, runner: Any, kv_cache_config: Any, cache_config: Any) -> None:
        self.model_runner, self._kv_cache_config, self.cache_config = runner, kv_cache_config, cache_config

    module.Worker = type("Worker", (), {"__module__": GPU_WORKER, "__init__": __init__, "extend_kv_cache": method})


def _initialize_kv_cache(self: Any, kv_cache_config: Any, is_profiling: bool = False,
                         kv_cache_allocation_context: Any = None, extensible: bool = False) -> None:
    """The KV-cache lines of 0.34's ``GPUModelRunner.initialize_kv_cache``, with the release's functions."""
    from copy import deepcopy

    extensible_module = importlib.import_module(EXTENSIBLE)
    attn_utils = importlib.import_module(ATTN_UTILS)
    connector = importlib.import_module(CONNECTOR)
    kv_cache_config = deepcopy(kv_cache_config)
    self.kv_cache_config = kv_cache_config
    self.extensible_kv_cache = None
    if extensible:
        self.extensible_kv_cache = extensible_module.ExtensibleKVCache(
            kv_cache_config, self.device, self.cache_config.get_resolved_kv_cache_layout(),
            export_handle_types=extensible_module.kv_cache_export_handle_types(self.vllm_config))
    self.attn_groups = []
    self.kernel_block_sizes = [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups]
    allocate_fn = self.extensible_kv_cache.allocate if self.extensible_kv_cache is not None else None
    kv_caches_dict = attn_utils.init_kv_cache(
        self.compilation_config.static_forward_context, self.kv_cache_config, self.device, self.kernel_block_sizes,
        self.vllm_config, kv_cache_allocation_context=kv_cache_allocation_context, attn_groups=(),
        allocate=allocate_fn)
    self.kv_caches = [cache for cache in kv_caches_dict.values() if cache.device == self.device]
    self.kv_caches_by_layer = kv_caches_dict
    self.kv_connector = connector.get_kv_connector(self.vllm_config, kv_caches_dict)


def runner_module(root: pathlib.Path) -> types.ModuleType:
    """Return the stand-in V2 runner module (:func:`runner_standin.make_runner_module`: the release's signatures)
    whose ``initialize_kv_cache`` runs :func:`_initialize_kv_cache`."""
    module = make_runner_module(root / base.RUNNER_FILE, base.RUNNER_MODULE, "GPUModelRunner")
    cls = module.GPUModelRunner
    _initialize_kv_cache.__qualname__ = "GPUModelRunner.initialize_kv_cache"
    cls.initialize_kv_cache = _initialize_kv_cache

    def __init__(self: Any, layers: dict[str, Any], max_num_seqs: int, device: torch.device,
                 vllm_config: Any) -> None:
        cls.__mro__[1].__init__(self, layers, max_num_seqs, 0)
        self.device, self.vllm_config = device, vllm_config
        self.cache_config = vllm_config.cache_config
        self.speculator = None
        vllm_config.compilation_config = self.compilation_config

    cls.__init__ = __init__
    return module
