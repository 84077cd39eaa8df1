"""The indexed route's rules, each decided by one call: what binds, what still copies, what fails closed.

The chunk call is the release's own (vLLM 0.34's vendored FLA ``chunk_gated_delta_rule_fwd_h``, interpreter); the
plan is a recording double (the plan's own behaviour is tested in tests/state_copy): only whether the route handed
it a copy is decided here.
"""

from __future__ import annotations

import fla_interpreter
import fla_release
import pytest
import torch
from route_doubles import RecordingPlan

from kda_patches.indexed_chunk import route as indexed
from kda_patches.indexed_chunk.derive import KernelDeclaration, derive_indexed_kernel
from kda_patches.indexed_chunk.launch import naive_indexed_fwd_h
from kda_patches.routing import direct
from kda_patches.routing.calls import active_call

KERNEL = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
HEADS, KEY_HEADS, DIM = 2, 1, 32


@pytest.fixture(scope="module")
def derived():
    module = fla_release.load_fla_module("0.34.0", "chunk_delta_h")
    fla_interpreter.fix_for_interpreter(module)
    return derive_indexed_kernel(module, KernelDeclaration(module=module.__name__, kernel=KERNEL,
                                                           host="chunk_gated_delta_rule_fwd_h"))


@pytest.fixture(autouse=True)
def clean_call_state():
    direct._checked_pair = (None, None, None)
    active_call.route = None
    indexed.WARMED.clear()
    indexed.LOOKED_AT.clear()
    yield
    direct._checked_pair = (None, None, None)
    active_call.route = None
    indexed.WARMED.clear()
    indexed.LOOKED_AT.clear()


def chunk_arguments(generator: torch.Generator, lengths: list[int], initial_state=None) -> dict:
    tokens = sum(lengths)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {"k": (torch.randn(1, tokens, KEY_HEADS, DIM, generator=generator) * 0.1).bfloat16(),
            "w": (torch.randn(1, tokens, HEADS, DIM, generator=generator) * 0.1).bfloat16(),
            "u": torch.randn(1, tokens, HEADS, DIM, generator=generator).bfloat16(),
            "g": -torch.rand(1, tokens, HEADS, generator=generator).cumsum(1) * 0.05,
            "initial_state": initial_state, "output_final_state": True, "cu_seqlens": bounds}


def bound_route(derived, generator: torch.Generator, rows: list[int], flags: list[bool]):
    state = torch.randn(5, HEADS, DIM, DIM, generator=generator)
    route = indexed.IndexedRoute(RecordingPlan(), state, derived)
    indices, folded = torch.tensor(rows), torch.tensor(flags)
    placeholder = route.gather(state, indices, folded)
    assert placeholder is route.initial and placeholder.shape == (len(rows), HEADS, DIM, DIM)
    return route, state, indices, folded


def test_a_foldable_gather_binds_and_copies_nothing(derived) -> None:
    route, _, indices, _ = bound_route(derived, torch.Generator().manual_seed(1), [3, 0], [True, False])
    assert route.rows is indices and route.gathers == 1 and route.plan.copies == []


class Layer:
    kda_prefill_backend = "flashkda"


def test_a_layer_on_a_backend_the_twin_does_not_serve_only_copies(derived) -> None:
    """Kimi K3's FlashKDA branch reads the gathered states itself: its layer's gather copies through the plan."""
    from kda_patches.routing.seams import BackendGate

    gate = BackendGate("kda_prefill_backend", ("triton",), "FlashKDA reads the gathered states itself")
    state = torch.randn(5, HEADS, DIM, DIM)
    flashkda = indexed.IndexedRoute(RecordingPlan(), state, derived, Layer(), gate)
    packed = flashkda.gather(state, torch.tensor([3, 0]), torch.tensor([True, False]))
    assert flashkda.rows is None and flashkda.plan.copies == ["gather"] and packed is not flashkda.initial
    triton_layer = Layer()
    triton_layer.kda_prefill_backend = "triton"
    served = indexed.IndexedRoute(RecordingPlan(), state, derived, triton_layer, gate)
    assert served.gather(state, torch.tensor([3, 0]), torch.tensor([True, False])) is served.initial


def test_flags_the_plan_cannot_fold_are_copied_through_the_plan(derived) -> None:
    state = torch.randn(5, HEADS, DIM, DIM)
    route = indexed.IndexedRoute(RecordingPlan(), state, derived)
    packed = route.gather(state, torch.tensor([3, 0]), torch.tensor([1, 0]))  # int64 flags: not foldable
    assert packed is not None and route.rows is None and route.plan.copies == ["gather"]


def test_auto_binds_a_call_of_at_least_its_crossover_and_copies_a_smaller_one(derived) -> None:
    """KDA_PATCHES_STATE_IO=auto: the route's ``min_sequences`` alone decides bind (no copy) or the plan's copy."""
    state = torch.randn(5, HEADS, DIM, DIM)
    rows, flags = torch.tensor([3, 0, 4]), torch.tensor([True, False, True])
    small = indexed.IndexedRoute(RecordingPlan(), state, derived, min_sequences=4)
    assert small.gather(state, rows, flags) is not small.initial
    assert small.rows is None and small.plan.copies == ["gather"]
    at_crossover = indexed.IndexedRoute(RecordingPlan(), state, derived, min_sequences=3)
    assert at_crossover.gather(state, rows, flags) is at_crossover.initial and at_crossover.plan.copies == []


@pytest.mark.parametrize(("state_io", "expected", "measured_only"), [
    ("indexed", 0, False), ("auto", "crossover", False), ("measured", "crossover", True)])
def test_prepare_host_records_which_calls_run_the_twin(state_io, expected, measured_only, derived) -> None:
    from kda_patches.indexed_chunk import AUTO_MIN_SEQUENCES, READY
    from kda_patches.ledger import get_ledger

    key = f"test:{state_io}"
    try:
        assert indexed.prepare_host(key, derived.host, KERNEL, state_io) == "indexed"
        assert READY[key].min_sequences == (AUTO_MIN_SEQUENCES if expected == "crossover" else 0)
        assert READY[key].measured_only is measured_only
        fact = get_ledger().snapshot()["facts"][indexed.SECTION][key]
        assert fact["state_io"] == state_io and ("only in the seams measured" in fact["indexed_calls"]) is measured_only
    finally:
        indexed.forget_host(key)
    assert key not in READY


def test_the_chunk_call_runs_the_twin_on_the_bound_rows(derived) -> None:
    """Inside the bound call the host runs the twin: the cache rows hold what gather, release, scatter give."""
    generator = torch.Generator().manual_seed(2)
    route, state, indices, flags = bound_route(derived, generator, [3, 0], [True, False])
    arguments = chunk_arguments(generator, [5, 2], route.initial)
    expected = state.clone()
    reference = naive_indexed_fwd_h(derived, expected, indices, flags, **{
        key: value for key, value in arguments.items() if key not in ("initial_state", "output_final_state")})
    active_call.route = route
    h, _, final = indexed.route_host(derived.host, (), arguments)
    assert route.consumed and final is route.final and final.dtype == state.dtype and torch.equal(h, reference[0])
    assert torch.equal(state, expected)
    route.scatter_function_value_first(lambda *_: pytest.fail("upstream's scatter ran"), state, final, indices)
    assert route.scatters == 1 and route.problem() is None and route.plan.copies == []


def test_a_chunk_call_with_its_own_initial_state_runs_the_release(derived) -> None:
    generator = torch.Generator().manual_seed(3)
    route, state, _, _ = bound_route(derived, generator, [3, 0], [True, True])
    arguments = chunk_arguments(generator, [5, 2], torch.zeros(2, HEADS, DIM, DIM))
    before = state.clone()
    active_call.route = route
    _, _, final = indexed.route_host(derived.host, (), arguments)
    assert final is not None and not route.consumed and torch.equal(state, before)


def test_a_scatter_whose_binding_was_never_consumed_fails_closed(derived) -> None:
    route, state, indices, _ = bound_route(derived, torch.Generator().manual_seed(4), [3, 0], [True, True])
    computed_from_the_placeholder = torch.randn(2, HEADS, DIM, DIM)
    with pytest.raises(indexed.IndexedStateLost, match="did not run the indexed twin"):
        route.scatter_function_value_first(lambda *_: None, state, computed_from_the_placeholder, indices)
    assert route.scatters == 0


def test_a_scatter_to_other_rows_fails_closed(derived) -> None:
    generator = torch.Generator().manual_seed(5)
    route, state, _, _ = bound_route(derived, generator, [3, 0], [True, True])
    active_call.route = route
    _, _, final = indexed.route_host(derived.host, (), chunk_arguments(generator, [5, 2], route.initial))
    with pytest.raises(indexed.IndexedStateLost, match="other rows"):
        route.scatter_function_value_first(lambda *_: None, state, final, torch.tensor([3, 0]))
    with pytest.raises(indexed.IndexedStateLost, match="other final states"):
        route.scatter_function_value_first(lambda *_: None, state, final.clone(), route.rows)


def test_a_routed_call_gets_the_crossover_its_host_was_prepared_with(derived) -> None:
    """The wiring: the seam's route (routing.direct.indexed_route) carries the host's min_sequences."""
    from kda_patches.indexed_chunk import READY, ReadyHost
    from kda_patches.routing.seams import IndexedChunk

    declared = IndexedChunk("m", "host", KERNEL)
    state = torch.randn(5, HEADS, DIM, DIM)
    READY[declared.key] = ReadyHost(derived, 7)
    try:
        route = direct.indexed_route(declared, RecordingPlan(), state, Layer())
        assert type(route) is indexed.IndexedRoute and route.min_sequences == 7
    finally:
        READY.pop(declared.key)
    assert type(direct.indexed_route(declared, RecordingPlan(), state, Layer())) is direct.DirectRoute


def test_the_default_runs_the_twin_only_in_seams_measured_faster_with_it(derived) -> None:
    """KDA_PATCHES_STATE_IO=measured: a host prepared for it routes a measured seam (vLLM 0.34's Qwen / Kimi Linear)
    through the twin at auto's crossover, and gives any other seam reaching the same host (Olmo) the copy route."""
    from kda_patches.indexed_chunk import AUTO_MIN_SEQUENCES, READY, ReadyHost
    from kda_patches.patches import gdn_state_copy
    from kda_patches.routing.seams import IndexedChunk

    measured, unmeasured = IndexedChunk("m", "host", KERNEL, measured=True), IndexedChunk("m", "host", KERNEL)
    state = torch.randn(5, HEADS, DIM, DIM)
    READY[measured.key] = ReadyHost(derived, AUTO_MIN_SEQUENCES, measured_only=True)
    try:
        route = direct.indexed_route(measured, RecordingPlan(), state, Layer())
        assert type(route) is indexed.IndexedRoute and route.min_sequences == AUTO_MIN_SEQUENCES
        assert type(direct.indexed_route(unmeasured, RecordingPlan(), state, Layer())) is direct.DirectRoute
        READY[measured.key] = ReadyHost(derived, AUTO_MIN_SEQUENCES)  # auto: every seam reaching the host
        assert type(direct.indexed_route(unmeasured, RecordingPlan(), state, Layer())) is indexed.IndexedRoute
    finally:
        READY.pop(measured.key)
    # the declarations: which seams were measured (docs/results/no-copy) and which were not
    assert gdn_state_copy.QWEN_034_SEAM.indexed.measured and gdn_state_copy.KIMI_GDN_034_SEAM.indexed.measured
    assert not any(seam.indexed.measured for seam in (gdn_state_copy.OLMO_SEAM, gdn_state_copy.QWEN_SEAM,
                                                      gdn_state_copy.KIMI_GDN_SEAM))


def warmups() -> int:
    from kda_patches.ledger import get_ledger

    return int((get_ledger().snapshot()["counters"].get(indexed.SECTION) or {}).get("twin_warmups", 0))


def copied_call(derived, generator: torch.Generator):
    """A routed call below auto's crossover: its gather copied through the plan, its chunk call the release's."""
    state = torch.randn(5, HEADS, DIM, DIM, generator=generator)
    route = indexed.IndexedRoute(RecordingPlan(), state, derived, min_sequences=4)
    packed = route.gather(state, torch.tensor([3, 0]), torch.tensor([True, False]))
    assert route.rows is None and route.plan.copies == ["gather"]
    return route, state, chunk_arguments(generator, [5, 2], packed)


def test_a_copied_call_warms_the_twin_once_storing_nothing_and_runs_the_release(derived, monkeypatch) -> None:
    """auto below its crossover: the first copied call launches the twin once with every row invalid (compiling it
    before any wide prefill needs it); the cache is untouched to the bit and the call's results are the release's."""
    monkeypatch.setattr(indexed, "compiles", lambda tensor: True)  # as on a GPU (the interpreter runs it here)
    generator = torch.Generator().manual_seed(4)
    route, state, arguments = copied_call(derived, generator)
    state[1] = float("nan")  # poison: a row no sequence names; every row must keep its bytes
    before = state.clone()
    expected = derived.host(**arguments)
    active_call.route = route
    start = warmups()
    results = indexed.route_host(derived.host, (), arguments)
    assert warmups() == start + 1 and torch.equal(state.view(torch.int32), before.view(torch.int32))
    assert all(torch.equal(got, want) for got, want in zip(results, expected, strict=True))
    indexed.route_host(derived.host, (), arguments)  # the same layer again: looked at once
    other, _, more = copied_call(derived, generator)  # another layer of the same shapes: the compile is shared
    active_call.route = other
    indexed.route_host(derived.host, (), more)
    assert warmups() == start + 1 and not route.consumed


def test_no_warm_up_on_the_cpu_inside_a_graph_capture_or_before_the_cache_was_gathered(derived, monkeypatch) -> None:
    generator = torch.Generator().manual_seed(5)
    route, _, arguments = copied_call(derived, generator)
    active_call.route = route
    start = warmups()
    indexed.route_host(derived.host, (), arguments)
    assert warmups() == start  # CPU tensors: nothing compiles, nothing to warm
    indexed.LOOKED_AT.clear()
    monkeypatch.setattr(indexed, "compiles", lambda tensor: True)
    monkeypatch.setattr(indexed, "capturing", lambda tensor: True)
    indexed.route_host(derived.host, (), arguments)
    assert warmups() == start and not indexed.LOOKED_AT  # a capture would replay it: tried again later
    monkeypatch.setattr(indexed, "capturing", lambda tensor: False)
    route.seen = None  # no gather of the cache in this call: nothing known of the indices a bound call passes
    indexed.route_host(derived.host, (), arguments)
    assert warmups() == start
    route.seen = (torch.int64, True)
    indexed.route_host(derived.host, (), arguments)
    assert warmups() == start + 1
