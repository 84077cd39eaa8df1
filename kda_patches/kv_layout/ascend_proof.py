"""vllm-ascend 0.26-0.30's own KV-cache layouts of real models, executed on the CPU and proven with the checker.

For every release of the fork, every model of :mod:`kda_patches.kv_layout.ascend_models` and tensor-parallel size
1, 2, 4 and 8, this module runs the released code path that decides and builds the KV cache, on the ``meta``
device (shapes, strides and storage offsets exactly as torch computes them; no bytes), then hands every view the
model would use to :func:`kda_patches.kv_layout.checker.check_footprints`, storage by storage: bytes addressed by
two different block ids never overlap, two layers (or states) of one group never share a block's bytes, nothing
lies outside its storage.

What is executed from the release cache (:mod:`kda_patches.kv_layout.release_exec`; each definition compiled from
the release file, nothing copied):

1. the model's config hook (vLLM's ``MODELS_CONFIG_MAP`` entry, e.g. Qwen3.5's ``mamba_ssm_dtype``), the fork's
   ``patch_mamba_config.verify_and_update_config`` (which replaces vLLM's hybrid hook: block size and Mamba page
   padding), vLLM's ``MambaModelConfig.verify_and_update_config``, the fork's ``refresh_block_size``, and on
   releases whose platform chains to vLLM's (0.30) ``Platform.update_block_size_for_backend`` /
   ``_align_hybrid_block_size`` through the fork's overrides; the model class's
   ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` and vLLM's state calculators;
2. the fork's ``NPUModelRunner.get_kv_cache_spec`` over the layers, with vLLM's ``Attention`` /
   ``MLAAttention`` / ``MambaBase.get_kv_cache_spec`` and spec classes;
3. vLLM's planner ``get_kv_cache_configs`` with the fork's ``patch_kv_cache_utils`` installed the way the fork
   installs it (its module-level assignments), and on 0.30 vLLM's ``resolve_kv_cache_layout``;
4. the fork's ``NPUModelRunner._allocate_kv_cache_tensors`` and ``_reshape_kv_cache_tensors`` (and the helpers
   they call), with the fork's attention backends' ``get_kv_cache_shape``.

What is stood in (:data:`STOOD_IN`): the engine objects those functions read (``vllm_config`` and its parts as
plain namespaces with the engine's defaults, the runner's plain attributes, the layers' constructor-set
attributes), the device (``meta``), the model registry lookup, and vLLM's logger. A release whose code cannot run
this way for a model gets the verdict ``not checkable`` with what stopped it.

Run ``python -m kda_patches.kv_layout.ascend_proof --write docs/results/ascend-kv-layout/README.md`` to
regenerate the committed table; ``--check`` compares instead of writing.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import logging
import pathlib
import sys
import traceback
from types import SimpleNamespace
from typing import Any

from kda_patches.kv_layout import ascend_models
from kda_patches.kv_layout.checker import CheckerCache, Footprint
from kda_patches.kv_layout.release_exec import LazyModule, ReleaseTree
from kda_patches.releases.fetch import release_dir
from kda_patches.releases.matrix import PAIRED_VLLM

# (vllm-ascend, vLLM) pairs run. The conformance matrix pairs 0.29.0rc1 with vLLM 0.28.0
# (kda_patches.releases.matrix.PAIRED_VLLM); that release's own code targets vLLM 0.29.0 (its main-lane branches
# test vllm_version_is("0.29.0")), so both pairings are run and reported.
RELEASES = tuple((fork, PAIRED_VLLM[fork]) for fork in ("0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1"))
RELEASES += (("0.29.0rc1", "0.29.0"), ("0.30.0rc1", PAIRED_VLLM["0.30.0rc1"]), ("0.30.0rc2", PAIRED_VLLM["0.30.0rc2"]))
TENSOR_PARALLEL = (1, 2, 4, 8)
NUM_BLOCKS = 64  # num_gpu_blocks_override: the block ids every view is proven for
MAX_MODEL_LEN = 4096
DEVICE = "A3"  # the fork's AscendDeviceType member the device queries answer (Atlas A3)
RUNNER = "vllm_ascend.worker.model_runner_v1"
RUNNER_METHODS = ("get_kv_cache_spec", "initialize_kv_cache_tensors", "_allocate_kv_cache_tensors",
                  "_reshape_kv_cache_tensors", "_kv_cache_spec_attn_group_iterator")
OPTIONAL_RUNNER_METHODS = ("_get_layer_kv_cache_specs", "_adjust_kv_layout", "_align_memory",
                           "_get_attention_kv_cache_dims", "_uses_page_strided_kv_layout",
                           "_allocate_int8_cache_tensor", "_allocate_sparse_c8_indexer_tensors",
                           "_is_c8_mxfp_kv_cache", "_align_up")

STOOD_IN = {
    "vllm_config": "a namespace with the engine defaults the executed code reads (cache, parallel, scheduler, "
                   "model configs); model_config's get_num_kv_heads / get_head_size follow vLLM's rules "
                   "(KV heads divided by TP, at least one; MLA: one head of kv_lora_rank + qk_rope_head_dim)",
    "device": "the NPU is torch's meta device: every view's shape, strides and storage offset as on the device",
    "ModelRegistry.resolve_model_cls": "the class the fork registers (or vLLM's registry names) for the "
                                       "architecture, with the release's own state-shape/dtype classmethods",
    "layers": "Attention / MLAAttention / MambaBase objects without __init__: the attributes their constructor "
              "sets (heads per TP, head sizes, dtypes, backend); state layers' get_state_shape/get_state_dtype "
              "are the model class's classmethods (what the fork sizes pages from)",
    "runner": "NPUModelRunner without __init__: device, configs, attn_groups (initialize_attn_backend: one per "
              "KV-cache group, attention groups with the fork's backend, state groups with none -- their reshape "
              "branch reads none), use_hybrid_blocks, feature switches off (sparse, compress, DCP, KV offload, "
              "KV transfer); the layout resolution sees the attention backend's declared layouts only",
    "vllm.logger": "a standard-library logger",
    "CacheConfig": "only its DEFAULT_BLOCK_SIZE, read from the release's class (a pydantic config class)",
    "vllm_version_is": "answers for the paired vLLM release",
    "device type": "get_ascend_device_type / get_current_hardware_profile answer for an A3 (the fork's own "
                   "AscendDeviceType member and hardware profile table)",
}


class _Logger(logging.LoggerAdapter):
    """vLLM's logger interface (``info_once`` and friends) over a standard-library logger."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(f"kda_patches.ascend_proof.{name}"), {})

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.info(msg, *args)

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.warning(msg, *args)

    def debug_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.debug(msg, *args)


# -- engine objects (stood in) ------------------------------------------------------------------------------
class _ModelConfig(SimpleNamespace):
    """The parts of vLLM's ``ModelConfig`` the executed code reads."""

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        if self.use_mla:
            return 1
        total = self.hf_text_config.num_key_value_heads
        return max(1, total // parallel_config.tensor_parallel_size)

    def get_total_num_kv_heads(self) -> int:
        return 1 if self.use_mla else self.hf_text_config.num_key_value_heads

    def get_head_size(self) -> int:
        text = self.hf_text_config
        if self.use_mla:
            return text.kv_lora_rank + text.qk_rope_head_dim
        return text.head_dim

    def get_num_layers(self, parallel_config: Any = None) -> int:
        return self.hf_text_config.num_hidden_layers

    def get_mamba_chunk_size(self) -> int | None:
        return None


class _VllmConfig(SimpleNamespace):
    """The parts of vLLM's ``VllmConfig`` the executed code reads."""

    def with_hf_config(self, hf_config: Any, architectures: Any = None) -> _VllmConfig:
        clone = copy.copy(self)
        clone.model_config = copy.copy(self.model_config)
        clone.model_config.hf_config = hf_config
        return clone


def _namespace(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**{key: _namespace(item) if key != "linear_attn_config" else dict(item)
                                  for key, item in value.items()})
    return value


def build_vllm_config(model: dict[str, Any], tp: int) -> _VllmConfig:
    """The engine configuration of ``model`` at tensor parallel ``tp`` (engine defaults; see STOOD_IN)."""
    import torch

    text = _namespace(model["text_config"])
    text.architectures = [model["architecture"]]
    if model["model_type"] in ("kimi_k3", "qwen3_5"):
        hf_config = SimpleNamespace(model_type=model["model_type"], architectures=[model["architecture"]],
                                    text_config=text)
    else:
        hf_config = text
    dtype = getattr(torch, model["dtype"])
    model_config = _ModelConfig(
        hf_config=hf_config, hf_text_config=text, dtype=dtype, architecture=model["architecture"],
        architectures=[model["architecture"]], use_mla=model["attention"] == "mla", is_hybrid=True,
        max_model_len=MAX_MODEL_LEN, original_max_model_len=MAX_MODEL_LEN, model_type=model["model_type"],
        supports_mamba_prefix_caching=False, enforce_eager=False, quantization=None, hf_config_path=None,
        is_deepseek_mla=False, convert_type="none", runner_type="generate", is_multimodal_model=False)
    cache_config = SimpleNamespace(
        block_size=None, user_specified_block_size=False, cache_dtype="auto", mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype="auto", mamba_page_size_padded=None, mamba_block_size=None,
        user_specified_mamba_block_size=False, enable_prefix_caching=True, mamba_cache_mode="none",
        num_gpu_blocks_override=NUM_BLOCKS, kv_cache_layout=None, use_kda_recoverssm=False,
        kv_cache_dtype_skip_layers=None, skip_page_size_padded=None, prefix_cache_retention_interval=None,
        calculate_kv_scales=False, kv_sharing_fast_prefill=False, sliding_window=None)
    parallel_config = SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1, decode_context_parallel_size=1,
        prefill_context_parallel_size=1, cp_kv_cache_interleave_size=1, enable_expert_parallel=False, rank=0)
    scheduler_config = SimpleNamespace(disable_hybrid_kv_cache_manager=False, enable_chunked_prefill=True,
                                       max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=MAX_MODEL_LEN)
    return _VllmConfig(
        model_config=model_config, cache_config=cache_config, parallel_config=parallel_config,
        scheduler_config=scheduler_config, speculative_config=None, kv_transfer_config=None,
        ec_transfer_config=None, num_speculative_tokens=0, quant_config=None, lora_config=None,
        attention_config=SimpleNamespace(hisparse_config=None, backend=None),
        compilation_config=SimpleNamespace(static_forward_context={}), additional_config={},
        kv_events_config=None)


# -- one release ------------------------------------------------------------------------------------------
def _registered_model_class(tree: ReleaseTree, architecture: str) -> tuple[str, str] | None:
    """Where the fork (``vllm_ascend/models/__init__.py``) or vLLM's registry puts ``architecture``."""
    fork = tree.roots["vllm_ascend"] / "vllm_ascend/models/__init__.py"
    if fork.is_file():
        for node in ast.walk(ast.parse(fork.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "register_model"
                    and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args)
                    and node.args[0].value == architecture and ":" in node.args[1].value):
                module, _, name = node.args[1].value.partition(":")
                return module, name
    registry = tree.roots["vllm"] / "vllm/model_executor/models/registry.py"
    for node in ast.walk(ast.parse(registry.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == architecture and isinstance(value, ast.Tuple):
                    module, name = (element.value for element in value.elts[:2])
                    return f"vllm.model_executor.models.{module}", name
    return None


class AscendStack:
    """One vllm-ascend release with its paired vLLM, served from the release cache."""

    def __init__(self, fork_version: str, vllm_version: str | None = None) -> None:
        self.fork_version = fork_version
        self.vllm_version = vllm_version or PAIRED_VLLM[fork_version]
        standins = {
            "vllm.logger:init_logger": _Logger,
            "vllm.logger:logger": _Logger("vllm"),
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
            DEFAULT_BLOCK_SIZE=self.class_constant("vllm.config.cache", "CacheConfig", "DEFAULT_BLOCK_SIZE"))

    def class_constant(self, module: str, class_name: str, name: str) -> Any:
        """A literal class attribute of a release class, read from its source."""
        lazy = self.tree.module(module)
        node = lazy.node_of(class_name) if isinstance(lazy, LazyModule) else None
        for child in getattr(node, "body", []):
            target = getattr(child, "target", None) or (getattr(child, "targets", None) or [None])[0]
            if getattr(target, "id", None) == name and child.value is not None:
                return ast.literal_eval(child.value)
        return None

    # -- release pieces -------------------------------------------------------------------------------------
    def has(self, module: str, name: str) -> bool:
        """Whether the release ships ``module`` and it defines ``name``."""
        if not self.tree.has_module(module):
            return False
        lazy = self.tree.module(module)
        return isinstance(lazy, LazyModule) and lazy.defines(name)

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
        where = _registered_model_class(self.tree, architecture)
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
        path = self.tree.roots["vllm"] / "vllm/model_executor/models/config.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and getattr(target, "id", "") == "MODELS_CONFIG_MAP":
                for key, value in zip(node.value.keys, node.value.values, strict=True):
                    if getattr(key, "value", None) == architecture:
                        return self.tree.partial_class("vllm.model_executor.models.config", value.id,
                                                       ["verify_and_update_config"])
        return None

    def configure(self, model: dict[str, Any], tp: int) -> _VllmConfig:
        """Run the release's config path: block size, Mamba page padding, Mamba block size (see the docstring)."""
        tree = self.tree
        vllm_config = build_vllm_config(model, tp)
        if self.has_method("vllm.config.cache", "CacheConfig", "get_resolved_kv_cache_layout"):
            cache_class = tree.partial_class("vllm.config.cache", "CacheConfig", ["get_resolved_kv_cache_layout"])
            cache_config = object.__new__(cache_class)
            cache_config.__dict__.update(vars(vllm_config.cache_config))
            vllm_config.cache_config = cache_config
        model_cls = self.model_class(model["architecture"])
        self.registry.current = model_cls
        where = _registered_model_class(tree, model["architecture"])
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
    def build_layers(self, model: dict[str, Any], vllm_config: _VllmConfig) -> dict[str, Any]:
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

    def build_runner(self, model: dict[str, Any], vllm_config: _VllmConfig) -> Any:
        """``NPUModelRunner`` with only the KV-cache methods from the release and the attributes they read."""
        import torch

        methods = [*RUNNER_METHODS, *(m for m in OPTIONAL_RUNNER_METHODS
                                      if self.tree.find_method(RUNNER, "NPUModelRunner", m) is not None)]
        runner = object.__new__(self.tree.lazy_class(RUNNER, "NPUModelRunner", methods))
        dtype = vllm_config.model_config.dtype
        runner.__dict__.update(
            vllm_config=vllm_config, model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
            compilation_config=vllm_config.compilation_config, parallel_config=vllm_config.parallel_config,
            scheduler_config=vllm_config.scheduler_config, speculative_config=None, device=torch.device("meta"),
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

    def kv_cache_config(self, model: dict[str, Any], vllm_config: _VllmConfig, specs: dict[str, Any]) -> Any:
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
        available = NUM_BLOCKS * page * len(specs)
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
        if "kernel_block_sizes" in _parameters(runner.initialize_kv_cache_tensors):
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


# -- the proof ----------------------------------------------------------------------------------------------
class CaseResult:
    """One release x model x TP: the verdict and what it rests on.

    Attributes:
        verdict: ``proven``, ``overlap found``, ``out of storage`` or ``not checkable``.
        detail: the witness with its bytes (overlap), the checker's reason, or what stopped the release code.
        block_size, page_bytes, num_storages, num_views: facts of the layout (None when it was not built).
    """

    def __init__(self, verdict: str, detail: str, **facts: Any) -> None:
        self.verdict = verdict
        self.detail = detail
        self.block_size = facts.get("block_size")
        self.page_bytes = facts.get("page_bytes")
        self.num_storages = facts.get("num_storages")
        self.num_views = facts.get("num_views")


def describe_views(config: Any, views: dict[str, Any]) -> dict[Any, tuple[int, list[Footprint]]]:
    """Group every view the model would use by raw storage, as checker footprints.

    Block ids index dimension 0 of every Ascend view (block-first); a view with ``k`` times as many rows as the
    config has blocks is split by the kernel block size, so block id ``b`` owns rows ``b*k .. b*k+k-1``.

    Raises:
        ValueError: a view cannot be described (rows not a multiple of the block count, too irregular).
    """
    from kda_patches.kv_layout.views import view_footprint

    group_of = {name: index for index, group in enumerate(config.kv_cache_groups) for name in group.layer_names}
    storages: dict[Any, tuple[int, list[Footprint]]] = {}
    for layer, value in views.items():
        tensors = list(value) if isinstance(value, (list, tuple)) else [value]
        attention = not isinstance(value, list)
        for index, tensor in enumerate(tensors):
            if tensor is None:
                continue
            state = (("k", "v")[index] if len(tensors) == 2 else f"kv{index}") if attention else f"state{index}"
            rows = tensor.shape[0]
            if rows % config.num_blocks:
                raise ValueError(f"{layer}[{state}]: {rows} rows is not a multiple of {config.num_blocks} blocks")
            footprint = view_footprint(tensor, layer, state, group_of[layer], 0, rows // config.num_blocks)
            if footprint is None:
                raise ValueError(f"{layer}[{state}]: view too irregular to describe {tuple(tensor.stride())}")
            storage = tensor.untyped_storage()
            entry = storages.setdefault(storage._cdata, (storage.nbytes(), []))
            entry[1].append(footprint)
    return storages


def witness_text(witness: dict[str, Any], footprints: list[Footprint], storage_nbytes: int) -> str:
    """The witness with the byte range each side addresses: ``A [x, y) and B [u, v) share byte n``."""
    sides = []
    for key, owner in zip("ab", witness["owners"], strict=True):
        named = witness[key]
        ranges = footprints[owner].block_bytes(named["block"])
        hit = next(((lo, hi) for lo, hi in ranges if lo <= witness["byte"] < hi), ranges[0])
        sides.append(f"`{named['layer']}` {named['state']} block {named['block']} (group {named['group']}) "
                     f"bytes [{hit[0]}, {hit[1]})")
    return f"{sides[0]} and {sides[1]} share byte {witness['byte']} (one storage of {storage_nbytes} bytes)"


def prove(config: Any, views: dict[str, Any]) -> tuple[str, str, int, int]:
    """Run the checker on every storage of ``views``: ``(verdict, detail, storages, views)``."""
    return verdict_of(describe_views(config, views))


def verdict_of(storages: dict[Any, tuple[int, list[Footprint]]]) -> tuple[str, str, int, int]:
    """The case's verdict from every storage's footprints: ``(verdict, detail, storages, views)``.

    ``overlap found`` (a witness: two block ids, or two layers of one group, share a byte) wins over ``out of
    storage``, which wins over ``not checkable`` (the checker gave up); ``proven`` needs every storage accepted.
    """
    cache = CheckerCache()
    verdicts = [(cache.check(footprints, nbytes), footprints, nbytes) for nbytes, footprints in storages.values()]
    num_views = sum(len(footprints) for _, footprints, _ in verdicts)
    for verdict, footprints, nbytes in verdicts:
        if verdict.status == "rejected" and verdict.witness is not None:
            return "overlap found", witness_text(verdict.witness, footprints, nbytes), len(storages), num_views
    for verdict, _, _ in verdicts:
        if verdict.status == "rejected":
            return "out of storage", verdict.reason, len(storages), num_views
    for verdict, _, _ in verdicts:
        if verdict.status != "accepted":
            return "not checkable", f"checker: {verdict.reason}", len(storages), num_views
    return "proven", "", len(storages), num_views


def run_case(stack: AscendStack, model_name: str, tp: int) -> CaseResult:
    """Execute the release path for one model and TP and prove its views (see the module docstring)."""
    model = ascend_models.MODELS[model_name]
    try:
        vllm_config, config, views = stack.run(model, tp)
    except Exception as error:
        return CaseResult("not checkable", _stopped_by(error))
    facts = {"block_size": vllm_config.cache_config.block_size,
             "page_bytes": max(group.kv_cache_spec.page_size_bytes for group in config.kv_cache_groups)}
    try:
        verdict, detail, storages, num_views = prove(config, views)
    except ValueError as error:
        return CaseResult("not checkable", f"views: {error}", **facts)
    return CaseResult(verdict, detail, num_storages=storages, num_views=num_views, **facts)


def _stopped_by(error: BaseException) -> str:
    """``Type: message (release file:line)`` of the innermost release frame of ``error``."""
    frames = traceback.extract_tb(error.__traceback__)
    where = next((frame for frame in reversed(frames) if "/releases/" in frame.filename), frames[-1] if frames
                 else None)
    place = ""
    if where is not None:
        path = pathlib.Path(where.filename)
        parts = path.parts
        root = next((i for i, part in enumerate(parts) if part in ("vllm", "vllm_ascend")), len(parts) - 1)
        place = f" ({'/'.join(parts[root:])}:{where.lineno})"
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {message}{place}"


def _parameters(function: Any) -> list[str]:
    import inspect

    return list(inspect.signature(function).parameters)


# -- the table ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def engine_environment() -> Any:
    """Run the release code with no ``VLLM_*`` / ``ASCEND*`` variable set (the engines' defaults)."""
    import os

    saved = {key: value for key, value in os.environ.items() if key.startswith(("VLLM_", "ASCEND"))}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def run_all(releases: tuple[tuple[str, str], ...] = RELEASES) -> tuple[list[tuple[str, str, str, int, CaseResult]],
                                                                        dict[tuple[str, str], dict[str, list[str]]]]:
    """Every release x model x TP: ``(rows, what each release's tree resolved, by kind)``."""
    rows, bound = [], {}
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with engine_environment():
            for fork, vllm in releases:
                stack = AscendStack(fork, vllm)
                for model_name in ascend_models.MODELS:
                    for tp in TENSOR_PARALLEL:
                        rows.append((fork, vllm, model_name, tp, run_case(stack, model_name, tp)))
                bound[(fork, vllm)] = stack.tree.report()
    finally:
        logging.disable(previous)
    return rows, bound


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def render(rows: list[tuple[str, str, str, int, CaseResult]], bound: dict[tuple[str, str], dict[str, list[str]]],
           date: str) -> str:
    """The results README (deterministic for given rows, apart from ``date``)."""
    counts: dict[str, int] = {}
    for *_, result in rows:
        counts[result.verdict] = counts.get(result.verdict, 0) + 1
    notes: dict[str, str] = {}  # detail -> label (W: witness, N: not checkable)
    for *_, result in rows:
        if result.detail and result.detail not in notes:
            kind = "N" if result.verdict == "not checkable" else "W"
            notes[result.detail] = f"{kind}{sum(label[0] == kind for label in notes.values()) + 1}"

    def grouped(verdicts: tuple[str, ...]) -> str:
        """``model[, model] at TP ... on release[, release] (labels)``, cases with the same TPs and labels merged."""
        cases: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
        for fork, vllm, model, tp, result in rows:
            if result.verdict in verdicts:
                tps, labels = cases.setdefault((f"{fork} + vLLM {vllm}", model), ([], []))
                tps.append(str(tp))
                if notes[result.detail] not in labels:
                    labels.append(notes[result.detail])
        merged: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
        for (pairing, model), (tps, labels) in cases.items():
            key = (", ".join(tps), ", ".join(labels))
            pairings, models = merged.setdefault(key, ([], []))
            if pairing not in pairings:
                pairings.append(pairing)
            if model not in models:
                models.append(model)
        return "; ".join(f"{', '.join(models)} at TP {tps} on {', '.join(pairings)} ({labels})"
                         for (tps, labels), (pairings, models) in merged.items()) or "none"

    verdict_line = ", ".join(f"{count} {verdict}" for verdict, count in sorted(counts.items()))
    lines = [
        "# vllm-ascend 0.26-0.30: the fork's own KV-cache layouts of real models, proven on the CPU (issue 53)",
        "",
        "## Summary",
        "",
        "- **Measures**: whether the views vllm-ascend's own released code builds for Kimi K3 (MLA + KDA), "
        "Qwen3.6-27B and",
        "  Qwen3-Next-80B at TP 1/2/4/8 let two block ids (or two layers of one group) share bytes: the fork's "
        "config,",
        "  spec, planner, allocation and reshape code executed from the release cache on the meta device, every "
        "bound view",
        f"  checked by `kda_patches/kv_layout/checker.py` for block ids 0-{NUM_BLOCKS - 1}.",
        f"- **Newest verdict**: {date}, **CPU** (no device): {verdict_line} of {len(rows)} cases.",
        f"  Overlap: {grouped(('overlap found', 'out of storage'))}.",
        f"  Not checkable: {grouped(('not checkable',))}.",
        "- **Command**: `python -m kda_patches.kv_layout.ascend_proof --write "
        "docs/results/ascend-kv-layout/README.md`",
        "  (`--check` compares; `tests/ascend_layout/test_ascend_layout_table.py` fails when this file drifts).",
        "",
        "## Verdicts",
        "",
        "Block size in tokens as the release chose it; page = the largest group page in bytes; storages = raw "
        "allocations",
        "the views live on; views = tensors bound to the layers (K and V, or each state, per layer). 0.29.0rc1 "
        "runs twice: with",
        "vLLM 0.28.0, the conformance matrix's pairing (`kda_patches.releases.matrix.PAIRED_VLLM`), and with vLLM "
        "0.29.0, which its code",
        "targets (its main-lane branches test `vllm_version_is(\"0.29.0\")`).",
        "",
        "| vllm-ascend | vLLM | model | TP | block size | page bytes | storages | views | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fork, vllm, model, tp, result in rows:
        verdict = result.verdict
        if result.detail:
            verdict = f"{verdict} ({notes[result.detail]})"
        if result.verdict in ("overlap found", "out of storage"):
            verdict = f"**{verdict}**"
        lines.append(f"| {fork} | {vllm} | {model} | {tp} | {_cell(result.block_size)} | "
                     f"{_cell(result.page_bytes)} | {_cell(result.num_storages)} | {_cell(result.num_views)} | "
                     f"{verdict} |")
    lines += ["", "## Witnesses and reasons", "",
              "State views are numbered as the spec lists them (state0: the convolution state, state1: the "
              "recurrent state);",
              "attention views are `k` and `v` (for MLA: the latent part and the RoPE part). Byte offsets are "
              "from the start of the storage.", ""]
    for detail, label in sorted(notes.items(), key=lambda item: (item[1][0] != "W", int(item[1][1:]))):
        lines.append(f"- **{label}**: {detail}")
    lines += ["", "## What ran and what was stood in", "",
              "Executed from the release cache, per pairing (counts of top-level definitions and methods compiled "
              "from the",
              "release files, of the fork's import-time patch statements run, of stood-in names, of release names "
              "that resolved to",
              "inert placeholders -- resolved but never called, or the case would not have run):", "",
              "| vllm-ascend | vLLM | definitions executed | files | patch statements | stand-ins | inert |",
              "|---|---|---|---|---|---|---|"]
    for (fork, vllm), kinds in bound.items():
        executed = kinds.get("release", []) + kinds.get("release (on use)", [])
        files = {name.split(":")[0] for name in executed}
        lines.append(f"| {fork} | {vllm} | {len(executed)} | {len(files)} | {len(kinds.get('installed', []))} | "
                     f"{len(kinds.get('standin', []))} | {len(kinds.get('inert', []))} |")
    lines += ["", "Entry points called (each a release function or method, compiled from its release file):", "",
              "1. vLLM's `MODELS_CONFIG_MAP[architecture].verify_and_update_config`, the fork's",
              "   `patch/platform/patch_mamba_config.verify_and_update_config` (vLLM's hybrid hook, which it "
              "replaces),",
              "   `vllm_ascend.utils.refresh_block_size` and `NPUPlatform.update_block_size_for_backend` (with "
              "vLLM's",
              "   `Platform.update_block_size_for_backend` / `_align_hybrid_block_size` where the fork chains to "
              "them);",
              "2. `NPUModelRunner.get_kv_cache_spec` over the layers (vLLM's `Attention` / `MLAAttention` / "
              "`MambaBase.get_kv_cache_spec`);",
              "3. vLLM's `get_kv_cache_configs` after the fork's `patch/platform/patch_kv_cache_utils` import-time "
              "statements, and",
              "   vLLM's `resolve_kv_cache_layout` where the release has it;",
              "4. `NPUModelRunner.initialize_kv_cache_tensors` (allocation, reshape, binding; the fork's",
              "   `patch/worker/patch_bind_kv_cache` installed where it exists) with vLLM's "
              "`prepare_kernel_block_sizes` where the",
              "   runner takes kernel block sizes; the views checked are the ones bound to the layers.", "",
              "The runner is the fork's default V1 `NPUModelRunner` (every release here uses its V2 runner only "
              "with",
              "`VLLM_USE_V2_MODEL_RUNNER=1`, per its `patch/platform/patch_use_v2_model_runner.py`); the V2 "
              "runner is not covered.", "",
              "Stood in:", ""]
    for name, why in STOOD_IN.items():
        lines.append(f"- {name}: {why}.")
    lines += ["", f"Engine settings: block ids 0-{NUM_BLOCKS - 1} (`num_gpu_blocks_override`), max_model_len "
              f"{MAX_MODEL_LEN}, prefix caching on,",
              "dtype bfloat16, `cache_dtype` auto, no speculative decoding, no KV transfer, no `VLLM_*` variables. "
              "Model numbers and their",
              "sources: `kda_patches/kv_layout/ascend_models.py`.", ""]
    return "\n".join(lines)


DATE_PATTERN = r"\b20\d\d-\d\d-\d\d\b"


def same_but_date(left: str, right: str) -> bool:
    """Whether two READMEs agree apart from their dates."""
    import re

    return re.sub(DATE_PATTERN, "DATE", left) == re.sub(DATE_PATTERN, "DATE", right)


def main(argv: list[str] | None = None) -> int:
    import datetime

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=pathlib.Path, help="write the results README here")
    parser.add_argument("--check", type=pathlib.Path, help="fail if this README differs from a fresh run (dates "
                                                           "aside)")
    args = parser.parse_args(argv)
    rows, bound = run_all()
    text = render(rows, bound, datetime.date.today().isoformat())
    if args.check is not None:
        committed = args.check.read_text(encoding="utf-8")
        if not same_but_date(committed, text):
            import difflib

            sys.stdout.writelines(difflib.unified_diff(committed.splitlines(True), text.splitlines(True),
                                                       str(args.check), "fresh run"))
            return 1
        print(f"{args.check}: matches a fresh run")
        return 0
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text, encoding="utf-8")
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
