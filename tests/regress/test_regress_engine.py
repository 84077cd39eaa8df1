"""The default workload's A/B on the real CPU vLLM engine (about a minute per run on 2 cores)."""

from __future__ import annotations

import pytest
import vllm_stack

from kda_patches.regress.report import format_report
from kda_patches.regress.runner import run_ab
from kda_patches.regress.workloads import DEFAULT_WORKLOAD, resolve_workload

vllm_stack.import_vllm("vllm")


@pytest.mark.engine
def test_tiny_qwen3_next_tokens_equal_and_gdn_host_flags_exercised(fast_exit: None) -> None:
    report = run_ab(resolve_workload(DEFAULT_WORKLOAD))
    text = format_report(report)
    assert report.verdict == "equal", text
    requests = report.patched.outputs["requests"]
    assert len(requests) == 8 and all(len(request["token_ids"]) == 12 for request in requests)
    assert {request["prompt_len"] for request in requests} >= {5, 130, 300}
    continuation = next(request for request in requests if "continues" in request["name"])
    assert continuation["cached_prompt_tokens"] > 0  # a prefill that starts from a cached state
    flagged = [entry for entry in report.patched.ledgers
               if entry["patches"].get("gdn_host_flags", {}).get("state") == "applied"
               and entry["counters"].get("gdn_host_flags", {}).get("builds_flagged", 0) > 0]
    assert flagged, text
    assert any(entry["role"].startswith("EngineCore") for entry in report.patched.ledgers), text
    assert report.exit_code == 0, text
    # the report says what acted: host flags and layout decisions did; the CPU GDN path routes no state copy
    assert report.effects["gdn_host_flags"][0] == "in effect", text
    assert report.effects["kv_cache_layout"][0] == "in effect", text
    assert report.effects["gdn_state_copy"][0] == "idle", text
    assert "effect gdn_host_flags: in effect" in text and "schedule  timing-independent" in text
