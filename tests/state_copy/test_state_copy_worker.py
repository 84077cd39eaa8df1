"""Worker initialization: dedup, all-or-nothing publishing, independent workers, routing, ledger."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from state_copy_helpers import bits

import kda_patches
from kda_patches.ledger import get_ledger
from kda_patches.state_copy import device as device_module
from kda_patches.state_copy import naive, variants, worker
from kda_patches.state_copy.context import use_plans
from kda_patches.state_copy.errors import LayoutError
from kda_patches.state_copy.plan import LayerStatePlan, initialize


def facts():
    return get_ledger().snapshot()["facts"]["state_copy"]


def test_same_signature_shares_one_plan_each_layer_gets_a_binding(make_cache, device):
    first, second = make_cache(seed=1), make_cache(seed=2)  # same layout and alignment class
    fewer = make_cache(num_rows=5, seed=4)  # the same layout but for the row count: a runtime argument, one plan
    other = make_cache(gap=9)  # another row stride
    half = make_cache(dtype=torch.float16)
    bindings = initialize({"l0.kda": first.state, "l1.kda": second.state, "l2.kda": other.state,
                           "l3.kda": half.state, "l4.kda": fewer.state}, 8)
    assert set(bindings) == {"l0.kda", "l1.kda", "l2.kda", "l3.kda", "l4.kda"}
    assert all(isinstance(binding, LayerStatePlan) for binding in bindings.values())
    assert bindings["l0.kda"].plan is bindings["l1.kda"].plan is bindings["l4.kda"].plan
    assert bindings["l0.kda"].plan is not bindings["l2.kda"].plan
    assert [bindings[name].kind for name in sorted(bindings)] == ["fused", "fused", "fused", "fallback", "fused"]
    assert bindings["l0.kda"].layer_name == "l0.kda" and bindings["l1.kda"].layer_name == "l1.kda"
    assert all(binding.plan.sealed for binding in bindings.values())
    recorded = facts()
    assert recorded["l0.kda"]["kind"] == "fused" and recorded["l0.kda"]["table"] == recorded["l1.kda"]["table"]
    assert recorded["l0.kda"]["shared_by"] == 3 and recorded["l3.kda"]["kind"] == "fallback"
    assert recorded["initialization"] == {"ok": True, "layers": 5, "tables": 3}
    indices = torch.tensor([5, 0], device=device)  # row 5 exists in the 6-row caches only
    for name, cache in (("l0.kda", first), ("l1.kda", second), ("l4.kda", fewer)):
        gathered = bindings[name].gather(cache.state, indices)
        assert torch.equal(bits(gathered), bits(naive.gather_states(cache.state, indices)))
    assert not bits(bindings["l4.kda"].gather(fewer.state, indices)[0]).any()


def test_any_failure_publishes_nothing_and_names_the_layer(make_cache, device):
    good = make_cache()
    bad = torch.zeros((4, 2, 8, 3), device=device).transpose(2, 3)
    with pytest.raises(RuntimeError, match=r"layer 'bad\.kda'.*dense") as info:
        initialize({"good.kda": good.state, "bad.kda": bad}, 8)
    assert "no plan was published" in str(info.value)
    assert facts()["initialization"]["ok"] is False and facts()["initialization"]["layer"] == "bad.kda"


def test_compile_failure_on_one_layout_fails_startup(make_cache, monkeypatch):
    good, other = make_cache(), make_cache(gap=9)
    original = variants.compile_variant
    plan_module = __import__("kda_patches.state_copy.plan", fromlist=["compile_variant"])

    def flaky(name, kernel, scratch, constexprs, *args, **kwargs):
        if constexprs[0] == other.state.stride(0):  # ROW_STRIDE, the first constexpr
            raise RuntimeError("simulated compiler crash")
        return original(name, kernel, scratch, constexprs, *args, **kwargs)

    monkeypatch.setattr(plan_module, "compile_variant", flaky)
    with pytest.raises(RuntimeError, match=r"at prepare for layer 'b'.*simulated compiler crash"):
        initialize({"a": good.state, "b": other.state}, 4)


def test_seal_failure_fails_startup(make_cache, monkeypatch):
    cache = make_cache()
    calls = []
    original = variants.snapshot_configuration
    plan_module = __import__("kda_patches.state_copy.plan", fromlist=["snapshot_configuration"])

    def drifting():
        calls.append(1)
        snapshot = original()
        if len(calls) > 1:
            snapshot["triton"] = "0.0-other"
        return snapshot

    monkeypatch.setattr(plan_module, "snapshot_configuration", drifting)
    with pytest.raises(RuntimeError, match=r"at seal for layer 'a'.*config_drift"):
        initialize({"a": cache.state}, 4)


def _pdl_breaks(monkeypatch, stage: str) -> None:
    """Make every plan asked for PDL (``auto`` or ``True``) fail at ``stage``; plain plans prepare as usual."""
    plan_module = __import__("kda_patches.state_copy.plan", fromlist=["PLAN_CLASSES"])
    for kind, cls in list(plan_module.PLAN_CLASSES.items()):
        class Failing(cls):
            @classmethod
            def prepare(klass, *args, pdl=False, _base=cls, **kwargs):
                plan = _base.prepare.__func__(klass, *args, pdl=pdl, **kwargs)
                if pdl is not False and stage == "prepare":
                    raise RuntimeError("ptxas: griddepcontrol unsupported (simulated)")
                if pdl is not False:
                    plan.seal = lambda: (_ for _ in ()).throw(RuntimeError("scratch launch failed (simulated)"))
                return plan

        monkeypatch.setitem(plan_module.PLAN_CLASSES, kind, Failing)


@pytest.mark.parametrize("stage", ["prepare", "seal"])
def test_a_pdl_plan_that_fails_under_auto_is_prepared_plain_and_says_why(make_cache, monkeypatch, stage):
    """``KDA_PATCHES_PDL=auto`` (the default): PDL is the target's offer, so its failure falls back to plain
    launches, recorded per layer; the same failure with PDL asked for explicitly fails the startup."""
    cache = make_cache()
    _pdl_breaks(monkeypatch, stage)
    bindings = initialize({"a": cache.state}, 4, pdl="auto")
    assert bindings["a"].plan.sealed and facts()["a"]["pdl"] is False
    dropped = facts()["a"]["pdl_dropped"]
    assert f"failed at {stage}" in dropped and "simulated" in dropped and "plain launches" in dropped
    with pytest.raises(RuntimeError, match=rf"at {stage} for layer 'a'.*simulated"):
        initialize({"a": cache.state}, 4, pdl=True)
    plain = initialize({"a": cache.state}, 4, pdl=False)  # never asked: nothing dropped
    assert plain["a"].plan.sealed and "pdl_dropped" not in facts()["a"]


def test_two_workers_in_one_process_are_independent(make_cache, device):
    cache_a, cache_b = make_cache(seed=1), make_cache(seed=2)
    worker_a = initialize({"layer": cache_a.state}, 4)
    worker_b = initialize({"layer": cache_b.state}, 2)
    assert worker_a["layer"].plan is not worker_b["layer"].plan
    assert worker_a["layer"].plan.max_selected == 4 and worker_b["layer"].plan.max_selected == 2
    indices = torch.tensor([1, 2, 3], device=device)
    with use_plans(worker_b), use_plans(worker_a):  # innermost context wins
        out = torch.ops.kda_patches.state_gather(cache_a.state, indices, None, "layer")
    assert torch.equal(bits(out), bits(naive.gather_states(cache_a.state, indices)))
    with use_plans(worker_b), pytest.raises(Exception, match="max_selected=2"):
        torch.ops.kda_patches.state_gather(cache_b.state, indices, None, "layer")


def test_ascend_a5_predicate_and_routing_with_fakes():
    assert device_module.is_ascend_a5(260)
    assert not device_module.is_ascend_a5(250) and not device_module.is_ascend_a5(222)
    assert device_module.is_ascend_a5("Ascend950PR_9589") and device_module.is_ascend_a5("ascend950dt")
    assert not device_module.is_ascend_a5("Ascend910_9391") and not device_module.is_ascend_a5(None)
    npu = SimpleNamespace(type="npu")
    assert device_module.route_plan(npu, torch.bfloat16, soc=260).kind == "fused"
    route = device_module.route_plan(npu, torch.float32, soc=253)
    assert route.kind == "fallback" and "950" in route.reason and route.native is False
    assert device_module.route_plan(npu, torch.float16, soc=260).kind == "fallback"
    assert device_module.route_plan(SimpleNamespace(type="cuda"), torch.float32).kind == "fused"
    assert device_module.route_plan(SimpleNamespace(type="cuda"), torch.float16).kind == "fallback"


def test_npu_soc_is_probed_from_torch_npu(monkeypatch):
    fake_torch_npu = SimpleNamespace(npu=SimpleNamespace(get_soc_version=lambda: 260))
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", fake_torch_npu)
    assert device_module.route_plan(SimpleNamespace(type="npu"), torch.float32).kind == "fused"
    fake_torch_npu.npu.get_soc_version = lambda: 251
    assert device_module.route_plan(SimpleNamespace(type="npu"), torch.float32).kind == "fallback"


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(device_module, "interpreter_active", lambda: False)
    with pytest.raises(LayoutError, match="TRITON_INTERPRET"):
        device_module.route_plan(torch.device("cpu"), torch.float32)


def test_force_triton_never_selects_a_native_op(make_cache, monkeypatch):
    flags = kda_patches.flags.parse_flags({"KDA_PATCHES_FORCE_TRITON": "1"})
    monkeypatch.setattr(kda_patches, "current_flags", lambda: flags)
    bindings = initialize({"forced": make_cache().state}, 2)
    assert bindings["forced"].kind == "fused"
    assert facts()["forced"]["native"] is False and "FORCE_TRITON" in facts()["forced"]["native_op"]
    assert worker.LayerStatePlan is LayerStatePlan
