"""The one-line status summaries of the state-copy patches, from a fixed ledger snapshot (literal expectations)."""

from __future__ import annotations

from kda_patches.patches import gdn_state_copy, kimi_prefill

SNAPSHOT = {
    "counters": {"gdn_state_copy": {"calls_seen": 7, "calls_routed": 6, "calls_bypassed": 1, "calls_refused": 2,
                                    "casts_folded": 5, "casts_materialized": 1},
                 "kimi_prefill": {}},
    "facts": {
        "gdn_state_copy": {
            "model.layers.0.linear_attn": {"decision": "overlay-plan", "plan_kind": "fused"},
            "model.layers.1.linear_attn": {"decision": "overlay-plan", "plan_kind": "fused"},
            "model.layers.2.linear_attn": {"decision": "not-prepared", "reason": "cpu"},
            "startup": {"ok": True, "layers": 2},
        },
        "kimi_prefill": {
            "model.layers.3.self_attn": {"decision": "fork-native", "plan_kind": "fallback"},
            "startup": {"ok": True, "layers": 1, "decision": "fork-native"},
        },
    },
}


def test_gdn_status_line_counts_calls_and_plans():
    assert gdn_state_copy.format_status_line(SNAPSHOT) == (
        "gdn_state_copy: prefill calls seen 7, routed 6, bypassed 1, refused 2, casts folded 5, casts materialized 1; "
        "plans fused=2 (model.layers.0.linear_attn…)")


def test_kimi_status_line_names_fork_native_layers():
    assert kimi_prefill.format_status_line(SNAPSHOT) == (
        "kimi_prefill: prefill calls seen 0, routed 0, bypassed 0; plans fork-native:fallback=1 "
        "(model.layers.3.self_attn)")


def test_the_status_line_counts_seams_by_routing_mechanism():
    snapshot = {"counters": {}, "facts": {"gdn_state_copy": {
        "routing a:Qwen._forward_core": {"seam": "q", "mechanism": "rewrite", "replaced": []},
        "routing a:Olmo._forward_core": {"seam": "o", "mechanism": "rewrite", "replaced": []},
        "routing b:Ascend._forward_core": {"seam": "a", "mechanism": "alias", "reason": "not rewritten: ..."}}}}
    assert gdn_state_copy.format_status_line(snapshot) == (
        "gdn_state_copy: prefill calls seen 0, routed 0, bypassed 0; plans none published; seams by alias 1, rewrite 2")


def test_a_backend_gate_routes_only_its_backends_and_status_names_the_others():
    """:class:`BackendGate`: a layer whose backend attribute is one of ``routed`` gets None (routed); any other
    value -- another backend, or none at all -- gets the reason naming the value; status lists such layers."""
    from types import SimpleNamespace

    from kda_patches.patches.kimi_prefill import format_status_line
    from kda_patches.routing.seams import BackendGate

    gate = BackendGate("gdn_prefill_backend", ("triton",), "the other branch gathers itself")
    assert gate.stands_aside_on(SimpleNamespace(gdn_prefill_backend="triton")) is None
    reason = gate.stands_aside_on(SimpleNamespace(gdn_prefill_backend="flashinfer"))
    assert reason.startswith("gdn_prefill_backend='flashinfer' (routed only on triton)")
    assert "gdn_prefill_backend=None" in gate.stands_aside_on(SimpleNamespace())
    snapshot = {"counters": {"gdn_state_copy": {"calls_upstream": 4}},
                "facts": {"gdn_state_copy": {f"model.layers.{i}.linear_attn": {
                    "decision": "stands-aside", "backend": "flashinfer", "reason": reason} for i in range(2)}}}
    line = format_status_line(snapshot, "gdn_state_copy")
    assert "upstream 4" in line and "stands-aside on flashinfer=2 (model.layers.0.linear_attn…)" in line
