"""vLLM 0.34's own KV cache of a real model, allocated extensible and rebound, executed on the CPU.

:class:`Upstream034Stack` serves the vLLM release from the release cache
(:class:`~kda_patches.kv_layout.release_exec.ReleaseTree`; nothing is imported from the installed vLLM) and runs, for
one model and tensor-parallel size, the code that decides and builds the KV cache on CUDA with the engine's
defaults (the extensible KV cache on):

1. block size and Mamba page padding: the model class's ``get_mamba_state_shape_from_config`` /
   ``get_mamba_state_dtype_from_config`` and ``Platform.update_block_size_for_backend`` (which aligns hybrid
   models through ``_align_hybrid_block_size``), with the attention backend the CUDA platform ranks first for the
   model on an H100 (:data:`BACKENDS`);
2. the layers' specs (``Attention`` / ``MLAAttention`` / ``MambaBase.get_kv_cache_spec``), the layout
   (``resolve_kv_cache_layout`` over the backends' declared layouts), the planner
   (``get_global_kv_cache_groups`` and ``get_kv_cache_configs``, ``num_gpu_blocks_override`` = the capacity);
3. the worker's ``pad_kv_cache_segments``, the runner's ``ExtensibleKVCache`` (address space reserved for the
   capacity, the null block committed) and ``init_kv_cache`` -> ``allocate_kv_cache`` (``create_kv_cache_views``
   over the whole reservation) -> ``bind_kv_caches`` -> each layer's ``bind_kv_cache``; ``prepare_kernel_block_sizes``
   and ``select_common_block_size`` give the kernel block sizes;
4. warmup's ``ensure_kv_cache_blocks`` (a prefix committed), then ``extend_kv_cache`` (the rebind after warmup:
   ``commit`` of the final block count, ``committed_views`` rebuilt over segment views of the committed bytes,
   ``bind_kv_caches`` again, ``get_kv_connector``).

The views bound to the layers are collected twice: after ``initialize_kv_cache`` (``before``: every block id of the
capacity) and after ``extend_kv_cache`` (``after``: the final block ids). What is stood in is
:data:`STOOD_IN`: the engine objects (:mod:`kda_patches.kv_layout.ascend_engine`'s ``vllm_config``, extended), the
runner's plain attributes, the layers' constructor-set attributes, the attention-group discovery and the VMM driver
(host memory: :class:`HostVmmDriver`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from types import SimpleNamespace
from typing import Any

from kda_patches.kv_layout import ascend_models
from kda_patches.kv_layout.ascend_engine import ReleaseLogger, build_vllm_config
from kda_patches.kv_layout.ascend_sources import find_config_hook, read_class_constant
from kda_patches.kv_layout.release_exec import ReleaseTree
from kda_patches.releases.fetch import release_dir

RELEASE = "0.34.0"
CAPACITY_BLOCKS = 64  # num_gpu_blocks_override: the reservation's block ids, every one proven before the rebind
WARMUP_BLOCKS = 8  # committed by warmup (ensure_kv_cache_blocks)
FINAL_BLOCKS = 24  # extend_kv_cache's final count: the block ids proven after the rebind
GRANULE = 2 << 20  # the CUDA driver's VMM granularity (and ExtensibleTensor's floor)
KDL_CPU = 1  # DLPack device type of host memory
PROT_NONE, MAP_FIXED = 0, 0x10  # Linux mmap constants Python's mmap module does not name

# The attention backend the release's CUDA platform ranks first on compute capability 9.0 (an H100) for the model's
# full-attention layers (``vllm/platforms/cuda.py`` ``_get_backend_priorities``), and the module of the model class
# the package picks on CUDA (the ``else`` branch of its platform switch).
BACKENDS = {"mla": ("vllm.v1.attention.backends.mla.flashattn_mla", "FlashAttnMLABackend"),
            "gqa": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend")}
MODEL_MODULES = {"KimiK3ForConditionalGeneration": "vllm.models.kimi_k3.nvidia.model",
                 "Qwen3_5ForConditionalGeneration": "vllm.models.qwen3_5.nvidia.model",
                 "Qwen3NextForCausalLM": "vllm.model_executor.models.qwen3_next"}

STOOD_IN = {
    "vllm_config": "the Ascend proof's engine namespace (kda_patches.kv_layout.ascend_engine) with the fields 0.34's "
                   "path reads added (kernel config, num_prefill_lookahead_tokens 0, kv_cache_layout unresolved)",
    "VMM driver": "vllm.utils.vmm_driver.get_vmm_driver returns a host-memory driver: reserve = address space only "
                  "(an anonymous mapping without access), map = one shared host granule mapped at every granule of "
                  "the range (committed bytes alias each other physically; the views and their addresses are the "
                  "release's), DLPack device kDLCPU: the views are CPU tensors at the reservation's addresses",
    "device": "cuda:0 as a torch.device object only (ExtensibleTensor requires the type); no CUDA call is made",
    "attention backend selection": "the backend of BACKENDS (the CUDA platform's first choice on an H100) for every "
                                   "full-attention layer; Platform._find_non_ssm_backends answers it",
    "attention groups": "init_attn_backend's discovery: one AttentionGroup (the release's class) per KV cache group, "
                        "with the backend its first layer names (BACKENDS, or the GDN backend for state layers); "
                        "kernel_block_size set "
                        "as create_metadata_builders sets it (select_common_block_size); no metadata builders",
    "layers": "Attention / MLAAttention / MambaBase objects without __init__ (the attributes their constructor sets), "
              "with the release's get_kv_cache_spec and bind_kv_cache; every state layer is MambaBase (the Qwen GDN "
              "layer's own get_kv_cache_spec, which adds FlashInfer prefill checkpoints when it exports them, is not "
              "run: no checkpoints, as without FlashInfer's GDN prefill)",
    "runner": "a namespace with what initialize_kv_cache / extend_kv_cache read and set (configs, device, attention "
              "groups, kernel block sizes, no speculator, kv_caches_by_layer)",
    "ModelRegistry.resolve_model_cls": "the model class of MODEL_MODULES with the release's state shape/dtype "
                                       "classmethods",
    "vllm.logger": "a standard-library logger",
    "resolve_obj_by_qualname": "resolves the dotted name in the release tree (the platform's KV cache config builder)",
    "KV transfer": "none configured (kv_transfer_config None): the release's ensure_kv_transfer_initialized and "
                   "get_kv_connector run and find nothing to do",
}


class HostVmmDriver:
    """The VMM driver interface of ``vllm.utils.vmm_driver`` over host memory (see :data:`STOOD_IN`).

    ``reserve`` maps address space without access; ``map`` maps one shared granule of host memory at every granule
    of the range (what the release's views address is the reservation, not the bytes); ``unmap`` takes the access
    away again. Every call is listed in :attr:`calls`.
    """

    dlpack_device_type = KDL_CPU

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mmap.restype = ctypes.c_void_p
        self._libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_long]
        self._libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._granule_fd = os.memfd_create("kda-vmm-granule")
        os.ftruncate(self._granule_fd, GRANULE)
        self.reserved: dict[int, int] = {}

    def _mmap(self, address: int, size: int, prot: int, flags: int, fd: int = -1) -> int:
        result = self._libc.mmap(address or None, size, prot, flags, fd, 0)
        if result in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed")
        return int(result)

    def ensure_context(self, device_index: int) -> None:
        self.calls.append(("ensure_context", device_index))

    def granularity(self, device_index: int) -> int:
        return GRANULE

    def reserve(self, size: int) -> int:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        address = self._mmap(0, size, PROT_NONE, flags)
        self.reserved[address] = size
        self.calls.append(("reserve", size))
        return address

    def free_reserved(self, ptr: int, size: int) -> None:
        self.calls.append(("free_reserved", size))
        self._libc.munmap(ptr, size)
        self.reserved.pop(ptr, None)

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> int:
        self.calls.append(("create", size))
        return len(self.calls)

    def map(self, ptr: int, size: int, handle: int) -> None:
        self.calls.append(("map", size))
        for offset in range(0, size, GRANULE):
            self._mmap(ptr + offset, GRANULE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED,
                       self._granule_fd)

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        self.calls.append(("set_access", size))

    def unmap(self, ptr: int, size: int) -> None:
        self.calls.append(("unmap", size))
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED | getattr(mmap, "MAP_NORESERVE", 0)
        self._mmap(ptr, size, PROT_NONE, flags)

    def release(self, handle: int) -> None:
        self.calls.append(("release", handle))

    def close(self) -> None:
        """Unmap every reservation still held and close the granule."""
        for address, size in list(self.reserved.items()):
            self._libc.munmap(address, size)
        self.reserved.clear()
        os.close(self._granule_fd)


class Run034:
    """What one model's run left: the config, layout, the two configs and views, and the extensible cache.

    Attributes:
        vllm_config, layout: the engine config after the release's hooks and the resolved KV cache layout.
        config_before, views_before: the ``KVCacheConfig`` and the views bound at ``initialize_kv_cache``.
        config_after, views_after: the same after ``extend_kv_cache``.
        cache: the release's ``ExtensibleKVCache`` (its reservation, segments and committed count).
    """

    def __init__(self, vllm_config: Any, layout: Any, config_before: Any, views_before: dict[str, Any],
                 config_after: Any, views_after: dict[str, Any], cache: Any) -> None:
        self.vllm_config, self.layout = vllm_config, layout
        self.config_before, self.views_before = config_before, views_before
        self.config_after, self.views_after = config_after, views_after
        self.cache = cache


class Upstream034Stack:
    """vLLM 0.34's KV-cache path served from the release cache (see the module docstring).

    Args:
        version: the vLLM release (``0.34.0``).
        capacity, warmup, final: block counts of the reservation, of warmup's commit and of the rebind.
        extend_wrapper: called as ``extend_wrapper(extend_kv_cache, None, (runner, config, final), {})`` instead
            of the release's ``extend_kv_cache`` (a test passes the overlay's wrapper; default: the release's).
    """

    def __init__(self, version: str = RELEASE, capacity: int = CAPACITY_BLOCKS, warmup: int = WARMUP_BLOCKS,
                 final: int = FINAL_BLOCKS, extend_wrapper: Any = None) -> None:
        self.version = version
        self.extend_wrapper = extend_wrapper
        self.runner: Any = None
        self.capacity, self.warmup, self.final = capacity, warmup, final
        self.driver = HostVmmDriver()
        self.registry = SimpleNamespace(current=None)
        self.registry.resolve_model_cls = lambda architecture, model_config=None: (self.registry.current,
                                                                                   architecture)
        self._backend: type | None = None
        standins = {
            "vllm.logger:init_logger": ReleaseLogger,
            "vllm.logger:logger": ReleaseLogger("vllm"),
            "vllm.utils.vmm_driver:get_vmm_driver": lambda: self.driver,
            "vllm.model_executor.models.registry:ModelRegistry": self.registry,
            "vllm.model_executor.models:ModelRegistry": self.registry,
            "vllm.utils.import_utils:resolve_obj_by_qualname": lambda qualname: self.tree.get(
                *qualname.rsplit(".", 1)),
        }
        self.tree = ReleaseTree(f"upstream_{version.replace('.', '_')}", {"vllm": release_dir("vllm", version)},
                                standins)
        self._platform = self.platform()()
        self.tree.standins["vllm.platforms:current_platform"] = self._platform
        self._classes = self.layer_classes()
        # the module's import-time statements (its malloc prototype's restype/argtypes) run as the import runs them
        self.tree.install("vllm.utils.extensible_tensor")
        self.tree.standins["vllm.config.cache:CacheConfig"] = SimpleNamespace(DEFAULT_BLOCK_SIZE=read_class_constant(
            self.tree, "vllm.config.cache", "CacheConfig", "DEFAULT_BLOCK_SIZE"))

    def close(self) -> None:
        """Release the host address space the reservations hold."""
        self.driver.close()

    # -- release pieces -------------------------------------------------------------------------------------
    def platform(self) -> type:
        """The release's ``Platform`` whose backend lookup answers the model's attention backend."""
        stack = self
        base = self.tree.get("vllm.platforms.interface", "Platform")
        return type("CudaPlatform", (base,), {
            "_find_non_ssm_backends": classmethod(lambda cls, vllm_config: [stack._backend]),
            "_enum": self.tree.get("vllm.platforms.interface", "PlatformEnum").CUDA, "device_type": "cuda",
            "device_name": "cuda", "__module__": base.__module__})

    def backend_class(self, attention: str) -> type:
        """The release's attention backend class of the model's full-attention layers (:data:`BACKENDS`)."""
        return self.tree.get(*BACKENDS[attention])

    def model_class(self, architecture: str) -> type:
        """The model class with the release's state shape / dtype classmethods."""
        return self.tree.partial_class(MODEL_MODULES[architecture], architecture,
                                       ["get_mamba_state_shape_from_config", "get_mamba_state_dtype_from_config"])

    # -- stage 1: config hooks, block size and page padding --------------------------------------------------
    def configure(self, model: dict[str, Any], tp: int) -> Any:
        """The engine config of ``model`` at ``tp`` after the release's config hooks and block-size alignment."""
        tree = self.tree
        vllm_config = build_vllm_config(model, tp)
        vllm_config.cache_config.num_gpu_blocks_override = self.capacity
        cache_class = tree.partial_class("vllm.config.cache", "CacheConfig", ["get_resolved_kv_cache_layout",
                                                                         "resolved_gpu_memory_utilization"])
        cache_config = object.__new__(cache_class)
        cache_config.__dict__.update(vars(vllm_config.cache_config), use_replayssm=False, prefix_match_unit=None,
                                     kv_cache_dtype_skip_layers=None, user_specified_block_size=False,
                                     enable_extensible_kv_cache=True, gpu_memory_utilization=None)
        vllm_config.cache_config = cache_config
        vllm_config.num_prefill_lookahead_tokens = 0
        vllm_config.use_flashinfer_replayssm = False
        vllm_config.kernel_config = SimpleNamespace(enable_jit_warmup=False)
        vllm_config.model_config.supports_kv_cache_grouping = False  # none of the three models implements it
        self.registry.current = self.model_class(model["architecture"])
        hook = find_config_hook(tree, model["architecture"])
        if hook is not None:
            tree.partial_class("vllm.model_executor.models.config", hook,
                               ["verify_and_update_config"]).verify_and_update_config(vllm_config)
        tree.get("vllm.model_executor.models.config", "HybridAttentionMambaModelConfig").verify_and_update_config(
            vllm_config)
        self._backend = self.backend_class(model["attention"])
        self._layers = self.build_layers(model, vllm_config)
        self._platform.update_block_size_for_backend(vllm_config)
        return vllm_config

    # -- stage 2: layers, specs, layout, planner -------------------------------------------------------------
    def layer_classes(self) -> dict[str, type]:
        """Attention / MLAAttention / MambaBase with the release's ``get_kv_cache_spec`` and ``bind_kv_cache``,
        served as the classes the release's ``isinstance`` checks see."""
        tree = self.tree
        where = {"Attention": "vllm.model_executor.layers.attention.attention",
                 "MLAAttention": "vllm.model_executor.layers.attention.mla_attention",
                 "MambaBase": "vllm.model_executor.layers.mamba.abstract"}
        classes = {}
        base = tree.get("vllm.model_executor.layers.attention_layer_base", "AttentionLayerBase")
        for name, module in where.items():
            methods = ["get_kv_cache_spec"]
            if name == "MambaBase":
                methods.append("get_prefill_checkpoint_alignment")
            if tree.find_method(module, name, "bind_kv_cache") == (module, name):
                methods.append("bind_kv_cache")
            cls = tree.partial_class(module, name, methods)
            if "bind_kv_cache" not in methods:
                cls.bind_kv_cache = base.bind_kv_cache
            base.register(cls)
            tree.standins[f"{module}:{name}"] = cls
            classes[name] = cls
        return classes

    def build_layers(self, model: dict[str, Any], vllm_config: Any) -> dict[str, Any]:
        """The model's cache layers as the static forward context holds them (see :data:`STOOD_IN`)."""
        classes = self._classes
        text = vllm_config.model_config.hf_text_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        backend = self.backend_class(model["attention"])
        gdn = self.tree.get("vllm.v1.attention.backends.gdn_attn", "GDNAttentionBackend")
        decoder = self.tree.get("vllm.v1.attention.backend", "AttentionType").DECODER
        mamba_type = self.tree.get("vllm.v1.attention.backends.registry", "MambaAttentionBackendEnum").GDN_ATTN
        model_cls = self.registry.current
        common = {"kv_sharing_target_layer_name": None, "is_draft_layer": False}
        layers: dict[str, Any] = {}
        for name, kind in ascend_models.layer_names(model):
            if kind == "state":
                layer = object.__new__(classes["MambaBase"])
                layer.__dict__.update(
                    common, prefix=name, mamba_type=mamba_type, is_kv_cache_tp_replicated=False, state_alignment=1,
                    get_attn_backend=lambda: gdn,
                    get_state_shape=lambda: model_cls.get_mamba_state_shape_from_config(vllm_config),
                    get_state_dtype=lambda: model_cls.get_mamba_state_dtype_from_config(vllm_config))
            elif model["attention"] == "mla":
                layer = object.__new__(classes["MLAAttention"])
                layer.__dict__.update(
                    common, layer_name=name, kv_cache_dtype="auto", head_size=text.kv_lora_rank + text.qk_rope_head_dim,
                    num_heads=text.num_attention_heads // tp, sliding_window=None, indexer=None, topk_buffer_width=None,
                    non_causal_multi_token_decode=False, attn_backend=backend, impl=SimpleNamespace(),
                    _vllm_config=vllm_config, get_attn_backend=lambda: backend, attn_type=decoder)
            else:
                layer = object.__new__(classes["Attention"])
                layer.__dict__.update(
                    common, layer_name=name, attn_type=decoder, kv_cache_dtype="auto", sliding_window=None,
                    num_kv_heads=max(1, text.num_key_value_heads // tp), head_size=text.head_dim,
                    head_size_v=text.head_dim, kv_cache_torch_dtype=vllm_config.model_config.dtype,
                    attn_backend=backend, impl=SimpleNamespace(), num_heads=text.num_attention_heads // tp,
                    get_attn_backend=lambda: backend)
            layers[name] = layer
        vllm_config.compilation_config.static_forward_context = layers
        return layers

    def plan(self, vllm_config: Any) -> tuple[Any, Any]:
        """The release's specs, resolved layout and planner config: ``(kv_cache_config, layout)``."""
        tree = self.tree
        specs = tree.get("vllm.v1.worker.gpu.attn_utils", "get_kv_cache_spec")(vllm_config)
        backends = tree.get("vllm.distributed.kv_transfer.kv_connector.utils", "get_current_attn_backends")(
            vllm_config)
        supported = [[layout.name for layout in tree.get("vllm.v1.attention.backends.utils",
                                                         "get_supported_kv_cache_layouts")(backends)]]
        layout = tree.get("vllm.v1.attention.backends.utils", "resolve_kv_cache_layout")(
            vllm_config, supported, list(specs.values()))
        planning = "vllm.v1.core.kv_cache_planning"
        groups = tree.get(planning, "get_global_kv_cache_groups")(vllm_config, [specs])
        page = max(spec.page_size_bytes for spec in specs.values())
        available = self.capacity * page * len(specs)
        config = tree.get(planning, "get_kv_cache_configs")(vllm_config, [specs], [available], groups)[0]
        return config, layout

    # -- stage 3 and 4: allocation, warmup, rebind -----------------------------------------------------------
    def attention_groups(self, kv_cache_config: Any) -> tuple[list[list[Any]], list[int]]:
        """``(attn_groups, kernel_block_sizes)`` as ``init_attn_backend`` leaves them (see :data:`STOOD_IN`)."""
        tree = self.tree
        group_class = tree.get("vllm.v1.worker.utils", "AttentionGroup")
        layers = self._layers
        groups = []
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            backend = layers[group.layer_names[0]].get_attn_backend()
            groups.append([group_class(backend, list(group.layer_names), group.kv_cache_spec, index)])
        kernel_block_sizes = tree.get("vllm.v1.worker.utils", "prepare_kernel_block_sizes")(kv_cache_config, groups)
        attention_spec = tree.get("vllm.v1.kv_cache_interface", "AttentionSpec")
        select = tree.get("vllm.v1.worker.utils", "select_common_block_size")
        for index, (group,) in enumerate(groups):
            if index < len(kernel_block_sizes) and isinstance(group.kv_cache_spec, attention_spec):
                size = select(kernel_block_sizes[index], [group.backend], [group.kv_cache_spec])
                if size != group.kv_cache_spec.block_size:
                    group.kernel_block_size = size
        return groups, kernel_block_sizes

    def bound_views(self) -> dict[str, Any]:
        """What each cache layer holds now: a tensor (attention) or a list of state tensors."""
        return {name: list(layer.kv_cache) if isinstance(layer.kv_cache, tuple) else layer.kv_cache
                for name, layer in self._layers.items()}

    def run(self, model: dict[str, Any], tp: int) -> Run034:
        """Execute the release path for ``model`` at ``tp`` (the module docstring's stages 1-4)."""
        import copy

        import torch

        tree = self.tree
        vllm_config = self.configure(model, tp)
        config, layout = self.plan(vllm_config)
        extensible = "vllm.v1.worker.extensible_kv_cache"
        granule = tree.get("vllm.utils.extensible_tensor", "granule_size")(0)
        config = tree.get(extensible, "pad_kv_cache_segments")(
            config, layout, granule, registers_memory=tree.get(extensible, "registers_kv_cache_memory")(vllm_config))
        device = torch.device("cuda", 0)
        runner = SimpleNamespace(vllm_config=vllm_config, cache_config=vllm_config.cache_config, device=device,
                                 compilation_config=vllm_config.compilation_config, speculator=None,
                                 model_config=vllm_config.model_config)
        runner.kv_cache_config = copy.deepcopy(config)
        runner.extensible_kv_cache = tree.get(extensible, "ExtensibleKVCache")(
            runner.kv_cache_config, device, layout,
            export_handle_types=tree.get(extensible, "kv_cache_export_handle_types")(vllm_config))
        runner.attn_groups, runner.kernel_block_sizes = self.attention_groups(runner.kv_cache_config)
        caches = tree.get("vllm.v1.worker.gpu.attn_utils", "init_kv_cache")(
            vllm_config.compilation_config.static_forward_context, runner.kv_cache_config, device,
            runner.kernel_block_sizes, vllm_config, attn_groups=(g for groups in runner.attn_groups for g in groups),
            allocate=runner.extensible_kv_cache.allocate)
        runner.kv_caches = [cache for cache in caches.values() if cache.device == device]
        runner.kv_caches_by_layer = caches
        before = self.bound_views()
        before_config = copy.copy(runner.kv_cache_config)
        tree.get(extensible, "ensure_kv_cache_blocks")(runner, self.warmup)
        self.runner = runner
        extend = tree.get(extensible, "extend_kv_cache")
        if self.extend_wrapper is None:
            extend(runner, config, self.final)
        else:
            self.extend_wrapper(extend, None, (runner, config, self.final), {})
        after = self.bound_views()
        return Run034(vllm_config, layout, before_config, before, runner.kv_cache_config, after,
                      runner.extensible_kv_cache)
