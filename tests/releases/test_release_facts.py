"""The facts of ``shared/notes/RELEASES.md``, read again from the released sources by the AST reader.

The expected values are typed in from RELEASES.md (which was read from the registry's files by hand), so this
checks the reader against an independent reading; the releases come from the registry (cached).
"""

from __future__ import annotations

import pytest

from kda_patches.releases.fetch import release_dir
from kda_patches.releases.shapes import check_shape
from kda_patches.releases.source import ReleaseSource

ASCEND = ("0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2")
KIMI = "vllm_ascend.ops.kimi_kda"
RUN_PREFILL = ("self", "q", "k", "v", "raw_gate", "beta", "recurrent_state", "state_indices", "has_initial_state",
               "prebuilt_metadata")
BUILD_6 = ("self", "common_prefix_len", "common_attn_metadata", "num_accepted_tokens", "num_decode_draft_tokens_cpu",
           "fast_build")


def ascend(version: str) -> ReleaseSource:
    return ReleaseSource(release_dir("vllm-ascend", version))


def vllm(version: str) -> ReleaseSource:
    return ReleaseSource(release_dir("vllm", version))


@pytest.mark.parametrize(("version", "kimi_class"), [
    ("0.26.0rc1", "AscendKimiGatedDeltaNetAttention"), ("0.27.1rc1", "AscendKimiK3DeltaAttention"),
    ("0.28.0rc1", "AscendKimiK3DeltaAttention"), ("0.29.0rc1", "AscendKimiK3DeltaAttention"),
    ("0.30.0rc1", "AscendKimiK3DeltaAttention"), ("0.30.0rc2", "AscendKimiK3DeltaAttention"),
])
def test_kimi_class_defining_run_prefill(version: str, kimi_class: str) -> None:
    source = ascend(version)
    assert [info.name for info in source.classes_defining(KIMI, "_run_prefill")] == [kimi_class]
    assert source.parameters(KIMI, f"{kimi_class}._run_prefill") == RUN_PREFILL


@pytest.mark.parametrize(("version", "runner"), [
    ("0.26.0rc1", ("self", "kv_cache_config")), ("0.27.1rc1", ("self", "kv_cache_config")),
    ("0.28.0rc1", ("self", "kv_cache_config", "kv_cache_allocation_context")),
    ("0.29.0rc1", ("self", "kv_cache_config", "kv_cache_allocation_context")),
    ("0.30.0rc1", ("self", "kv_cache_config", "kv_cache_allocation_context")),
    ("0.30.0rc2", ("self", "kv_cache_config", "kv_cache_allocation_context")),
])
def test_npu_runner_initialize_kv_cache(version: str, runner: tuple[str, ...]) -> None:
    source = ascend(version)
    for module in ("vllm_ascend.worker.model_runner_v1", "vllm_ascend.worker.v2.model_runner"):
        assert source.parameters(module, "NPUModelRunner.initialize_kv_cache") == runner, module


@pytest.mark.parametrize(("version", "extra"), [
    ("0.26.0rc1", ()), ("0.27.1rc1", ()), ("0.28.0rc1", ()), ("0.29.0rc1", ("num_actual_reqs",)),
    ("0.30.0rc1", ("num_actual_reqs",)), ("0.30.0rc2", ("num_actual_reqs",)),
])
def test_ascend_gdn_builder_build(version: str, extra: tuple[str, ...]) -> None:
    assert ascend(version).parameters("vllm_ascend.ops.gdn_attn_builder",
                                      "AscendGDNAttentionMetadataBuilder.build") == BUILD_6 + extra


@pytest.mark.parametrize("version", ASCEND)
def test_state_copy_pattern_and_fork_plan(version: str) -> None:
    source = ascend(version)
    cls = source.classes_defining(KIMI, "_run_prefill")[0].name
    seam = source.resolve(KIMI, f"{cls}._run_prefill")
    forked = version.startswith("0.30")
    for shape in ("gather:recurrent_state[state_indices]", "clear:clear_ssm_states(_, has_initial_state)",
                  "scatter:recurrent_state[state_indices]="):
        assert check_shape(shape, source, None, seam).ok is not forked, shape
    assert check_shape("fork:kda_state_copy_plan", source).ok is forked
    assert (source.module_path("vllm_ascend.ops.kda_state_copy_plan") is not None) is forked
    clear = source.resolve(KIMI, "clear_ssm_states")
    if forked:
        assert clear is None  # the fork's own plan replaced the clear; kimi_kda no longer imports it
    else:
        assert clear.module == "vllm_ascend.ops.triton.fla.utils"
        assert source.parameters(KIMI, "clear_ssm_states") == ("ssm_states", "has_initial_state")


@pytest.mark.parametrize(("version", "forward", "runner_v1", "runner_v2", "reshape", "allocate"), [
    ("0.26.0", None, ("self", "kv_cache_config", "is_profiling"), ("self", "kv_cache_config"),
     ("self", "kv_cache_raw_tensors", "kernel_block_sizes"), None),
    ("0.27.1", ("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out"), ("self", "kv_cache_config", "is_profiling"),
     ("self", "kv_cache_config"), ("self", "kv_cache_raw_tensors", "kernel_block_sizes"), None),
    ("0.28.0", ("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out"), ("self", "kv_cache_config", "is_profiling"),
     ("self", "kv_cache_config"), ("self", "kv_cache_raw_tensors", "kernel_block_sizes"), None),
    *[(v, ("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out"),
       ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context"),
       ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context"), None,
       ("kv_cache_config", "device", "layout", "kernel_block_sizes")) for v in ("0.30.0", "0.32.0", "0.33.0")],
])
def test_upstream_seams(version: str, forward, runner_v1, runner_v2, reshape, allocate) -> None:
    source = vllm(version)
    assert source.parameters("vllm.models.kimi_k3.nvidia.kda", "KimiK3DeltaAttention._forward") == forward
    assert source.parameters("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.initialize_kv_cache") == runner_v1
    assert source.parameters("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.initialize_kv_cache") == runner_v2
    assert source.parameters("vllm.v1.worker.gpu_model_runner",
                             "GPUModelRunner._reshape_kv_cache_tensors") == reshape
    assert source.parameters("vllm.v1.worker.utils", "allocate_kv_cache") == allocate
    bind = source.parameters("vllm.model_executor.layers.mamba.abstract", "MambaBase.bind_kv_cache")
    assert bind == (None if version == "0.26.0" else ("self", "kv_cache"))


def test_vllm_033_moved_get_kv_cache_configs() -> None:
    old, new = vllm("0.32.0"), vllm("0.33.0")
    three = ("vllm_config", "kv_cache_specs", "available_memory")
    assert old.parameters("vllm.v1.core.kv_cache_utils", "get_kv_cache_configs") == three
    assert old.module_path("vllm.v1.core.kv_cache_planning") is None
    assert new.resolve("vllm.v1.core.kv_cache_utils", "get_kv_cache_configs") is None  # no re-export
    assert new.parameters("vllm.v1.core.kv_cache_planning", "get_kv_cache_configs") == (
        *three, "global_kv_cache_groups")
    bound = new.resolve("vllm.v1.engine.core", "get_kv_cache_configs")
    assert bound is not None and bound.module == "vllm.v1.core.kv_cache_planning"  # engine/core imports it by name


@pytest.mark.parametrize("version", ("0.27.1", "0.30.0", "0.32.0", "0.33.0"))
def test_upstream_kimi_prefill_shapes(version: str) -> None:
    source = vllm(version)
    forward = source.resolve("vllm.models.kimi_k3.nvidia.kda", "KimiK3DeltaAttention._forward")
    for shape in ("read:self.kv_cache", "gather:gather_initial_states(recurrent_state, ...)",
                  "scatter:recurrent_state[...]="):
        assert check_shape(shape, source, None, forward).ok, shape
    gather = source.resolve("vllm.models.kimi_k3.nvidia.kda", "gather_initial_states")
    assert gather.module == "vllm.model_executor.layers.mamba.ops.gather_initial_states"


GDN = "vllm.model_executor.layers.mamba.gdn"


@pytest.mark.parametrize(("version", "module", "qualname", "index", "flags"), [
    *[(v, f"{GDN}.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention._forward_core", "prefill_state_indices",
       "prefill_has_initial_state") for v in ("0.32.0", "0.33.0")],
    *[(v, f"{GDN}.olmo_gdn_linear_attn", "OlmoHybridGatedDeltaNetAttention._forward_core",
       "non_spec_state_indices_tensor", "has_initial_state") for v in ("0.32.0", "0.33.0")],
])
def test_upstream_gdn_native_state_copy(version: str, module: str, qualname: str, index: str, flags: str) -> None:
    source = vllm(version)
    seam = source.resolve(module, qualname)
    for shape in (f"gather:ssm_state[{index}]", f"clear:initial_state[~{flags}, ...]=0",
                  f"scatter:ssm_state[{index}]=", "read:self.kv_cache"):
        assert check_shape(shape, source, None, seam).ok, shape


@pytest.mark.parametrize("version", ASCEND)
def test_ascend_gdn_forward_core(version: str) -> None:
    source = ascend(version)
    assert [info.name for info in source.classes_defining("vllm_ascend.ops.gdn", "_forward_core")] == [
        "AscendGatedDeltaNetAttention"]
    assert source.classes_defining("vllm_ascend.ops.gdn", "_forward_core")[0].bases == ("GatedDeltaNetAttention",)
    seam = source.resolve("vllm_ascend.ops.gdn", "AscendGatedDeltaNetAttention._forward_core")
    assert source.parameters("vllm_ascend.ops.gdn", "AscendGatedDeltaNetAttention._forward_core") == (
        "self", "mixed_qkv", "b", "a", "core_attn_out")
    for shape in ("gather:ssm_state[prefill_state_indices]", "clear:clear_ssm_states(_, prefill_has_initial_state)",
                  "scatter:ssm_state[prefill_state_indices]="):
        assert check_shape(shape, source, None, seam).ok, shape
    assert source.resolve("vllm_ascend.ops.gdn", "clear_ssm_states").module == "vllm_ascend.ops.triton.fla.utils"
