"""vllm-ascend >= 0.30 ships its own Kimi plan: kimi_prefill stands aside (default) or publishes into its seam.

Stand-in ``vllm_ascend`` 0.30.0rc2 modules follow the release's contract (``vllm_ascend/ops/kda_state_copy_plan.py``
``initialize_kda_state_copy(static_forward_context, max_selected)`` giving each ``_requires_kda_state_copy`` layer
``_ascend_kda_state_copy`` + ``_kda_state_copy_ready``; ``_run_prefill`` calling
``state_copy.gather(recurrent_state, state_indices, has_initial_state)`` /
``state_copy.scatter(recurrent_state, final_state, state_indices)``; both runners call the initializer at the
end of ``initialize_kv_cache``). The fork's plans are torch stand-ins here (its kernels need an NPU); the
released function bodies themselves are executed by the release-conformance suite.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

import kda_patches
from kda_patches.flags import Flags
from kda_patches.ledger import get_ledger
from kda_patches.patches import kimi_prefill
from kda_patches.registry import Patch, register_patch, revert_patch
from kda_patches.routing.proof import PLAN_ATTRIBUTE

PLAN_MODULE = '''
import torch


class KDAStateCopyPlan:
    def gather(self, state, indices, flags):
        packed = state[indices].clone()
        packed.masked_fill_(~flags.view(-1, 1, 1, 1), 0)
        return packed

    def scatter(self, state, packed, indices):
        state[indices] = packed.to(state.dtype)


class StridedKDAFallbackPlan(KDAStateCopyPlan):
    pass


def initialize_kda_state_copy(static_forward_context, max_selected):
    for name, layer in static_forward_context.items():
        if not getattr(layer, "_requires_kda_state_copy", False):
            continue
        state = layer.kv_cache[1]
        layer._ascend_kda_state_copy = KDAStateCopyPlan() if state.stride(0) == state[0].numel() \\
            else StridedKDAFallbackPlan()
        layer._kda_state_copy_ready = True
'''

KIMI_KDA = '''
class AscendKimiK3DeltaAttention:
    _requires_kda_state_copy = True

    def __init__(self, prefix):
        self.prefix = prefix
        self._ascend_kda_state_copy = None

    def _run_prefill(self, q, k, v, raw_gate, beta, recurrent_state, state_indices, has_initial_state,
                     prebuilt_metadata):
        state_copy = getattr(self, "_ascend_kda_state_copy", None)
        if state_copy is None or not getattr(self, "_kda_state_copy_ready", False):
            raise RuntimeError("KDA state copy requires worker cache initialization before prefill")
        initial_state_vk = state_copy.gather(recurrent_state, state_indices, has_initial_state)
        final_state = initial_state_vk.float() * 0.5 + 1.0
        state_copy.scatter(recurrent_state, final_state, state_indices)
        return final_state.sum(dim=(1, 2, 3))
'''

RUNNER = '''
from types import SimpleNamespace

import torch


class NPUModelRunner:
    def __init__(self, layers, max_num_seqs, gap):
        self.compilation_config = SimpleNamespace(static_forward_context=dict(layers))
        self.scheduler_config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.gap = gap

    def initialize_kv_cache(self, kv_cache_config, kv_cache_allocation_context=None):
        for name, layer in self.compilation_config.static_forward_context.items():
            rows, heads, dim = kv_cache_config[name]
            raw = torch.full((rows * (heads * dim * dim + self.gap),), -7.5)
            state = raw.as_strided((rows, heads, dim, dim), (heads * dim * dim + self.gap, dim * dim, dim, 1))
            state.copy_(torch.randn(state.shape, generator=torch.Generator().manual_seed(3)))
            layer.kv_cache = (torch.zeros(rows, 3), state)
        from vllm_ascend.ops.kda_state_copy_plan import initialize_kda_state_copy

        initialize_kda_state_copy(self.compilation_config.static_forward_context, self.scheduler_config.max_num_seqs)
'''

MODULES = ("vllm_ascend", "vllm_ascend.ops", "vllm_ascend.ops.kimi_kda", "vllm_ascend.ops.kda_state_copy_plan",
           "vllm_ascend.worker", "vllm_ascend.worker.model_runner_v1", "vllm_ascend.worker.v2",
           "vllm_ascend.worker.v2.model_runner")


@pytest.fixture
def fork_030(tmp_path, monkeypatch, request):
    """Write and import the 0.30 stand-ins under a copy of the real record (``request.param``: the plan switch)."""
    monkeypatch.setattr(kda_patches, "_FLAGS", Flags(strict=True, kimi_plan=request.param))
    package = tmp_path / "vllm_ascend"
    for folder in (package, package / "ops", package / "worker", package / "worker" / "v2"):
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text('__version__ = "0.30.0rc2"\n')
    (package / "ops" / "kimi_kda.py").write_text(textwrap.dedent(KIMI_KDA))
    (package / "ops" / "kda_state_copy_plan.py").write_text(textwrap.dedent(PLAN_MODULE))
    (package / "worker" / "model_runner_v1.py").write_text(textwrap.dedent(RUNNER))
    (package / "worker" / "v2" / "model_runner.py").write_text(textwrap.dedent(RUNNER))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in MODULES:
        sys.modules.pop(name, None)
    patch = Patch(f"kimi_prefill_fork_{request.param}_{request.node.name}", "test", kimi_prefill.PATCH.targets)
    register_patch(patch, strict=True)
    modules = {name: importlib.import_module(name) for name in MODULES}
    yield patch, modules
    revert_patch(patch)
    for name in MODULES:
        sys.modules.pop(name, None)


def start(modules, gap: int = 0):
    layers = {f"model.layers.{i}.self_attn": modules["vllm_ascend.ops.kimi_kda"].AscendKimiK3DeltaAttention(
        f"model.layers.{i}.self_attn") for i in range(2)}
    runner = modules["vllm_ascend.worker.model_runner_v1"].NPUModelRunner(layers, max_num_seqs=8, gap=gap)
    runner.initialize_kv_cache({name: (10, 2, 4) for name in layers})
    return layers


def prefill(layer) -> torch.Tensor:
    indices = torch.tensor([4, 0, 9], dtype=torch.int64)
    flags = torch.tensor([False, True, True])
    return layer._run_prefill(None, None, None, None, None, layer.kv_cache[1], indices, flags, None)


@pytest.mark.parametrize("fork_030", ["fork"], indirect=True)
@pytest.mark.parametrize("gap", [0, 6], ids=["dense", "gapped"])
def test_default_stands_aside_and_records_the_forks_plan_kind(fork_030, monkeypatch, gap):
    from kda_patches.state_copy import worker

    prepared = []
    monkeypatch.setattr(worker, "initialize", lambda *args, **kwargs: prepared.append(args))
    patch, modules = fork_030
    states = get_ledger().snapshot()["patches"][patch.name]["targets"]
    assert states["vllm_ascend.ops.kda_state_copy_plan:initialize_kda_state_copy"]["state"] == "applied"
    assert states["vllm_ascend.ops.kimi_kda:AscendKimiK3DeltaAttention._run_prefill"]["state"] != "applied"
    layers = start(modules, gap)
    assert prepared == []  # nothing of the overlay's is prepared
    facts = get_ledger().snapshot()["facts"]["kimi_prefill"]
    kind = "fused" if gap == 0 else "fallback"
    for name, layer in layers.items():
        assert facts[name] == {"decision": "fork-native", "plan_kind": kind,
                               "plan_class": type(layer._ascend_kda_state_copy).__name__, "ready": True}
        assert getattr(layer, PLAN_ATTRIBUTE, None) is None
    assert facts["startup"]["decision"] == "fork-native"
    before = dict(get_ledger().counters("kimi_prefill"))
    prefill(next(iter(layers.values())))  # the fork's own plan runs; not seen by the overlay
    assert get_ledger().counters("kimi_prefill") == before
    line = kimi_prefill.format_status_line(get_ledger().snapshot())
    assert f"fork-native:{kind}=2" in line


@pytest.mark.parametrize("fork_030", ["overlay"], indirect=True)
def test_overlay_publishes_the_sealed_plan_into_the_forks_seam(fork_030):
    _, modules = fork_030
    layers = start(modules, gap=6)
    layer = next(iter(layers.values()))
    binding = layer._ascend_kda_state_copy
    assert type(binding).__name__ == "LayerStatePlan" and binding.plan.sealed
    assert getattr(layer, PLAN_ATTRIBUTE) is binding and layer._kda_state_copy_ready is True
    facts = get_ledger().snapshot()["facts"]["kimi_prefill"]
    assert facts[layer.prefix]["decision"] == "overlay" and facts[layer.prefix]["fork_plan_replaced"] == "fallback"
    assert "unverified on NPUs" in facts[layer.prefix]["verified"]
    # the fork's body through the overlay plan equals the fork's body through the fork's own plan
    expected_state = layer.kv_cache[1].clone()
    fork_plan = modules["vllm_ascend.ops.kda_state_copy_plan"].StridedKDAFallbackPlan()
    out = prefill(layer)
    indices = torch.tensor([4, 0, 9])
    packed = fork_plan.gather(expected_state, indices, torch.tensor([False, True, True]))
    final = packed.float() * 0.5 + 1.0
    fork_plan.scatter(expected_state, final, indices)
    assert torch.equal(out, final.sum(dim=(1, 2, 3)))
    assert torch.equal(layer.kv_cache[1], expected_state)
