"""vLLM 0.34's extensible KV cache rebind (``extend_kv_cache`` stood in here): plans re-validated, republished at once,
nothing compiled.

The stand-in rebinds each layer's recurrent state to a view with fewer rows (same pointer and strides), as
vLLM 0.34's ``extend_kv_cache`` does through ``bind_kv_caches``. The plans prepared at ``initialize_kv_cache``
serve the rebound views without compiling (the row count is a runtime argument of their kernels) and bound the
indices by the rebound ``shape[0]``; anything else that changed is refused with the layer's name and nothing
stays published. Compiles are counted at ``compile_variant`` (every variant a plan prepares goes through it), and
the counter is shown to count at ``initialize_kv_cache`` first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kimi_workload
import pytest
import torch

from kda_patches.ledger import get_ledger
from kda_patches.routing import rebind
from kda_patches.routing.proof import PLAN_ATTRIBUTE
from kda_patches.state_copy import naive, variants
from kda_patches.state_copy import plan as plan_module

POISON = -3.25  # exactly representable in FP32 and BF16, and not the runner's gap poison


class CompileCounter:
    """Counts :func:`~kda_patches.state_copy.variants.compile_variant` calls, under both names it is bound to."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = variants.compile_variant

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(variants, "compile_variant", counted)
        monkeypatch.setattr(plan_module, "compile_variant", counted)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[CompileCounter]:
    yield CompileCounter(monkeypatch)


def _rebind(world: kimi_workload.World, rows: int, change: str | None = None, changed: str | None = None):
    """Return an ``extend_kv_cache`` stand-in: every layer's state becomes its first ``rows`` rows (same pointer and
    strides); layer ``changed`` instead gets a copy (``change="pointer"``) or a view with another row stride over
    the same pages (``change="strides"``)."""
    def extend_kv_cache(runner, kv_cache_config, num_blocks):
        for name, layer in world.layers.items():
            cache = list(layer.kv_cache)
            state = cache[1]
            if name == changed and change == "pointer":
                cache[1] = state.clone()
            elif name == changed and change == "strides":
                cache[1] = state.as_strided((rows // 2, *state.shape[1:]), (2 * state.stride(0), *state.stride()[1:]),
                                            state.storage_offset())
            else:
                cache[1] = state[:rows]
            layer.kv_cache = type(layer.kv_cache)(cache) if isinstance(layer.kv_cache, tuple) else cache
    return extend_kv_cache


def _started(load_reference, cache_dtype: torch.dtype = torch.float32) -> kimi_workload.World:
    world = kimi_workload.build_world(load_reference(patched=True), num_layers=2, max_num_seqs=8,
                                      cache_dtype=cache_dtype)
    kimi_workload.start_world(world)
    return world


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rebind_republishes_the_same_plans_without_compiling_and_bounds_by_the_new_rows(load_reference, compiles,
                                                                                        cache_dtype):
    world = _started(load_reference, cache_dtype)
    assert compiles.count > 0  # the counter sees the plans' compiles at initialize_kv_cache
    before = {name: getattr(layer, PLAN_ATTRIBUTE) for name, layer in world.layers.items()}
    capacity = {name: layer.kv_cache[1] for name, layer in world.layers.items()}
    old_rows = next(iter(capacity.values())).shape[0]
    new_rows = old_rows - 7
    compiles.count = 0
    rebind.route_extend_kv_cache(_rebind(world, new_rows), (world.runner, None, new_rows), {}, "kimi_prefill")
    assert compiles.count == 0  # nothing compiled after the rebind
    facts = get_ledger().snapshot()["facts"]["kimi_prefill"]
    fact = facts["rebind"]
    assert fact["ok"] and fact["recompiled"] is False and "without compiling" in fact["reason"]
    assert fact["layers"] == {name: {"old_rows": old_rows, "new_rows": new_rows, "same_data_ptr": True,
                                     "same_strides": True} for name in world.layers}
    generator = torch.Generator().manual_seed(5)
    for name, layer in world.layers.items():
        binding = getattr(layer, PLAN_ATTRIBUTE)
        assert binding is before[name] and binding.plan is before[name].plan  # republished, the same compiled plan
        state = layer.kv_cache[1]
        assert state.shape[0] == new_rows and state.data_ptr() == capacity[name].data_ptr()
        assert facts[name]["cache_shape"] == list(state.shape)
        capacity[name][new_rows:] = POISON  # the rows the rebind dropped: valid under the old capacity only
        raw = world.runner.raw_caches[name]
        indices = torch.tensor([new_rows, 0, old_rows - 1, -1, new_rows - 1, 5, new_rows + 2], dtype=torch.int32)
        flags = torch.tensor([True, True, True, True, False, True, True])
        for index_dtype in (torch.int32, torch.int64):
            gathered = binding.gather(state, indices.to(index_dtype), flags)
            assert torch.equal(_bits(gathered), _bits(naive.gather_states(state, indices, flags)))
            assert not _bits(gathered[[0, 2, 6]]).any()  # zero rows, not the poison of the dropped rows
            finals = torch.randn((len(indices), *state.shape[1:]), generator=generator)
            expected = raw.clone()
            naive.scatter_states(expected.as_strided(state.shape, state.stride(), state.storage_offset()), finals,
                                 indices)
            binding.scatter(state, finals, indices.to(index_dtype))
            assert torch.equal(_bits(raw), _bits(expected))  # every byte: rows, gaps, and the dropped rows
            assert bool((capacity[name][new_rows:] == POISON).all())
    assert compiles.count == 0


def test_an_index_equal_to_the_new_row_count_is_invalid_after_the_rebind(load_reference, compiles):
    world = _started(load_reference)
    name, layer = next(iter(world.layers.items()))
    old_rows = layer.kv_cache[1].shape[0]
    new_rows = old_rows - 1  # row new_rows still exists in the pages and was valid before the rebind
    binding = getattr(layer, PLAN_ATTRIBUTE)
    edge = torch.tensor([new_rows], dtype=torch.int64)
    assert _bits(binding.gather(layer.kv_cache[1], edge)).any()  # before: a real row
    rebind.route_extend_kv_cache(_rebind(world, new_rows), (world.runner, None, new_rows), {}, "kimi_prefill")
    state = layer.kv_cache[1]
    assert not _bits(binding.gather(state, edge, torch.tensor([True]))).any()  # after: invalid, a zero row
    raw = world.runner.raw_caches[name]
    untouched = raw.clone()
    binding.scatter(state, torch.full((1, *state.shape[1:]), 1.5), edge)
    assert torch.equal(_bits(raw), _bits(untouched))  # the scatter skipped it


def test_routed_prefill_on_the_rebound_cache_equals_the_one_on_the_capacity_view(load_reference, compiles):
    """The layer's own seam after the rebind: the same outputs and cache bytes as a twin world never rebound."""
    modules = load_reference(patched=True)
    worlds = []
    for _ in range(2):
        world = kimi_workload.build_world(modules, num_layers=1, max_num_seqs=16)
        kimi_workload.start_world(world)
        worlds.append(world)
    rebound = worlds[0]  # worlds[1] is its twin, never rebound
    new_rows = 40
    rebind.route_extend_kv_cache(_rebind(rebound, new_rows), (rebound.runner, None, new_rows), {}, "kimi_prefill")
    compiles.count = 0
    layers = [next(iter(world.layers.values())) for world in worlds]
    batches = kimi_workload.make_batches(3, new_rows, 2, 8, torch.int32, torch.bfloat16, torch.device("cpu"),
                                         kimi_workload.SMALL_BATCHES)
    for batch in batches:
        outputs = [kimi_workload.run_batch(world, layer, batch) for world, layer in zip(worlds, layers, strict=True)]
        assert torch.equal(outputs[0], outputs[1])
    raws = [next(iter(world.runner.raw_caches.values())) for world in worlds]
    assert torch.equal(_bits(raws[0]), _bits(raws[1]))
    assert compiles.count == 0 and get_ledger().counters("kimi_prefill").get("calls_refused", 0) == 0


@pytest.mark.parametrize(("change", "named"), [("pointer", "data_ptr"), ("strides", "strides")])
def test_rebind_that_changes_more_than_the_rows_fails_naming_the_layer_and_publishes_nothing(load_reference,
                                                                                           compiles, change, named):
    world = _started(load_reference)
    changed = sorted(world.layers)[1]
    rows = world.layers[changed].kv_cache[1].shape[0]
    compiles.count = 0
    with pytest.raises(RuntimeError, match=changed.replace(".", r"\.") + f".*{named}") as raised:
        rebind.route_extend_kv_cache(_rebind(world, rows, change, changed), (world.runner, None, rows), {},
                                     "kimi_prefill")
    assert "no state-copy plan was published" in str(raised.value)
    assert all(getattr(layer, PLAN_ATTRIBUTE, None) is None for layer in world.layers.values())
    fact = get_ledger().snapshot()["facts"]["kimi_prefill"]["rebind"]
    assert fact["ok"] is False and fact["layer"] == changed
    assert compiles.count == 0


def test_a_seam_layer_without_a_plan_before_the_rebind_fails_it(load_reference, compiles):
    world = _started(load_reference)
    bare = sorted(world.layers)[0]
    setattr(world.layers[bare], PLAN_ATTRIBUTE, None)  # bound by another path than the patched runner
    rows = world.layers[bare].kv_cache[1].shape[0] - 2
    compiles.count = 0
    with pytest.raises(RuntimeError, match="'" + bare.replace(".", r"\.") + r"' holds no state-copy plan"):
        rebind.route_extend_kv_cache(_rebind(world, rows), (world.runner, None, rows), {}, "kimi_prefill")
    assert all(getattr(layer, PLAN_ATTRIBUTE, None) is None for layer in world.layers.values())
    assert compiles.count == 0


def test_rebind_without_published_plans_republishes_nothing(load_reference, compiles):
    world = kimi_workload.build_world(load_reference(patched=False), num_layers=2)
    kimi_workload.start_world(world)  # no overlay: no seam layer, no plan
    rows = next(iter(world.layers.values())).kv_cache[1].shape[0] - 3
    rebind.route_extend_kv_cache(_rebind(world, rows), (world.runner, None, rows), {}, "kimi_prefill")
    fact = get_ledger().snapshot()["facts"]["kimi_prefill"]["rebind"]
    assert fact == {"ok": True, "layers": {}, "recompiled": False, "reason": rebind.NOTHING_PUBLISHED_REASON}
    assert compiles.count == 0 and all(layer.kv_cache[1].shape[0] == rows for layer in world.layers.values())


def _one_row(world: kimi_workload.World):
    """``extend_kv_cache`` stand-in: each state becomes its first row viewed as ``.view(-1, H, V, K)`` of one page
    reports it -- ``stride(0)`` = the payload ``H * V * K``, not the page (same pointer, same inner strides)."""
    def extend_kv_cache(runner, kv_cache_config, num_blocks):
        for layer in world.layers.values():
            cache = list(layer.kv_cache)
            state = cache[1]
            payload = state.shape[1] * state.shape[2] * state.shape[3]
            cache[1] = state.as_strided((1, *state.shape[1:]), (payload, *state.stride()[1:]), state.storage_offset())
            layer.kv_cache = tuple(cache) if isinstance(layer.kv_cache, tuple) else cache
    return extend_kv_cache


def test_a_rebind_to_one_row_with_the_payload_as_row_stride_is_republished(load_reference, compiles):
    """A one-row view's row stride addresses nothing (its one valid index is 0): accepted where the pointer and
    the inner strides hold, and the plan serves it exactly as the naive copy does."""
    world = _started(load_reference)
    before = {name: getattr(layer, PLAN_ATTRIBUTE) for name, layer in world.layers.items()}
    assert all(layer.kv_cache[1].stride(0) != 2 * 8 * 8 for layer in world.layers.values())  # paged: a gap
    compiles.count = 0
    rebind.route_extend_kv_cache(_one_row(world), (world.runner, None, 1), {}, "kimi_prefill")
    generator = torch.Generator().manual_seed(11)
    for name, layer in world.layers.items():
        binding, state = getattr(layer, PLAN_ATTRIBUTE), layer.kv_cache[1]
        assert binding is before[name] and state.shape[0] == 1
        indices, flags = torch.tensor([0, 1, -1, 0], dtype=torch.int32), torch.tensor([True, True, True, False])
        assert torch.equal(_bits(binding.gather(state, indices, flags)), _bits(naive.gather_states(state, indices,
                                                                                                    flags)))
        raw = world.runner.raw_caches[name]
        expected = raw.clone()
        finals = torch.randn((2, *state.shape[1:]), generator=generator)
        naive.scatter_states(expected.as_strided(state.shape, state.stride(), state.storage_offset()), finals,
                             torch.tensor([0, 1]))
        binding.scatter(state, finals, torch.tensor([0, 1], dtype=torch.int64))
        assert torch.equal(_bits(raw), _bits(expected))
    assert compiles.count == 0


def test_a_one_row_rebind_that_changes_an_inner_stride_is_refused(load_reference, compiles):
    """Only the row stride of a one-row view is free: an inner stride that changed still refuses the rebind."""
    world = _started(load_reference)
    changed = sorted(world.layers)[0]
    layer = world.layers[changed]
    state = layer.kv_cache[1]
    shape, strides = (1, state.shape[1], state.shape[3], state.shape[2]), state.stride()
    layer.kv_cache = (layer.kv_cache[0], state.as_strided(shape, (strides[0], strides[1], strides[3], strides[2]),
                                                          state.storage_offset()), *layer.kv_cache[2:])
    with pytest.raises(RuntimeError, match=changed.replace(".", r"\.") + ".*strides"):
        rebind.route_extend_kv_cache(lambda *args: None, (world.runner, None, 1), {}, "kimi_prefill")
    assert all(getattr(other, PLAN_ATTRIBUTE, None) is None for other in world.layers.values())


def _retyped(world: kimi_workload.World, changed: str, change: str):
    """``extend_kv_cache`` stand-in: layer ``changed`` gets its state as another dtype (same bytes), another inner
    shape (same pages), or on another device; the others only fewer rows."""
    def extend_kv_cache(runner, kv_cache_config, num_blocks):
        for name, layer in world.layers.items():
            state = layer.kv_cache[1][:-1]
            if name == changed and change == "dtype":
                state = state.view(torch.int32)
            elif name == changed and change == "inner":
                state = state.unflatten(-1, (2, state.shape[-1] // 2)).flatten(-3, -2)
            elif name == changed:
                state = torch.empty_like(state, device="meta")
            layer.kv_cache = (layer.kv_cache[0], state, *layer.kv_cache[2:])
    return extend_kv_cache


@pytest.mark.parametrize(("change", "named"), [("dtype", "dtype"), ("inner", "inner"), ("device", "device")])
def test_a_rebind_that_changes_dtype_inner_shape_or_device_is_refused_naming_it(load_reference, compiles, change,
                                                                                named):
    world = _started(load_reference)
    changed = sorted(world.layers)[1]
    compiles.count = 0
    with pytest.raises(RuntimeError, match=changed.replace(".", r"\.") + f".*{named}"):
        rebind.route_extend_kv_cache(_retyped(world, changed, change), (world.runner, None, 0), {}, "kimi_prefill")
    assert all(getattr(layer, PLAN_ATTRIBUTE, None) is None for layer in world.layers.values())
    assert compiles.count == 0


def test_extend_kv_cache_twice_republishes_the_same_plans_each_time(load_reference, compiles):
    world = _started(load_reference)
    before = {name: getattr(layer, PLAN_ATTRIBUTE) for name, layer in world.layers.items()}
    rows = next(iter(world.layers.values())).kv_cache[1].shape[0]
    compiles.count = 0
    for new_rows in (rows - 3, rows - 5):
        rebind.route_extend_kv_cache(_rebind(world, new_rows), (world.runner, None, new_rows), {}, "kimi_prefill")
        assert all(getattr(layer, PLAN_ATTRIBUTE) is before[name] and layer.kv_cache[1].shape[0] == new_rows
                   for name, layer in world.layers.items())
        fact = get_ledger().snapshot()["facts"]["kimi_prefill"]["rebind"]
        assert fact["ok"] and {entry["new_rows"] for entry in fact["layers"].values()} == {new_rows}
    assert compiles.count == 0


def test_extend_kv_cache_raising_midway_withdraws_every_plan(load_reference, compiles):
    """The release's rebind fails after binding some layers: no layer keeps a plan (of old or new views)."""
    world = _started(load_reference)
    first = sorted(world.layers)[0]
    rows = world.layers[first].kv_cache[1].shape[0] - 2

    def extend_kv_cache(runner, kv_cache_config, num_blocks):
        layer = world.layers[first]
        layer.kv_cache = (layer.kv_cache[0], layer.kv_cache[1][:rows], *layer.kv_cache[2:])
        raise MemoryError("cuMemMap failed")

    with pytest.raises(MemoryError, match="cuMemMap"):
        rebind.route_extend_kv_cache(extend_kv_cache, (world.runner, None, rows), {}, "kimi_prefill")
    assert all(getattr(layer, PLAN_ATTRIBUTE, None) is None for layer in world.layers.values())
    fact = get_ledger().snapshot()["facts"]["kimi_prefill"]["rebind"]
    assert fact["ok"] is False and "MemoryError" in fact["error"] and "withdrawn" in fact["error"]


def test_a_layer_standing_aside_on_its_backend_does_not_fail_the_rebind(load_reference, compiles):
    """The same plan-less layer as in ``test_a_seam_layer_without_a_plan_before_the_rebind_fails_it``, but marked
    standing aside by the startup (its backend keeps upstream's copies): the rebind republishes the others."""
    from kda_patches.routing.proof import STANDS_ASIDE_ATTRIBUTE

    world = _started(load_reference)
    bare = sorted(world.layers)[0]
    setattr(world.layers[bare], PLAN_ATTRIBUTE, None)
    setattr(world.layers[bare], STANDS_ASIDE_ATTRIBUTE, "kda_prefill_backend='other': not routed")
    other = sorted(world.layers)[1]
    binding = getattr(world.layers[other], PLAN_ATTRIBUTE)
    rows = world.layers[bare].kv_cache[1].shape[0] - 2
    rebind.route_extend_kv_cache(_rebind(world, rows), (world.runner, None, rows), {}, "kimi_prefill")
    assert getattr(world.layers[bare], PLAN_ATTRIBUTE, None) is None
    assert getattr(world.layers[other], PLAN_ATTRIBUTE) is binding
