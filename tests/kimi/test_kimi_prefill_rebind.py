"""vLLM 0.34's extensible KV cache rebind (``extend_kv_cache`` stood in here): plans re-validated, republished at once.

The stand-in rebinds each layer's recurrent state to a view with fewer rows (same pointer and strides), as
vLLM 0.34's ``extend_kv_cache`` does through ``bind_kv_caches``; anything else that changed is refused with the
layer's name and nothing stays published. (Not yet: the republish compiles again -- issue 27, deliverable 2.)
"""

from __future__ import annotations

import kimi_workload
import pytest

from kda_patches.ledger import get_ledger
from kda_patches.routing import rebind
from kda_patches.routing.proof import PLAN_ATTRIBUTE


def _rebind_rows(world: kimi_workload.World, rows: int, clone: str | None = None):
    def extend_kv_cache(runner, kv_cache_config, num_blocks):
        for name, layer in world.layers.items():
            cache = list(layer.kv_cache)
            cache[1] = cache[1].clone() if name == clone else cache[1][:rows]
            layer.kv_cache = type(layer.kv_cache)(cache) if isinstance(layer.kv_cache, tuple) else cache
    return extend_kv_cache


def test_rebind_to_fewer_rows_republishes_every_layer_and_records_it(load_reference):
    world = kimi_workload.build_world(load_reference(patched=True), num_layers=2, max_num_seqs=8)
    kimi_workload.start_world(world)
    before = {name: getattr(layer, PLAN_ATTRIBUTE) for name, layer in world.layers.items()}
    rows = next(iter(world.layers.values())).kv_cache[1].shape[0]
    rebind.route_extend_kv_cache(_rebind_rows(world, rows - 3), (world.runner, None, rows - 3), {}, "kimi_prefill")
    for name, layer in world.layers.items():
        binding = getattr(layer, PLAN_ATTRIBUTE)
        assert binding is not None and binding is not before[name]
    fact = get_ledger().snapshot()["facts"]["kimi_prefill"]["rebind"]
    assert fact["ok"] and fact["recompiled"]
    assert {entry["old_rows"] - entry["new_rows"] for entry in fact["layers"].values()} == {3}
    assert sorted(fact["layers"]) == sorted(world.layers)


def test_rebind_that_moves_a_cache_fails_naming_the_layer_and_publishes_nothing(load_reference):
    world = kimi_workload.build_world(load_reference(patched=True), num_layers=2, max_num_seqs=8)
    kimi_workload.start_world(world)
    moved = sorted(world.layers)[1]
    rows = world.layers[moved].kv_cache[1].shape[0]
    with pytest.raises(RuntimeError, match=moved.replace(".", r"\.") + r".*data_ptr"):
        rebind.route_extend_kv_cache(_rebind_rows(world, rows, clone=moved), (world.runner, None, rows), {},
                                     "kimi_prefill")
    assert all(getattr(layer, PLAN_ATTRIBUTE, None) is None for layer in world.layers.values())
