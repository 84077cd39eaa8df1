"""The kimi_prefill seam and its startup hooks are applied together or not at all (issue 11, deliverable 4).

Stand-in ``vllm_ascend`` modules with vllm-ascend 0.28.0rc1's signatures (``NPUModelRunner.initialize_kv_cache(
self, kv_cache_config, kv_cache_allocation_context=None)`` in both runners) are written to a temporary folder and
imported under the real ``kimi_prefill`` record. Before the fix the record expected ``(self, kv_cache_config)``:
the runner hooks were skipped while ``_run_prefill`` was wrapped, so no plan was ever published and every prefill
raised ``PlanNotPublished``. Now both are applied (and the prefill is routed), or -- when one member drifts --
neither is (and the fork's own copy runs).
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from kda_patches.ledger import get_ledger
from kda_patches.patches import kimi_prefill
from kda_patches.registry import Patch, is_applied, register_patch, revert_patch

KIMI_KDA = '''
def clear_ssm_states(ssm_states, has_initial_state):
    ssm_states.masked_fill_(~has_initial_state.view(-1, 1, 1, 1), 0)


class KimiK3DeltaAttention:
    pass


class AscendKimiK3DeltaAttention(KimiK3DeltaAttention):
    def __init__(self, prefix):
        self.prefix = prefix
        self.kv_cache = ()

    def _run_prefill(self, q, k, v, raw_gate, beta, recurrent_state, state_indices, has_initial_state,
                     prebuilt_metadata):
        initial_state_vk = recurrent_state[state_indices].contiguous()
        clear_ssm_states(initial_state_vk, has_initial_state)
        final_state = initial_state_vk.float() * 0.5 + 1.0
        recurrent_state[state_indices] = final_state.to(recurrent_state.dtype)
        return final_state.sum(dim=(1, 2, 3))
'''

RUNNER = '''
from types import SimpleNamespace

import torch


class NPUModelRunner:
    def __init__(self, layers, max_num_seqs):
        self.compilation_config = SimpleNamespace(static_forward_context=dict(layers))
        self.scheduler_config = SimpleNamespace(max_num_seqs=max_num_seqs)

    def initialize_kv_cache(self, kv_cache_config{extra}):
        for name, layer in self.compilation_config.static_forward_context.items():
            rows, heads, dim = kv_cache_config[name]
            raw = torch.full((rows * (heads * dim * dim + 8),), -7.5)
            state = raw.as_strided((rows, heads, dim, dim), (heads * dim * dim + 8, dim * dim, dim, 1))
            layer.kv_cache = (torch.zeros(rows, 3), state)
'''

MODULES = ("vllm_ascend", "vllm_ascend.ops", "vllm_ascend.ops.kimi_kda", "vllm_ascend.worker",
           "vllm_ascend.worker.model_runner_v1", "vllm_ascend.worker.v2", "vllm_ascend.worker.v2.model_runner")


def write_stand_ins(root, version: str, runner_extra: str) -> None:
    """Write a ``vllm_ascend`` stand-in package of ``version`` under ``root`` (runner signature ``+ runner_extra``)."""
    package = root / "vllm_ascend"
    for folder in (package, package / "ops", package / "worker", package / "worker" / "v2"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (package / "ops" / "kimi_kda.py").write_text(textwrap.dedent(KIMI_KDA))
    runner = textwrap.dedent(RUNNER).replace("{extra}", runner_extra)
    (package / "worker" / "model_runner_v1.py").write_text(runner)
    (package / "worker" / "v2" / "model_runner.py").write_text(runner)


@pytest.fixture
def stand_in_stack(tmp_path, monkeypatch, request):
    """Register a copy of the real record, write the stand-ins, import them; revert and forget at teardown."""
    version, extra = request.param
    write_stand_ins(tmp_path, version, extra)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in MODULES:
        sys.modules.pop(name, None)
    patch = Patch(f"kimi_prefill_stand_in_{request.node.name}", kimi_prefill.PATCH.summary, kimi_prefill.PATCH.targets)
    register_patch(patch)
    import importlib

    modules = {name: importlib.import_module(name) for name in MODULES}
    yield patch, modules
    revert_patch(patch)
    for name in MODULES:
        sys.modules.pop(name, None)


def target(patch: Patch, key: str, version: str):
    from kda_patches.registry import select_target

    return select_target(patch, key, version)


def run_prefill(modules, layer) -> torch.Tensor:
    state = layer.kv_cache[1]
    indices = torch.tensor([3, 0, 5], dtype=torch.int32)
    flags = torch.tensor([True, False, True])
    return layer._run_prefill(None, None, None, None, None, state, indices, flags, None)


SEAM = "vllm_ascend.ops.kimi_kda:AscendKimiK3DeltaAttention._run_prefill"
RUNNERS = ("vllm_ascend.worker.model_runner_v1:NPUModelRunner.initialize_kv_cache",
           "vllm_ascend.worker.v2.model_runner:NPUModelRunner.initialize_kv_cache")
ALLOCATION = ", kv_cache_allocation_context=None"


@pytest.mark.parametrize("stand_in_stack", [("0.28.0rc1", ALLOCATION)], indirect=True)
def test_028_seam_and_startup_hooks_are_applied_together_and_prefill_is_routed(stand_in_stack):
    patch, modules = stand_in_stack
    for key in (SEAM, "vllm_ascend.ops.kimi_kda:clear_ssm_states", *RUNNERS):
        assert is_applied(patch, target(patch, key, "0.28.0")), f"{key} not applied on the 0.28 stand-ins"
    states = get_ledger().snapshot()["patches"][patch.name]["targets"]
    for other in ("vllm_ascend.ops.kimi_kda:AscendKimiGatedDeltaNetAttention._run_prefill",  # 0.26's class
                  "vllm_ascend.ops.kda_state_copy_plan:initialize_kda_state_copy"):  # 0.30's own plan
        assert states[other]["state"] in ("not-applicable", "pending"), (other, states[other])

    layer = modules["vllm_ascend.ops.kimi_kda"].AscendKimiK3DeltaAttention("model.layers.0.self_attn")
    runner = modules["vllm_ascend.worker.model_runner_v1"].NPUModelRunner({layer.prefix: layer}, max_num_seqs=8)
    runner.initialize_kv_cache({layer.prefix: (8, 2, 4)}, None)
    before = dict(get_ledger().counters("kimi_prefill"))
    expected_state = layer.kv_cache[1].clone()
    out = run_prefill(modules, layer)
    after = get_ledger().counters("kimi_prefill")
    assert after.get("calls_routed", 0) - before.get("calls_routed", 0) == 1
    assert after.get("calls_refused", 0) == before.get("calls_refused", 0)
    # the same body on a plain copy of the cache: exact
    initial = expected_state[[3, 0, 5]].contiguous()
    initial[1] = 0
    final = initial.float() * 0.5 + 1.0
    expected_state[[3, 0, 5]] = final
    assert torch.equal(out, final.sum(dim=(1, 2, 3)))
    assert torch.equal(layer.kv_cache[1], expected_state)


@pytest.mark.parametrize("stand_in_stack", [("0.28.0rc1", ALLOCATION + ", unexpected=None")], indirect=True)
def test_a_drifted_runner_hook_leaves_the_seam_unwrapped_too(stand_in_stack):
    """One member drifts: no member of the group is applied; prefill runs the fork's own copy, never refused."""
    patch, modules = stand_in_stack
    for key in (SEAM, "vllm_ascend.ops.kimi_kda:clear_ssm_states", *RUNNERS):
        assert not is_applied(patch, target(patch, key, "0.28.0")), f"{key} applied although a hook drifted"
    states = get_ledger().snapshot()["patches"][patch.name]["targets"]
    assert states[SEAM]["state"] == "skipped" and "initialize_kv_cache" in states[SEAM]["reason"]
    layer = modules["vllm_ascend.ops.kimi_kda"].AscendKimiK3DeltaAttention("model.layers.0.self_attn")
    runner = modules["vllm_ascend.worker.model_runner_v1"].NPUModelRunner({layer.prefix: layer}, max_num_seqs=8)
    runner.initialize_kv_cache({layer.prefix: (8, 2, 4)}, None)
    before = dict(get_ledger().counters("kimi_prefill"))
    run_prefill(modules, layer)  # the fork's own copy; no PlanNotPublished
    assert get_ledger().counters("kimi_prefill") == before
