"""Worker startup hook of the kimi_prefill patch: prepare all, seal all, publish all at once -- or nothing."""

from __future__ import annotations

import kimi_workload
import pytest
import torch

from kda_patches.ledger import get_ledger
from kda_patches.routing import startup
from kda_patches.routing.proof import PLAN_ATTRIBUTE, PlanNotPublished


def published(world: kimi_workload.World) -> dict[str, object]:
    return {name: getattr(layer, PLAN_ATTRIBUTE, None) for name, layer in world.layers.items()}


def test_startup_publishes_one_binding_per_layer_with_the_runners_max_num_seqs(load_reference, monkeypatch):
    from kda_patches.state_copy import worker

    calls = []
    real = worker.initialize

    def recording(states, max_selected, *args, **kwargs):
        calls.append((sorted(states), max_selected))
        return real(states, max_selected, *args, **kwargs)

    monkeypatch.setattr(worker, "initialize", recording)
    modules = load_reference(patched=True)
    world = kimi_workload.build_world(modules, num_layers=3, max_num_seqs=48, runner="NPUModelRunner")
    kimi_workload.start_world(world)
    assert calls == [(sorted(world.layers), 48)]  # NPU runner -> GPU runner: only the outer call prepares
    bindings = published(world)
    assert all(binding is not None and binding.layer_name == name for name, binding in bindings.items())
    facts = get_ledger().snapshot()["facts"]["kimi_prefill"]
    assert facts["startup"] == {"ok": True, "layers": 3, "max_num_seqs": 48}
    assert all(facts[name]["max_selected"] == 48 for name in world.layers)


@pytest.mark.parametrize("bad", ["unbound", "transposed"])
def test_startup_with_one_bad_layer_publishes_nothing_and_names_it(load_reference, bad):
    """An unbound cache or a layout no plan takes: RuntimeError naming that layer; no layer gets a plan."""
    modules = load_reference(patched=True)
    runner_module = modules["kimi_runner"]
    spec = (runner_module.StateCacheSpec(80, bind=False) if bad == "unbound"
            else runner_module.StateCacheSpec(80, layout="transposed"))
    world = kimi_workload.build_world(modules, num_layers=3, specs={1: spec})
    failures = get_ledger().counters("kimi_prefill").get("startups_failed", 0)
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.self_attn") as raised:
        world.runner.initialize_kv_cache(world.config)
    assert "no state-copy plan was published" in str(raised.value) or "no plan was published" in str(raised.value)
    assert all(binding is None for binding in published(world).values())
    assert get_ledger().counters("kimi_prefill")["startups_failed"] == failures + 1
    assert get_ledger().snapshot()["facts"]["kimi_prefill"]["startup"]["ok"] is False
    good = world.layers["model.layers.0.self_attn"]
    batch = kimi_workload.make_batches(1, 80, 2, 8, torch.int32, torch.bfloat16, torch.device("cpu"), ((2, 3, 5),))[0]
    with pytest.raises(PlanNotPublished, match=r"model\.layers\.0\.self_attn"):
        kimi_workload.run_batch(world, good, batch)


def test_reinitializing_the_cache_withdraws_stale_plans_first(load_reference):
    """A second ``initialize_kv_cache`` that fails leaves no plan bound to the previous cache."""
    modules = load_reference(patched=True)
    world = kimi_workload.build_world(modules, num_layers=2)
    kimi_workload.start_world(world)
    assert all(binding is not None for binding in published(world).values())
    runner_module = modules["kimi_runner"]
    world.config.specs["model.layers.1.self_attn"] = runner_module.StateCacheSpec(80, layout="transposed")
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.self_attn"):
        world.runner.initialize_kv_cache(world.config)
    assert all(binding is None for binding in published(world).values())


def test_only_seam_layers_get_plans(load_reference):
    """Layers of unpatched classes are left alone, also when they carry the fork's ``_requires_kda_state_copy``.

    That marker is vllm-ascend >= 0.30's own: such a fork prepares its plan itself (fork-native), so the
    overlay's startup must not prepare a second one for it.
    """
    modules = load_reference(patched=True)
    world = kimi_workload.build_world(modules, num_layers=1)

    class Foreign:  # e.g. a GDN layer of another model in the same forward context
        num_heads, head_dim = 2, 8

        def bind_kv_cache(self, kv_cache):
            self.kv_cache = kv_cache

    marked = Foreign()
    marked._requires_kda_state_copy = True
    world.runner.compilation_config.static_forward_context.update({"other": Foreign(), "marked": marked})
    world.config.specs.update({"other": world.config.specs["model.layers.0.self_attn"],
                               "marked": world.config.specs["model.layers.0.self_attn"]})
    world.runner.initialize_kv_cache(world.config)
    context = world.runner.compilation_config.static_forward_context
    assert startup.seam_of(world.layers["model.layers.0.self_attn"]) is not None
    assert startup.seam_of(context["marked"]) is None
    assert getattr(context["other"], PLAN_ATTRIBUTE, None) is None
    assert getattr(context["marked"], PLAN_ATTRIBUTE, None) is None
    assert getattr(context["model.layers.0.self_attn"], PLAN_ATTRIBUTE) is not None


def test_a_runner_without_kimi_layers_publishes_nothing(load_reference):
    modules = load_reference(patched=True)
    runner = modules["kimi_runner"].GPUModelRunner({}, max_num_seqs=8)
    runner.initialize_kv_cache(modules["kimi_runner"].KVCacheConfig())
    assert get_ledger().snapshot()["facts"]["kimi_prefill"]["startup"] == {"ok": True, "layers": 0}


def test_unpatched_runner_publishes_nothing(load_reference):
    """``KDA_PATCHES=0`` (nothing registered): caches are bound, no plan appears, prefill runs the fork's copy."""
    modules = load_reference(patched=False)
    world = kimi_workload.build_world(modules, num_layers=1)
    kimi_workload.start_world(world)
    assert all(binding is None for binding in published(world).values())
    layer = world.layers["model.layers.0.self_attn"]
    batch = kimi_workload.make_batches(1, 80, 2, 8, torch.int64, torch.bfloat16, torch.device("cpu"), ((2, 3, 5),))[0]
    assert kimi_workload.run_batch(world, layer, batch).shape == batch.v.shape
