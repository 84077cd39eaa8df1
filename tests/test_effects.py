"""Proof by effect (``kda_patches.effects``): each rule of the judges decided by synthetic ledgers."""

from __future__ import annotations

from kda_patches.effects import IDLE, IN_EFFECT, NOT_IN_EFFECT, judge_effect


def ledger(patch: str, state: str = "applied", counters: dict | None = None, facts: dict | None = None) -> dict:
    return {"patches": {patch: {"state": state}}, "counters": counters or {}, "facts": facts or {}}


def test_a_routed_call_is_in_effect_and_a_bypassed_one_is_not():
    routed = ledger("gdn_state_copy", counters={"gdn_state_copy": {"calls_seen": 3, "calls_routed": 3}})
    assert judge_effect("gdn_state_copy", [routed]) == (IN_EFFECT, "calls_seen 3, calls_routed 3")
    bypassed = ledger("gdn_state_copy", counters={"gdn_state_copy": {"calls_seen": 3, "calls_routed": 2,
                                                                     "calls_bypassed": 1}})
    assert judge_effect("gdn_state_copy", [bypassed])[0] == NOT_IN_EFFECT


def test_nothing_seen_is_idle_with_the_reason():
    state, reason = judge_effect("kimi_prefill", [ledger("kimi_prefill")])
    assert state == IDLE and "no prefill call reached the seam" in reason


def test_a_prefill_build_without_host_flags_is_not_in_effect():
    counters = {"gdn_host_flags": {"builds_seen": 4, "builds_flagged": 2, "prefill_builds_without_host_metadata": 1}}
    assert judge_effect("gdn_host_flags", [ledger("gdn_host_flags", counters=counters)])[0] == NOT_IN_EFFECT


def test_evidence_is_summed_over_processes():
    engine = ledger("kv_cache_layout", facts={"kv_cache_layout": {"separate_budget": {"workers": []}}})
    worker = ledger("kv_cache_layout", counters={"kv_cache_layout": {"state_binds_dense": 2}},
                    facts={"kv_cache_layout": {"summary": {"mode": "separate", "decisions": {"separate": 2}}}})
    assert judge_effect("kv_cache_layout", [worker])[0] == NOT_IN_EFFECT  # no process reserved the memory
    assert judge_effect("kv_cache_layout", [engine, worker])[0] == IN_EFFECT


def test_no_bound_cache_is_idle_and_a_failed_plan_is_not_in_effect():
    assert judge_effect("kv_cache_layout", [ledger("kv_cache_layout")])[0] == IDLE
    failed = ledger("kv_cache_layout", counters={"kv_cache_layout": {"plan_failures": 1}})
    assert judge_effect("kv_cache_layout", [failed])[0] == NOT_IN_EFFECT


def test_a_patch_applied_nowhere_has_no_effect_verdict():
    assert judge_effect("gdn_host_flags", [ledger("gdn_host_flags", state="not-applicable")]) is None
    assert judge_effect("no_such_patch", [ledger("no_such_patch")]) is None


def test_every_registered_patch_declares_its_evidence():
    from kda_patches.effects import EFFECTS
    from kda_patches.registry import all_patches

    assert set(EFFECTS) == set(all_patches())


def test_status_shows_applied_but_not_in_effect():
    from kda_patches.cli import aggregate_ledgers, format_ledger

    snapshot = {"pid": 1, "role": "worker", "switches": {}, "facts": {},
                "patches": {"gdn_state_copy": {"state": "applied", "reason": "", "targets": {}}},
                "counters": {"gdn_state_copy": {"calls_seen": 2, "calls_bypassed": 2}}}
    assert "effect in this process: APPLIED BUT NOT IN EFFECT (calls_seen 2, calls_bypassed 2)" in \
        format_ledger(snapshot)
    assert aggregate_ledgers([snapshot])["effects"]["gdn_state_copy"]["state"] == NOT_IN_EFFECT


def test_idle_says_why_when_the_startup_hook_recorded_unprepared_layers():
    fact = {"decision": "not-prepared", "reason": "cache on the CPU and TRITON_INTERPRET is not 1"}
    snapshot = ledger("gdn_state_copy", facts={"gdn_state_copy": {"model.layers.0.linear_attn": fact}})
    state, reason = judge_effect("gdn_state_copy", [snapshot])
    assert state == IDLE
    assert reason == "calls_seen 0, 1 layer(s) not prepared: cache on the CPU and TRITON_INTERPRET is not 1"
