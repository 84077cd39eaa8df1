"""One vllm-ascend release with its paired vLLM, whose KV-cache code runs on the CPU (``meta`` device by default).

:class:`AscendStack` serves the release pairing from the release cache
(:class:`~kda_patches.kv_layout.release_exec.ReleaseTree`) and executes, stage by stage, the code that decides and
builds the KV cache of a model (see :mod:`kda_patches.kv_layout.ascend_proof` for the list): the config hooks and
block size, the layers' specs, the planner with the fork's patch, the runner's allocation and reshape. The engine
objects that code reads are the stand-ins of :mod:`kda_patches.kv_layout.ascend_engine`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from kda_patches.kv_layout import ascend_models
from kda_patches.kv_layout.ascend_engine import NUM_BLOCKS, ReleaseLogger, VllmConfig, build_vllm_config
from kda_patches.kv_layout.ascend_sources import find_config_hook, find_registered_model, read_class_constant
from kda_patches.kv_layout.release_exec import ReleaseTree
from kda_patches.releases.fetch import release_dir
from kda_patches.releases.matrix import PAIRED_VLLM

DEVICE = "A3"  # the fork's AscendDeviceType member the device queries answer (Atlas A3)
RUNNER = "vllm_ascend.worker.model_runner_v1"
RUNNER_METHODS = ("get_kv_cache_spec", "initialize_kv_cache_tensors", "_allocate_kv_cache_tensors",
                  "_reshape_kv_cache_tensors", "_kv_cache_spec_attn_group_iterator")
OPTIONAL_RUNNER_METHODS = ("_get_layer_kv_cache_specs", "_adjust_kv_layout", "_align_memory",
                           "_get_attention_kv_cache_dims", "_uses_page_strided_kv_layout",
                           "_allocate_int8_cache_tensor", "_allocate_sparse_c8_indexer_tensors",
                           "_is_c8_mxfp_kv_cache", "_align_up")


class AscendStack:
    """One vllm-ascend release with its paired vLLM, served from the release cache.

    Args:
        fork_version: the vllm-ascend release (``0.30.0rc1``).
        vllm_version: the vLLM release run with it (default: the conformance pairing,
            :data:`kda_patches.releases.matrix.PAIRED_VLLM`).
        device: where the runner allocates (``meta``: shapes, strides and offsets only; ``cpu``: real bytes, for
            tests that write through the views).
        num_blocks: the engine's ``num_gpu_blocks_override`` (the block ids the views address).
        runner_class: builds the runner class from the release's partial ``NPUModelRunner`` (default: as is); a
            test passes one that wraps a method with the overlay's wrapper.
    """

    def __init__(self, fork_version: str, vllm_version: str | None = None, device: str = "meta",
                 num_blocks: int = NUM_BLOCKS, runner_class: Callable[[type], type] | None = None) -> None:
        self.fork_version = fork_version
        self.vllm_version = vllm_version or PAIRED_VLLM[fork_version]
        self.device = device
        self.num_blocks = num_blocks
        self.runner_class = runner_class
        standins = {
            "vllm.logger:init_logger": ReleaseLogger,
            "vllm.logger:logger": ReleaseLogger("vllm"),
            "vllm_ascend.utils:vllm_version_is": lambda target: target == self.vllm_version,
        }
        self.tree = ReleaseTree(f"ascend_{fork_version.replace('.', '_')}_{self.vllm_version.replace('.', '_')}",
                                {"vllm": release_dir("vllm", self.vllm_version),
                                 "vllm_ascend": release_dir("vllm-ascend", fork_version)}, standins)
        tree = self.tree
        tree.standins["vllm_ascend.utils:get_ascend_device_type"] = lambda: tree.get(
            "vllm_ascend.utils", "AscendDeviceType")[DEVICE]
        if self.has("vllm_ascend.device.hardware_profile", "get_hardware_profile"):
            tree.standins["vllm_ascend.device.hardware_profile:get_current_hardware_profile"] = lambda: tree.get(
                "vllm_ascend.device.hardware_profile", "get_hardware_profile")(
                tree.get("vllm_ascend.utils", "AscendDeviceType")[DEVICE])
        self._layer_classes: dict[str, type] | None = None
        self._installed = False
        self._bind_installed = False
        self._platform: type | None = None
        self.backend: type | None = None
        self.registry = SimpleNamespace(current=None)
        self.registry.resolve_model_cls = lambda architecture, model_config=None: (self.registry.current,
                                                                                   architecture)
        self.tree.standins["vllm.model_executor.models.registry:ModelRegistry"] = self.registry
        self.tree.standins["vllm.model_executor.models:ModelRegistry"] = self.registry
        self.tree.standins["vllm:ModelRegistry"] = self.registry
        self.tree.standins["vllm.config.cache:CacheConfig"] = SimpleNamespace(
            DEFAULT_BLOCK_SIZE=read_class_constant(tree, "vllm.config.cache", "CacheConfig", "DEFAULT_BLOCK_SIZE"))

    # -- release pieces -------------------------------------------------------------------------------------
    def has(self, module: str, name: str) -> bool:
        """Whether the release ships ``module`` and it defines ``name``."""
        lazy = self.tree.lazy_module(module)
        return lazy is not None and lazy.defines(name)

    def layer_classes(self) -> dict[str, type]:
        """Attention / MLAAttention / MambaBase with only ``get_kv_cache_spec`` from the release (stood in as the
        classes the runner's ``isinstance`` checks see), registered as ``AttentionLayerBase`` subclasses."""
        if self._layer_classes is not None:
            return self._layer_classes
        tree = self.tree
        base = tree.get("vllm.model_executor.layers.attention_layer_base", "AttentionLayerBase")
        classes = {
            "Attention": tree.partial_class("vllm.model_executor.layers.attention.attention", "Attention",
                                            ["get_kv_cache_spec"]),
            "MLAAttention": tree.partial_class("vllm.model_executor.layers.attention.mla_attention",
                                               "MLAAttention", ["get_kv_cache_spec"]),
            "MambaBase": tree.partial_class("vllm.model_executor.layers.mamba.abstract", "MambaBase",
                                            ["get_kv_cache_spec"]),
        }
        for cls in classes.values():
            base.register(cls)
        tree.standins["vllm.model_executor.layers.attention.attention:Attention"] = classes["Attention"]
        tree.standins["vllm.model_executor.layers.attention.mla_attention:MLAAttention"] = classes["MLAAttention"]
        tree.standins["vllm.model_executor.layers.mamba.abstract:MambaBase"] = classes["MambaBase"]
        self._layer_classes = classes
        return classes

    def model_class(self, architecture: str) -> type:
        """The registered model class with the release's state shape / dtype classmethods."""
        where = find_registered_model(self.tree, architecture)
        if where is None:
            raise LookupError(f"architecture {architecture} is registered neither by the fork nor by vLLM")
        return self.tree.partial_class(where[0], where[1], ["get_mamba_state_shape_from_config",
                                                             "get_mamba_state_dtype_from_config"])

    # -- stage 1: block size and page padding ----------------------------------------------------------------
    def backend_class(self, attention: str) -> type:
        """The fork's attention backend class of the model's full-attention layers (the release's whole class)."""
        if attention == "mla":
            return self.tree.get("vllm_ascend.attention.mla_v1", "AscendMLABackend")
        return self.tree.get("vllm_ascend.attention.attention_v1", "AscendAttentionBackend")

    def _config_hook(self, architecture: str) -> Any:
        """vLLM's ``MODELS_CONFIG_MAP[architecture]`` class (its ``verify_and_update_config`` from the release)."""
        name = find_config_hook(self.tree, architecture)
        if name is None:
            return None
        return self.tree.partial_class("vllm.model_executor.models.config", name, ["verify_and_update_config"])

    def configure(self, model: dict[str, Any], tp: int) -> VllmConfig:
        """Run the release's config path: block size, Mamba page padding, Mamba block size (see the docstring)."""
        tree = self.tree
        vllm_config = build_vllm_config(model, tp)
        vllm_config.cache_config.num_gpu_blocks_override = self.num_blocks
        if self.has_method("vllm.config.cache", "CacheConfig", "get_resolved_kv_cache_layout"):
            cache_class = tree.partial_class("vllm.config.cache", "CacheConfig", ["get_resolved_kv_cache_layout"])
            cache_config = object.__new__(cache_class)
            cache_config.__dict__.update(vars(vllm_config.cache_config))
            vllm_config.cache_config = cache_config
        model_cls = self.model_class(model["architecture"])
        self.registry.current = model_cls
        where = find_registered_model(tree, model["architecture"])
        vllm_config.model_config.supports_mamba_prefix_caching = any(
            name == "SupportsMambaPrefixCaching" for _, name in tree.ancestors(*where))
        hook = self._config_hook(model["architecture"])
        if hook is not None:
            hook.verify_and_update_config(vllm_config)
        hybrid = tree.get("vllm_ascend.patch.platform.patch_mamba_config", "verify_and_update_config")
        type("HybridAttentionMambaModelConfig", (), {"verify_and_update_config": hybrid}).verify_and_update_config(
            vllm_config)
        if self.has("vllm_ascend.utils", "refresh_block_size"):
            tree.get("vllm_ascend.utils", "refresh_block_size")(vllm_config)
        self.backend = self.backend_class(model["attention"])
        npu = self.platform()
        npu.update_block_size_for_backend(vllm_config)
        return vllm_config

    def platform(self) -> type:
        """The fork's ``NPUPlatform`` (the release's whole class; it is ``current_platform`` for the release code),
        with ``_find_non_ssm_backend`` stood in by the backend of the model's full-attention layers."""
        if self._platform is None:
            stack = self
            fork = self.tree.get("vllm_ascend.platform", "NPUPlatform")
            self._platform = type("NPUPlatform", (fork,), {
                "_find_non_ssm_backend": classmethod(lambda cls, vllm_config: stack.backend),
                "__module__": fork.__module__})
            self.tree.standins["vllm.platforms:current_platform"] = self._platform
        return self._platform

    def has_method(self, module: str, class_name: str, method: str, own: bool = False) -> bool:
        """Whether the release class (or, unless ``own``, one of its release bases) defines ``method``."""
        if not self.tree.has_module(module):
            return False
        where = self.tree.find_method(module, class_name, method)
        return where is not None and (not own or where == (module, class_name))

    # -- stage 2: layers and their specs ----------------------------------------------------------------------
    def build_layers(self, model: dict[str, Any], vllm_config: VllmConfig) -> dict[str, Any]:
        """The model's cache layers as the runner's static forward context holds them (see STOOD_IN)."""
        classes = self.layer_classes()
        tree = self.tree
        backend = self.backend_class(model["attention"])
        text = vllm_config.model_config.hf_text_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        model_cls = self.registry.current
        dtype = vllm_config.model_config.dtype
        enum = tree.get("vllm.v1.attention.backends.registry", "MambaAttentionBackendEnum") if self.has(
            "vllm.v1.attention.backends.registry", "MambaAttentionBackendEnum") else None
        mamba_type = enum.GDN_ATTN if enum is not None else "gdn_attention"
        decoder = tree.get("vllm.v1.attention.backend", "AttentionType").DECODER if self.has(
            "vllm.v1.attention.backend", "AttentionType") else "decoder"
        layers: dict[str, Any] = {}
        for name, kind in ascend_models.layer_names(model):
            if kind == "state":
                layer = object.__new__(classes["MambaBase"])
                layer.__dict__.update(
                    prefix=name, mamba_type=mamba_type, is_kv_cache_tp_replicated=False,
                    get_state_shape=lambda: model_cls.get_mamba_state_shape_from_config(vllm_config),
                    get_state_dtype=lambda: model_cls.get_mamba_state_dtype_from_config(vllm_config))
            elif model["attention"] == "mla":
                layer = object.__new__(classes["MLAAttention"])
                layer.__dict__.update(
                    layer_name=name, kv_cache_dtype="auto", head_size=text.kv_lora_rank + text.qk_rope_head_dim,
                    kv_lora_rank=text.kv_lora_rank, qk_rope_head_dim=text.qk_rope_head_dim,
                    qk_nope_head_dim=text.qk_nope_head_dim, v_head_dim=text.v_head_dim,
                    num_heads=text.num_attention_heads // tp, sliding_window=None, indexer=None,
                    non_causal_multi_token_decode=False, attn_backend=backend, impl=SimpleNamespace(),
                    kv_sharing_target_layer_name=None, use_sparse=False, attn_type=decoder)
            else:
                layer = object.__new__(classes["Attention"])
                layer.__dict__.update(
                    layer_name=name, attn_type=decoder, kv_cache_dtype="auto", sliding_window=None,
                    num_kv_heads=max(1, text.num_key_value_heads // tp), head_size=text.head_dim,
                    head_size_v=text.head_dim, kv_cache_torch_dtype=dtype, attn_backend=backend,
                    kv_sharing_target_layer_name=None, impl=SimpleNamespace(), num_heads=text.num_attention_heads // tp,
                    dtype=dtype)
            layers[name] = layer
        vllm_config.compilation_config.static_forward_context = layers
        return layers

    def build_runner(self, model: dict[str, Any], vllm_config: VllmConfig) -> Any:
        """``NPUModelRunner`` with only the KV-cache methods from the release and the attributes they read."""
        import torch

        methods = [*RUNNER_METHODS, *(m for m in OPTIONAL_RUNNER_METHODS
                                      if self.tree.find_method(RUNNER, "NPUModelRunner", m) is not None)]
        runner_class = self.tree.lazy_class(RUNNER, "NPUModelRunner", methods)
        if self.runner_class is not None:
            runner_class = self.runner_class(runner_class)
        runner = object.__new__(runner_class)
        dtype = vllm_config.model_config.dtype
        runner.__dict__.update(
            vllm_config=vllm_config, model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
            compilation_config=vllm_config.compilation_config, parallel_config=vllm_config.parallel_config,
            scheduler_config=vllm_config.scheduler_config, speculative_config=None, device=torch.device(self.device),
            dtype=dtype, kv_cache_dtype=dtype, block_size=vllm_config.cache_config.block_size, use_sparse=False,
            use_compress=False, use_dcp=False, use_cp=False, sparse_kv_offload_enabled=False,
            shared_kv_cache_layers={}, runner_only_attn_layers=set(), tp_rank=0, pcp_size=1, dcp_size=1,
            c8_cache_dtype=None, c8_k_cache_dtype=None, c8_k_scale_cache_dtype=None, kv_caches=[],
            sfa_dcp_replicated_indexer_size=1, drafter=None,
            ascend_config=SimpleNamespace(kvpp_config=SimpleNamespace(size=1),
                                          xlite_graph_config=SimpleNamespace(enabled=False),
                                          is_sparse_li_c8_layer=lambda name: False,
                                          is_sparse_li_c4_layer=lambda name: False))
        return runner

    def kv_cache_config(self, model: dict[str, Any], vllm_config: VllmConfig, specs: dict[str, Any]) -> Any:
        """The release planner's ``KVCacheConfig`` for one worker, with the fork's planner patch installed."""
        tree = self.tree
        utils = tree.module("vllm.v1.core.kv_cache_utils")
        if not self._installed:
            if self.has("vllm_ascend.patch.platform.patch_kv_cache_utils", "_ascend_resolve_kv_cache_block_sizes"):
                tree.install("vllm_ascend.patch.platform.patch_kv_cache_utils")
            self._installed = True
        if self.has("vllm.v1.attention.backends.utils", "resolve_kv_cache_layout"):
            backends_utils = tree.module("vllm.v1.attention.backends.utils")
            backend = self.backend_class(model["attention"])
            supported = [[layout.name for layout in backends_utils.get_supported_kv_cache_layouts([backend])]]
            backends_utils.resolve_kv_cache_layout(vllm_config, supported, list(specs.values()))
        page = max(spec.page_size_bytes for spec in specs.values())
        available = self.num_blocks * page * len(specs)
        return utils.get_kv_cache_configs(vllm_config, [specs], [available])[0]

    def attn_groups(self, model: dict[str, Any], config: Any) -> list[list[Any]]:
        """One attention group per KV-cache group (``initialize_attn_backend`` stood in)."""
        attention = self.backend_class(model["attention"])
        mamba_spec = self.tree.get("vllm.v1.kv_cache_interface", "MambaSpec")
        groups = []
        for index, group in enumerate(config.kv_cache_groups):
            spec = group.kv_cache_spec
            inner = getattr(spec, "kv_cache_specs", None)
            first = next(iter(inner.values())) if inner else spec
            backend = None if isinstance(first, mamba_spec) else attention
            groups.append([SimpleNamespace(backend=backend, layer_names=list(group.layer_names), kv_cache_spec=spec,
                                           kv_cache_group_id=index)])
        return groups

    def run(self, model: dict[str, Any], tp: int) -> tuple[Any, Any, dict[str, Any]]:
        """Execute the release path for ``model`` at ``tp``: returns ``(vllm_config, kv_cache_config, views)``."""
        vllm_config = self.configure(model, tp)
        self.build_layers(model, vllm_config)
        runner = self.build_runner(model, vllm_config)
        specs = runner.get_kv_cache_spec()
        config = self.kv_cache_config(model, vllm_config, specs)
        runner.kv_cache_config = config
        runner.attn_groups = self.attn_groups(model, config)
        runner.use_hybrid_blocks = len(runner.attn_groups) > 1
        if self.has("vllm_ascend.patch.worker.patch_bind_kv_cache", "bind_kv_cache") and not self._bind_installed:
            self.tree.install("vllm_ascend.patch.worker.patch_bind_kv_cache")
            self._bind_installed = True
        keywords = {}
        if "kernel_block_sizes" in inspect.signature(runner.initialize_kv_cache_tensors).parameters:
            prepare = self.tree.get(RUNNER, "prepare_kernel_block_sizes")
            keywords["kernel_block_sizes"] = prepare(config, runner.attn_groups)
        returned = runner.initialize_kv_cache_tensors(config, **keywords)
        layers = vllm_config.compilation_config.static_forward_context
        views = {}
        for name, value in returned.items():
            bound = layers[name].kv_cache
            if isinstance(bound, list) and len(bound) == 1 and bound[0] is value:
                bound = value  # one virtual engine
            if bound is not value:
                raise RuntimeError(f"{name}: the view bound to the layer is not the one initialize returned")
            views[name] = bound
        return vllm_config, config, views

