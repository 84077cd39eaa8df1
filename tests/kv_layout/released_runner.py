"""The RELEASED vLLM 0.26-0.28 KV-cache reshaping code, loaded from the release cache and run on CPU tensors.

Nothing here is a copy: each function is read from the downloaded release file and compiled with that file's
name and line numbers (tracebacks point into the release), or a whole release module is loaded by path under a
private name (never on ``sys.path``). Loaded from the release:

- ``vllm/v1/worker/gpu_model_runner.py``: ``GPUModelRunner._allocate_kv_cache_tensors``,
  ``_reshape_kv_cache_tensors``, ``_update_hybrid_attention_mamba_layout``, ``_kv_cache_spec_attn_group_iterator``,
  ``_has_mixed_attention_kv_layout`` (set on a bare class: the runner's ``__init__`` needs a GPU and a model);
- ``vllm/v1/worker/gpu/attn_utils.py``: ``_reshape_attention_kv_cache``; ``vllm/utils/torch_utils.py``:
  ``get_dtype_size``; ``vllm/v1/attention/backend.py``: ``AttentionBackend.get_kv_cache_block_dim``;
- whole modules: ``vllm/v1/kv_cache_interface.py`` (specs, ``KVCacheTensor``/``KVCacheGroupSpec``/``KVCacheConfig``),
  ``vllm/v1/attention/backends/rocm_attn.py`` (``RocmAttentionBackend``: the K/V-first layout upstream re-strides),
  ``vllm/model_executor/layers/mamba/abstract.py`` (``MambaBase.bind_kv_cache``, 0.27+).

Stood in (no release code can stand for them here): the runner instance's plain attributes (``kv_cache_config``,
``attn_groups``, ``runner_only_attn_layers``, ``cache_config.cache_dtype``, ``device``), the engine's KV-cache
planner (the config below is laid out as the hybrid allocator lays it out: one raw tensor per (state layer,
attention layer) pair, pages padded to the attention page) and a GDN layer's ``get_state_shape`` /
``get_state_dtype`` (they return its spec's shapes and dtypes).
"""

from __future__ import annotations
import __future__

import ast
import importlib.util
import math
import pathlib
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import torch

from kda_patches.releases.fetch import release_dir

RUNNER_METHODS = ("_allocate_kv_cache_tensors", "_reshape_kv_cache_tensors", "_update_hybrid_attention_mamba_layout",
                  "_kv_cache_spec_attn_group_iterator", "_has_mixed_attention_kv_layout")
BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 32, 2, 64  # attention page 16 KiB >= the GDN state (9 KiB)
GDN_HEADS, GDN_DIM, CONV_WIDTH = 2, 32, 4


def load_functions(path: pathlib.Path, qualnames: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Compile each ``function`` / ``Class.method`` of a release file into ``namespace``; return them by name.

    Annotations are not evaluated (``from __future__ import annotations`` semantics), so only the names the
    bodies use must be in ``namespace``.
    """
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    found = {}
    for qualname in qualnames:
        *owner, name = qualname.split(".")
        body = tree.body
        if owner:
            body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner[0]).body
        node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        source = "\n" * (start - 1) + textwrap.dedent("".join(lines[start - 1:node.end_lineno]))
        code = compile(source, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, namespace)
        found[name] = namespace[name]
    return found


def load_module(version: str, relative: str) -> Any:
    """Load one release module by path under a private name (its imports resolve to the installed vLLM)."""
    name = f"_kda_released_vllm_{version.replace('.', '_')}_{relative[:-3].replace('/', '_')}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, release_dir("vllm", version) / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


class ReleasedStack:
    """One vLLM release's KV-cache code: a runner class made of its released methods, its specs and backend."""

    def __init__(self, version: str) -> None:
        self.version = version
        root = release_dir("vllm", version) / "vllm"
        self.runner_file = root / "v1/worker/gpu_model_runner.py"
        self.kvi = load_module(version, "vllm/v1/kv_cache_interface.py")
        rocm = load_module(version, "vllm/v1/attention/backends/rocm_attn.py").RocmAttentionBackend
        # its base class resolves to the installed vLLM's, which predates get_kv_cache_block_dim: take the
        # release's own classmethod from vllm/v1/attention/backend.py
        block_dim = load_functions(root / "v1/attention/backend.py", ["AttentionBackend.get_kv_cache_block_dim"], {})
        self.backend = type("ReleasedRocmAttentionBackend", (rocm,), block_dim)
        namespace: dict[str, Any] = {"torch": torch, "prod": math.prod, "AttentionSpec": self.kvi.AttentionSpec,
                                     "MambaSpec": self.kvi.MambaSpec, "KVQuantMode": self.kvi.KVQuantMode}
        load_functions(root / "utils/torch_utils.py", ["get_dtype_size"], namespace)
        load_functions(root / "v1/worker/gpu/attn_utils.py", ["_reshape_attention_kv_cache"], namespace)
        methods = load_functions(self.runner_file, [f"GPUModelRunner.{m}" for m in RUNNER_METHODS], namespace)
        self.runner_class = type(f"ReleasedGPUModelRunner_{version.replace('.', '_')}", (), methods)
        abstract = load_module(version, "vllm/model_executor/layers/mamba/abstract.py")
        bind = vars(abstract.MambaBase).get("bind_kv_cache")
        self.layer_class = None if bind is None else type("ReleasedGDNLayer", (), {
            "bind_kv_cache": bind,
            "get_state_shape": lambda self: self.spec.shapes,
            "get_state_dtype": lambda self: self.spec.dtypes})

    def build(self, num_attention: int, num_gdn: int, num_blocks: int = 12) -> tuple[Any, Any, list[int]]:
        """Return ``(runner, kv_cache_config, kernel_block_sizes)`` for a hybrid (or state-only) model."""
        kvi = self.kvi
        attention = kvi.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                                          dtype=torch.bfloat16)
        conv_dim = 3 * GDN_HEADS * GDN_DIM
        gdn = kvi.MambaSpec(block_size=BLOCK_SIZE, shapes=((CONV_WIDTH - 1, conv_dim), (GDN_HEADS, GDN_DIM, GDN_DIM)),
                            dtypes=(torch.bfloat16, torch.float32),
                            page_size_padded=attention.page_size_bytes if num_attention else None)
        gdn_layers = [f"model.layers.{2 * i}.linear_attn" for i in range(num_gdn)]
        attention_layers = [f"model.layers.{2 * i + 1}.self_attn.attn" for i in range(num_attention)]
        groups = [kvi.KVCacheGroupSpec(names, spec) for names, spec in ((gdn_layers, gdn),
                                                                         (attention_layers, attention)) if names]
        page = max(spec.page_size_bytes for spec in (gdn, attention) if spec is gdn or num_attention)
        pairs = max(num_gdn, num_attention)
        tensors = [kvi.KVCacheTensor(size=page * num_blocks,
                                     shared_by=[names[i] for names in (gdn_layers, attention_layers) if i < len(names)])
                   for i in range(pairs)]
        config = kvi.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
        runner = object.__new__(self.runner_class)
        runner.device = torch.device("cpu")
        runner.kv_cache_config = config
        runner.runner_only_attn_layers = set()
        runner.cache_config = SimpleNamespace(cache_dtype="auto")
        backends = {id(gdn): None, id(attention): self.backend}
        runner.attn_groups = [[SimpleNamespace(backend=backends[id(g.kv_cache_spec)], layer_names=g.layer_names,
                                               kv_cache_spec=g.kv_cache_spec, kv_cache_group_id=index)]
                              for index, g in enumerate(groups)]
        return runner, config, [g.kv_cache_spec.block_size for g in groups]

    def bind_states(self, config: Any, kv_caches: dict[str, Any]) -> dict[str, Any]:
        """Per layer, the tensors the model would use: states bound by the released ``bind_kv_cache`` (0.27+) or
        the reshape's state list (0.26), the attention cache as it is."""
        from kda_patches.kv_layout.plan import layer_specs

        bound = {}
        for name, (_, spec) in layer_specs(config).items():
            value = kv_caches[name]
            if hasattr(spec, "shapes") and isinstance(value, torch.Tensor):
                layer = object.__new__(self.layer_class)
                layer.spec = spec
                layer.bind_kv_cache(value)
                bound[name] = list(layer.kv_cache)
            else:
                bound[name] = value
        return bound
