"""Separate mode requested but not in effect: refused under STRICT, recorded otherwise; the effect judge agrees.

One synthetic storage: a state layer and an attention layer share pages, so the state layer's in-place dense
regrouping is refused by the checker; with no separate-state reservation from the engine, separate mode cannot
take effect for it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import kda_patches
from kda_patches.effects import IN_EFFECT, NOT_IN_EFFECT, judge_effect
from kda_patches.kv_layout.checker import CheckerCache, Footprint
from kda_patches.kv_layout.plan import LayerEntry, NotInEffect, plan_storage
from kda_patches.ledger import get_ledger

PAGE, BLOCKS = 64, 4


def shared_storage() -> list[LayerEntry]:
    state = LayerEntry("layers.0.linear_attn", 1, "state", "raw", PAGE * BLOCKS,
                       [Footprint("layers.0.linear_attn", "ssm", 1, 0, PAGE, BLOCKS, ((0, 32),))])
    state.dense_proposal = [Footprint("layers.0.linear_attn", "ssm", 1, 0, 32, BLOCKS, ((0, 32),))]
    state.make_dense = lambda: "dense"
    state.make_separate = lambda: "separate"
    state.separate_nbytes = 32 * BLOCKS
    attention = LayerEntry("layers.1.self_attn", 0, "attention", "raw", PAGE * BLOCKS,
                           [Footprint("layers.1.self_attn", "kv", 0, 0, PAGE, BLOCKS, ((32, 32),))])
    return [state, attention]


def strict(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    monkeypatch.setattr(kda_patches, "current_flags", lambda: SimpleNamespace(strict=on))


def test_separate_mode_without_a_reservation_is_refused_under_strict(monkeypatch):
    strict(monkeypatch, True)
    with pytest.raises(NotInEffect, match=r"layers\.0\.linear_attn would be bound upstream"):
        plan_storage(shared_storage(), "separate", None, CheckerCache(), [])


def test_without_strict_the_layer_stays_upstream_and_the_judge_says_not_in_effect(monkeypatch):
    strict(monkeypatch, False)
    actions: list = []
    plan_storage(shared_storage(), "separate", None, CheckerCache(), actions)
    fact = get_ledger().snapshot()["facts"]["kv_cache_layout"]["layers.0.linear_attn"]
    assert fact["decision"] == "upstream" and "reserved no separate-state" in fact["reason"]
    assert actions == []
    ledger = {"patches": {"kv_cache_layout": {"state": "applied"}}, "counters": {},
              "facts": {"kv_cache_layout": {"layers.0.linear_attn": fact,
                                            "summary": {"mode": "separate", "decisions": {"upstream": 2}}}}}
    state, reason = judge_effect("kv_cache_layout", [ledger])
    assert state == NOT_IN_EFFECT and "1 state layers were bound upstream" in reason


def test_with_a_reservation_the_layer_is_separate_and_nothing_is_refused(monkeypatch):
    strict(monkeypatch, True)
    actions: list = []
    separate = plan_storage(shared_storage(), "separate", {"layers.0.linear_attn"}, CheckerCache(), actions)
    assert separate == 32 * BLOCKS and [(entry.name, kind) for entry, kind, _ in actions] == [
        ("layers.0.linear_attn", "state")]


def test_auto_mode_never_refuses(monkeypatch):
    strict(monkeypatch, True)
    plan_storage(shared_storage(), "auto", None, CheckerCache(), [])
    fact = get_ledger().snapshot()["facts"]["kv_cache_layout"]["layers.0.linear_attn"]
    assert fact["decision"] == "upstream" and "KDA_PATCHES_KV_STATE_MODE=separate" in fact["reason"]
    ledger = {"patches": {"kv_cache_layout": {"state": "applied"}}, "counters": {},
              "facts": {"kv_cache_layout": {"layers.0.linear_attn": fact,
                                            "summary": {"mode": "auto", "decisions": {"upstream": 2}}}}}
    assert judge_effect("kv_cache_layout", [ledger])[0] == IN_EFFECT
