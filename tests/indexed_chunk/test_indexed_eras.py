"""No copy before vLLM 0.34: the era declarations of the chunk-state host and the pre-0.34 seams' gates, each rule
decided by one case.

- every era gets the part of :data:`~kda_patches.routing.eras.FLA_CHUNK_STATE_RELEASES` it covers: the opted-in
  host (chosen by ``KDA_PATCHES_STATE_IO``, a member of the era's group) or a declared gap (inert, no group);
- a row naming another module than the seams' host is refused; adding a release is a row;
- both records declare exactly one host target per upstream release, opted in from 0.32, the block-pointer gap
  before, all at the module the seams' ``indexed`` declarations name;
- the pre-0.34 Qwen seam's twin serves only the Triton prefill backend, Kimi Linear's only FP32 caches (its
  uncast scatter); any other layer copies through the plan, counted and explained;
- the folded cast (``ssm_state[idx] = last.to(ssm_state.dtype)``, rewritten ``scatter_cast``) of a bound call is the
  twin's store: nothing is copied, and an unconsumed binding still fails closed.

The plan is a recording double and no kernel runs (the route's decisions only; the twin is tested in
``test_indexed_chunk_kernel.py``, the released layers in ``test_indexed_pre034_layers.py``).
"""

from __future__ import annotations

import types

import pytest
import torch
from route_doubles import RecordingPlan

from kda_patches.indexed_chunk import route as indexed
from kda_patches.ledger import get_ledger
from kda_patches.patches import gdn_state_copy, kimi_prefill
from kda_patches.routing import direct
from kda_patches.routing.eras import (
    BLOCK_POINTER_FORM,
    FLA_CHUNK_STATE_MODULE,
    FLA_CHUNK_STATE_RELEASES,
    UncastFinalGate,
    indexed_host_targets,
    release_tuple,
)
from kda_patches.routing.seams import IndexedChunk
from kda_patches.routing.wrappers import IndexedHostWrapper

HOST = "chunk_gated_delta_rule_fwd_h"
DERIVED = types.SimpleNamespace(declaration=types.SimpleNamespace(module=FLA_CHUNK_STATE_MODULE, host=HOST))
WRAPPER = IndexedHostWrapper(IndexedChunk(FLA_CHUNK_STATE_MODULE, HOST, "kernel"))


@pytest.fixture(autouse=True)
def clean_call_state():
    direct._checked_pair = (None, None, None)
    yield
    direct._checked_pair = (None, None, None)


def spans(targets) -> list[tuple[str, str, str | None, bool]]:
    return [(t.min_version, t.max_version, t.group, t.chosen_by is not None) for t in targets]


def test_each_era_gets_the_part_of_the_host_table_it_covers() -> None:
    assert spans(indexed_host_targets(WRAPPER, "0.30", "0.34", "vllm-0.30", "why")) == [
        ("0.30", "0.32", None, False), ("0.32", "0.34", "vllm-0.30", True)]
    assert spans(indexed_host_targets(WRAPPER, "0.27", "0.30", "vllm-0.27", "why")) == [("0.27", "0.30", None, False)]
    chosen = indexed_host_targets(WRAPPER, "0.34", "0.35", "vllm-0.34", "why")
    assert spans(chosen) == [("0.34", "0.35", "vllm-0.34", True)]
    assert chosen[0].chosen_by == ("state_io", ("indexed", "auto")) and chosen[0].inert == "why"
    assert chosen[0].wrapper is WRAPPER and chosen[0].shapes == ("indexed:kernel",)
    gap = indexed_host_targets(WRAPPER, "0.27", "0.30", "vllm-0.27", "why")[0]
    assert gap.wrapper is None and gap.inert == BLOCK_POINTER_FORM and gap.shapes == ()


def test_a_row_naming_another_module_than_the_seams_host_is_refused() -> None:
    moved = (("0.26", None, "vllm.ops.moved_chunk_delta_h", None),)
    with pytest.raises(ValueError, match=r"declared at vllm\.ops\.moved_chunk_delta_h"):
        indexed_host_targets(WRAPPER, "0.32", "0.34", "g", "why", moved)
    assert indexed_host_targets(WRAPPER, "0.20", "0.26", "g", "why", moved) == ()  # rows outside the era: no check


def test_adding_a_release_is_a_row() -> None:
    table = (*FLA_CHUNK_STATE_RELEASES[:-1], ("0.32", "0.35", FLA_CHUNK_STATE_MODULE, None),
             ("0.35", None, FLA_CHUNK_STATE_MODULE, "the 0.35 kernel is another form"))
    assert spans(indexed_host_targets(WRAPPER, "0.34", "0.36", "g", "why", table)) == [
        ("0.34", "0.35", "g", True), ("0.35", "0.36", None, False)]


@pytest.mark.parametrize("patch", [gdn_state_copy.PATCH, kimi_prefill.PATCH], ids=lambda patch: patch.name)
def test_both_records_declare_one_host_per_release_opted_in_from_0_32(patch) -> None:
    hosts = [t for t in patch.targets if t.module == FLA_CHUNK_STATE_MODULE]
    assert {t.qualname for t in hosts} == {HOST}
    first = 26 if patch is gdn_state_copy.PATCH else 27
    for minor in range(first, 35):
        version = (0, minor)
        covering = [t for t in hosts if release_tuple(t.min_version) <= version < release_tuple(t.max_version)]
        assert len(covering) == 1, (minor, covering)
        (target,) = covering
        if minor >= 32:  # the masked-pointer kernel: the twin runs here, opted in
            # by the default (measured) too where a seam of the era was measured faster with it: 0.34's GDN seams
            default_too = patch is gdn_state_copy.PATCH and minor >= 34
            wraps = ("indexed", "auto", "measured") if default_too else ("indexed", "auto")
            assert target.chosen_by == ("state_io", wraps) and target.group is not None, target
            assert target.wrapper.indexed.key == f"{FLA_CHUNK_STATE_MODULE}:{HOST}"
        else:  # 0.26-0.31: block pointers, a declared gap (inert under every switch)
            assert target.chosen_by is None and target.inert == BLOCK_POINTER_FORM and target.group is None, target


def test_every_pre034_seam_reaches_the_declared_host() -> None:
    for seam in (gdn_state_copy.QWEN_SEAM, gdn_state_copy.OLMO_SEAM, gdn_state_copy.KIMI_GDN_SEAM,
                 kimi_prefill.UPSTREAM_SEAM):
        assert seam.indexed is not None and seam.indexed.key == f"{FLA_CHUNK_STATE_MODULE}:{HOST}", seam


class Layer:
    """A layer with the attributes the gates read."""

    def __init__(self, cache_dtype: torch.dtype = torch.float32, backend: str | None = "triton") -> None:
        self.prefix = f"model.layers.0.{cache_dtype}.{backend}"
        self.gdn_prefill_backend = backend
        self.kv_cache = (torch.empty(1), torch.empty(5, 2, 4, 4, dtype=cache_dtype))


def test_the_uncast_gate_serves_only_the_hosts_final_dtype() -> None:
    gate = gdn_state_copy.KIMI_GDN_CHUNK_STATE.backend
    assert type(gate) is UncastFinalGate
    assert gate.stands_aside_on(Layer(torch.float32)) is None
    reason = gate.stands_aside_on(Layer(torch.bfloat16))
    assert reason is not None and "bfloat16" in reason and "without a cast" in reason
    assert UncastFinalGate(1, "float32", "r").stands_aside_on(object()) is not None  # no cache: not served


@pytest.mark.parametrize(("declared", "served", "refused"), [
    (gdn_state_copy.KIMI_GDN_CHUNK_STATE, Layer(torch.float32), Layer(torch.bfloat16)),
    (gdn_state_copy.QWEN_CHUNK_STATE, Layer(torch.bfloat16), Layer(torch.bfloat16, "flashinfer")),
], ids=["kimi-linear-uncast", "qwen-backend"])
def test_a_layer_the_twin_does_not_serve_copies_counted_and_explained(declared, served, refused) -> None:
    rows, flags = torch.tensor([3, 0]), torch.tensor([True, False])
    bound = indexed.IndexedRoute(RecordingPlan(), served.kv_cache[1], None, served, declared.backend)
    assert bound.gather(served.kv_cache[1], rows, flags) is bound.initial and bound.plan.copies == []
    before = get_ledger().snapshot()["counters"].get(indexed.SECTION, {}).get("calls_copied", 0)
    copied = indexed.IndexedRoute(RecordingPlan(), refused.kv_cache[1], None, refused, declared.backend)
    packed = copied.gather(refused.kv_cache[1], rows, flags)
    assert copied.rows is None and packed is not copied.initial and copied.plan.copies == ["gather"]
    snapshot = get_ledger().snapshot()
    assert snapshot["counters"][indexed.SECTION]["calls_copied"] == before + 1
    fact = snapshot["facts"][indexed.SECTION][f"copies {refused.prefix}"]
    assert fact["decision"] == "copy" and fact["reason"] == declared.backend.stands_aside_on(refused)


def test_the_folded_cast_of_a_bound_call_is_the_twins_store() -> None:
    """``ssm_state[idx] = last.to(ssm_state.dtype)`` (rewritten ``scatter_cast``) after the twin ran: nothing copied,
    the scatter counted; before the twin ran, the same scatter fails closed."""
    layer = Layer(torch.bfloat16)
    state, rows, flags = layer.kv_cache[1], torch.tensor([3, 0]), torch.tensor([True, False])
    route = indexed.IndexedRoute(RecordingPlan(), state, DERIVED, layer, gdn_state_copy.QWEN_CHUNK_STATE.backend)
    assert route.gather(state, rows, flags) is route.initial
    with pytest.raises(indexed.IndexedStateLost, match="did not run the indexed twin"):
        route.scatter_cast(state, rows, torch.zeros(2, 2, 4, 4))  # computed from the unread placeholder
    route.consumed, route.final = True, torch.empty_like(route.initial)  # what route_host leaves
    route.scatter_cast(state, rows, route.final)
    assert route.scatters == 1 and route.casts_folded == 0 and route.plan.copies == [] and route.problem() is None
