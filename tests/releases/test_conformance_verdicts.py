"""Conformance verdicts on the real releases, for records built here that reproduce each known failure mode.

Each record is a :class:`Patch` of this test (its own targets, real module names); the releases are the
registry's (cached). The verdict rules are in ``kda_patches/releases/conformance.py``.
"""

from __future__ import annotations

import pytest

from kda_patches.registry import Patch, Target
from kda_patches.releases.conformance import check_stack, runtime_decisions
from kda_patches.releases.matrix import build_stack, parse_stack

KIMI = "vllm_ascend.ops.kimi_kda"
RUNNER_V1 = "vllm_ascend.worker.model_runner_v1"
RUN_PREFILL = ("self", "q", "k", "v", "raw_gate", "beta", "recurrent_state", "state_indices", "has_initial_state",
               "prebuilt_metadata")
SEAM_SHAPES = ("gather:recurrent_state[state_indices]", "clear:clear_ssm_states(_, has_initial_state)",
               "scatter:recurrent_state[state_indices]=")


def _noop(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def ascend_target(module: str, qualname: str, parameters, group: str | None = None, shapes=(),
                  min_version: str = "0.26", max_version: str = "0.40") -> Target:
    return Target(module, qualname, _noop, "vllm-ascend", "vllm-ascend", min_version, max_version, parameters,
                  group=group, shapes=shapes)


def verdict(patch: Patch, stack: str) -> dict:
    return check_stack(build_stack(stack), {patch.name: patch})["patches"][patch.name]


def seam_and_startup(runner_parameters, group: str | None = "kimi-ascend", cls: str = "AscendKimiK3DeltaAttention",
                     shapes=SEAM_SHAPES) -> Patch:
    return Patch("t_kimi", "test record", (
        ascend_target(KIMI, f"{cls}._run_prefill", RUN_PREFILL, group, shapes),
        ascend_target(RUNNER_V1, "NPUModelRunner.initialize_kv_cache", runner_parameters, group)))


def test_028_runner_drift_breaks_a_grouped_seam_and_startup() -> None:
    # today's main: runner fingerprint (self, kv_cache_config) on 0.28, whose runner takes a third parameter
    entry = verdict(seam_and_startup(("self", "kv_cache_config")), "vllm-ascend==0.28.0rc1")
    assert entry["verdict"] == "broken"
    assert "kv_cache_allocation_context" in entry["reason"] and "KDA_PATCHES_STRICT=1" in entry["reason"]
    states = {t["key"]: t["runtime"] for t in entry["targets"]}
    assert set(states.values()) == {"skipped"}  # the group applies neither member


def test_028_ungrouped_seam_would_run_without_its_startup() -> None:
    entry = verdict(seam_and_startup(("self", "kv_cache_config"), group=None), "vllm-ascend==0.28.0rc1")
    states = {t["key"]: t["runtime"] for t in entry["targets"]}
    assert states == {f"{KIMI}:AscendKimiK3DeltaAttention._run_prefill": "ok",
                      f"{RUNNER_V1}:NPUModelRunner.initialize_kv_cache": "skipped"}
    assert entry["verdict"] == "broken"


def test_fixed_runner_fingerprint_works_on_028_and_029() -> None:
    record = seam_and_startup(("self", "kv_cache_config", "kv_cache_allocation_context"))
    for stack in ("vllm-ascend==0.28.0rc1", "vllm-ascend==0.29.0rc1"):
        entry = verdict(record, stack)
        assert entry["verdict"] == "works", (stack, entry["reason"])
        seam = entry["targets"][0]
        assert seam["fingerprint"] == "match" and all(shape["ok"] for shape in seam["shapes"].values())


def test_030_seam_wrapped_without_its_gather_is_broken() -> None:
    entry = verdict(seam_and_startup(("self", "kv_cache_config", "kv_cache_allocation_context")),
                    "vllm-ascend==0.30.0rc2")
    assert entry["verdict"] == "broken"
    assert "gather:recurrent_state[state_indices]" in entry["reason"]
    assert "no `recurrent_state[state_indices]` read in AscendKimiK3DeltaAttention._run_prefill" in entry["reason"]


def test_fork_native_observer_stands_down_on_030_and_is_inert_before() -> None:
    record = Patch("t_fork", "test record", (
        ascend_target("vllm_ascend.ops.kda_state_copy_plan", "initialize_kda_state_copy", None,
                      shapes=("fork:kda_state_copy_plan",)),))
    entry = verdict(record, "vllm-ascend==0.30.0rc1")
    assert entry["verdict"] == "stands down"
    assert "vllm_ascend.ops.kda_state_copy_plan is shipped" in entry["reason"]
    before = verdict(record, "vllm-ascend==0.29.0rc1")
    assert before["verdict"] == "inert"
    assert "vllm_ascend.ops.kda_state_copy_plan is not shipped by vllm-ascend==0.29.0rc1" in before["reason"]
    assert before["targets"][0]["runtime"] == "absent"


def test_026_kimi_class_name_is_inert_with_a_hint() -> None:
    entry = verdict(seam_and_startup(("self", "kv_cache_config"), group=None, shapes=()), "vllm-ascend==0.26.0rc1")
    seam = entry["targets"][0]
    assert seam["runtime"] == "not-applicable" and not seam["resolves"]
    assert seam["hint"] == ("_run_prefill is defined by AscendKimiGatedDeltaNetAttention(KimiGatedDeltaNetAttention) "
                            "in vllm_ascend.ops.kimi_kda")
    fixed = verdict(seam_and_startup(("self", "kv_cache_config"), cls="AscendKimiGatedDeltaNetAttention"),
                    "vllm-ascend==0.26.0rc1")
    assert fixed["verdict"] == "works", fixed["reason"]


def test_out_of_range_only_patch_is_inert_with_the_range() -> None:
    record = Patch("t_upstream", "test record", (
        Target("vllm.models.kimi_k3.nvidia.kda", "KimiK3DeltaAttention._forward", _noop, min_version="0.30",
               max_version="0.40", parameters=("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out"),
               shapes=("read:self.kv_cache",)),))
    entry = verdict(record, "vllm==0.27.1")
    assert entry["verdict"] == "inert" and "declared for vllm>=0.30,<0.40, found 0.27.1" in entry["reason"]
    assert verdict(record, "vllm==0.33.0")["verdict"] == "works"
    newer = verdict(Patch("t_old", "test record", (
        Target("vllm.v1.core.kv_cache_utils", "get_kv_cache_configs", _noop, min_version="0.13", max_version="0.33",
               parameters=("vllm_config", "kv_cache_specs", "available_memory")),)), "vllm==0.33.0")
    assert newer["verdict"] == "broken" and "newer than every range" in newer["reason"]


def test_group_across_packages_reads_the_paired_vllm() -> None:
    # a group whose members live in vllm and vllm-ascend: checked together on the paired stack
    record = Patch("t_pair", "test record", (
        Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.initialize_kv_cache", _noop, "vllm", "vllm",
               "0.26", "0.30", ("self", "kv_cache_config", "is_profiling"), group="g"),
        ascend_target(RUNNER_V1, "NPUModelRunner.initialize_kv_cache", ("self", "kv_cache_config"), "g"),))
    assert parse_stack("vllm-ascend==0.27.1rc1") == [("vllm-ascend", "0.27.1rc1"), ("vllm", "0.27.1")]
    assert verdict(record, "vllm-ascend==0.27.1rc1")["verdict"] == "works"
    decisions = runtime_decisions(record, build_stack("vllm-ascend==0.28.0rc1"))
    assert {verdict.state for verdict in decisions.values()} == {"skipped"}
    assert "kv_cache_allocation_context" in next(iter(decisions.values())).reason


def test_unknown_shape_name_in_a_record_is_broken_when_wrapped() -> None:
    record = Patch("t_shape", "test record", (
        Target("vllm.v1.worker.utils", "allocate_kv_cache", _noop, min_version="0.30", max_version="0.40",
               shapes=("no-such-shape",)),))
    entry = verdict(record, "vllm==0.32.0")
    assert entry["verdict"] == "broken" and "unknown shape name 'no-such-shape'" in entry["reason"]


@pytest.mark.parametrize("bad", ["vllm", "vllm=0.32.0", "torch==2.0.0", "vllm==0.32.0+vllm==0.33.0"])
def test_bad_stacks_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        build_stack(bad)


def test_ascend_rows_are_judged_by_the_forks_targets() -> None:
    upstream = Target("vllm.models.kimi_k3.nvidia.kda", "KimiK3DeltaAttention._forward", _noop, min_version="0.27",
                      max_version="0.40", parameters=("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out"),
                      shapes=("read:self.kv_cache",))
    observer = ascend_target("vllm_ascend.ops.kda_state_copy_plan", "initialize_kda_state_copy", None,
                             min_version="0.30", shapes=("fork:kda_state_copy_plan",))
    both = verdict(Patch("t_both", "test record", (observer, upstream)), "vllm-ascend==0.30.0rc2")
    assert both["verdict"] == "stands down"
    assert "also wrapped, upstream code the vllm-ascend layers may not call: " \
           "vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention._forward" in both["reason"]
    only_upstream = verdict(Patch("t_up", "test record", (upstream,)), "vllm-ascend==0.30.0rc2")
    assert only_upstream["verdict"] == "inert"
    assert only_upstream["reason"].startswith("the patch declares no vllm-ascend target (its targets are for vllm)")
    assert verdict(Patch("t_up", "test record", (upstream,)), "vllm==0.30.0")["verdict"] == "works"


def test_a_stack_naming_one_package_twice_is_refused_before_anything_is_fetched(monkeypatch) -> None:
    from kda_patches.releases import matrix

    def no_fetch(dist: str, version: str) -> None:
        raise AssertionError(f"fetched {dist}=={version} for a stack that must be refused first")

    monkeypatch.setattr(matrix, "release_dir", no_fetch)
    with pytest.raises(ValueError, match="one release per package"):
        build_stack("vllm-ascend==0.30.0rc2+vllm-ascend==0.29.0rc1")
    with pytest.raises(ValueError, match="one release per package"):
        parse_stack("vllm==0.33.0+vllm==0.34.0")
