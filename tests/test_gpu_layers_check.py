"""The layer check's parent-side rules (``scripts/gpu/vllm_layers_check.py``): which layers run on a release, the
per-seam default its timing justifies, and the children's switches. The GPU children themselves run on the H200."""

from __future__ import annotations

import pathlib

import pytest
from script_loader import load_script

layers_check = load_script("gpu/vllm_layers_check.py", "vllm_layers_check_under_test")


def timed_row(seqs: int, step_ratio: float) -> dict:
    return {"seqs": seqs, "paired_step_speedup": step_ratio}


def test_every_layer_runs_on_033_and_kimi_k3_is_left_out_on_034_with_the_reason():
    chosen, left_out = layers_check.layers_for("0.33.0", None)
    assert chosen == list(layers_check.LAYERS) and left_out == {}
    chosen, left_out = layers_check.layers_for("0.34.0", None)
    assert "kimi_k3" not in chosen and set(chosen) == set(layers_check.LAYERS) - {"kimi_k3"}
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in left_out["kimi_k3"]


def test_a_version_that_cannot_be_read_leaves_nothing_out():
    assert layers_check.layers_for(None, None) == (list(layers_check.LAYERS), {})


def test_asking_for_kimi_k3_on_034_by_name_is_refused_with_the_layer_and_the_others():
    with pytest.raises(SystemExit, match=r"--layers kimi_k3: cannot run on vLLM 0\.34\.0.*qwen_gdn"):
        layers_check.layers_for("0.34.0", ["qwen_gdn", "kimi_k3"])
    chosen, left_out = layers_check.layers_for("0.34.1+cu130", ["qwen_gdn"])
    assert chosen == ["qwen_gdn"] and list(left_out) == ["kimi_k3"]


def test_route_when_the_patched_call_is_at_least_as_fast_at_every_batch_size():
    line = layers_check.seam_default("qwen_gdn", [timed_row(1, 1.4), timed_row(8, 1.0), timed_row(64, 1.02)])
    assert line.startswith("DEFAULT qwen_gdn: route") and "8: 1.000x" in line


def test_one_batch_size_below_one_makes_the_seam_stand_aside_and_names_it():
    line = layers_check.seam_default("qwen_gdn", [timed_row(1, 1.4), timed_row(8, 0.999), timed_row(64, 1.2),
                                                  timed_row(256, 0.95)])
    assert line.startswith("DEFAULT qwen_gdn: stand aside (patched slower at 8, 256 sequences")


def test_the_median_interval_is_the_order_statistics_whose_coverage_reaches_the_confidence():
    values = [float(v) for v in range(40)]
    # n = 40 at 95 %: k = 14 covers 1 - 2 P(B <= 13) = 0.9615; k = 15 would cover 0.9193
    assert layers_check.median_interval(values) == (13.0, 26.0)
    assert layers_check.median_interval(list(reversed(values))) == (13.0, 26.0)  # order-free
    assert layers_check.median_interval(values, confidence=0.90) == (14.0, 25.0)
    assert layers_check.median_interval([1.0] * 5) is None  # 1 - 2 / 32 = 0.9375 < 0.95
    assert layers_check.median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)  # 1 - 2 / 64 = 0.969


def test_the_default_line_shows_each_median_s_interval_but_decides_by_the_median_alone():
    rounds = [0.9980 + 0.0001 * i for i in range(40)]  # the interval straddles 1.00
    row = {"seqs": 256, "paired_step_speedup": 1.0,
           "samples": {"baseline": {"step_ms": rounds}, "patched": {"step_ms": [1.0] * 40}}}
    line = layers_check.seam_default("kimi_linear_gdn", [row])
    assert line.startswith("DEFAULT kimi_linear_gdn: route") and "256: 1.000x [0.9993, 1.0006]" in line
    below = dict(row, paired_step_speedup=0.99995)
    assert "stand aside (patched slower at 256" in layers_check.seam_default("kimi_linear_gdn", [below])
    assert "[" not in layers_check.seam_default("qwen_gdn", [timed_row(1, 1.4)])  # no rounds kept: no interval


def test_no_paired_row_gives_no_default():
    line = layers_check.seam_default("kimi_linear_gdn", [{"seqs": 1, "baseline_step_ms": 1.0}])
    assert line == "DEFAULT kimi_linear_gdn: none (no batch size timed with both variants)"


def test_the_judge_adds_the_default_only_when_the_seam_was_patched():
    case = {"name": "c", "shape": "s", "outputs_equal": True, "cache_equal": True, "cache_bytes": 1,
            "calls_seen": 1, "calls_routed": 1, "digest_baseline": "a", "digest_patched": "a"}
    row = {"seqs": 1, "rounds": 3, "baseline_event_ms": 2.0, "patched_event_ms": 1.0, "baseline_wall_ms": 2.0,
           "patched_wall_ms": 1.0, "paired_step_speedup": 1.1, "paired_event_speedup": 2.0,
           "baseline_step_ms": 1.1, "patched_step_ms": 1.0, "burst": 8}
    on = {"patched_available": True, "cases": [case], "timing": [row]}
    assert any(line.startswith("DEFAULT olmo_gdn: route") for line in layers_check.judge("olmo_gdn", on, {}))
    unpatched = {**on, "patched_available": False,
                 "timing": [{"seqs": 1, "baseline_event_ms": 2.0, "baseline_wall_ms": 2.0}]}
    assert not any(line.startswith("DEFAULT") for line in layers_check.judge("olmo_gdn", unpatched, {}))


@pytest.mark.parametrize("gdn_ops", ["overlay", "upstream"])
def test_the_children_get_the_gdn_ops_switch_asked_for(gdn_ops, tmp_path: pathlib.Path):
    env = layers_check.child_env(tmp_path / "site", "qwen_gdn", True, dry_run=True, gdn_ops=gdn_ops)
    assert env["KDA_PATCHES_GDN_OPS"] == gdn_ops and env["KDA_PATCHES_ONLY"] == "gdn_state_copy"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env or env["VLLM_USE_V2_MODEL_RUNNER"] == __import__(
        "os").environ.get("VLLM_USE_V2_MODEL_RUNNER")


@pytest.mark.parametrize(("rounds", "instances", "refused"), [(15, 5, False), (15, 4, True), (15, 0, True),
                                                               (16, 3, True), (12, 3, False)])
def test_copy_costs_refuse_graph_instances_that_do_not_split_the_rounds(rounds, instances, refused, monkeypatch,
                                                                        capsys):
    ran = []
    monkeypatch.setattr(layers_check, "run_parent", lambda args: ran.append(args.graph_instances) or 0)
    argv = ["--copy-costs", "--rounds", str(rounds), "--graph-instances", str(instances)]
    if refused:
        with pytest.raises(SystemExit):
            layers_check.main(argv)
        assert f"--graph-instances {instances}" in capsys.readouterr().err and ran == []
    else:
        assert layers_check.main(argv) == 0 and ran == [instances]


def test_graph_instances_that_do_not_split_the_rounds_pass_when_copy_costs_are_not_timed(monkeypatch):
    ran = []
    monkeypatch.setattr(layers_check, "run_parent", lambda args: ran.append(args.graph_instances) or 0)
    assert layers_check.main(["--rounds", "15", "--graph-instances", "4"]) == 0 and ran == [4]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_children_get_the_graph_instances_and_the_host_profile_only_when_patched(enabled, tmp_path):
    args = layers_check.argparse.Namespace(rounds=20, settle=1, burst=8, graph_instances=4, copy_costs=True,
                                           dry_run=False, host_profile=[1, 8], prefill_backend="triton")
    argv = layers_check.child_argv("qwen_gdn", enabled, args, tmp_path / "child.json")
    assert argv[argv.index("--graph-instances") + 1] == "4" and argv[argv.index("--rounds") + 1] == "20"
    assert "--copy-costs" in argv and argv[argv.index("--mode") + 1] == ("on" if enabled else "off")
    assert ("--host-profile" in argv) is enabled


def _verdict(case_fields: dict) -> str:
    case = {"name": "c", "shape": "s", "outputs_equal": True, "cache_equal": True, "cache_bytes": 1,
            "calls_seen": 4, "calls_routed": 4, "digest_baseline": "a", "digest_patched": "a", **case_fields}
    lines = layers_check.judge("qwen_gdn", {"patched_available": True, "cases": [case], "timing": []}, {})
    return next(line for line in lines if line.startswith("VERDICT"))


def test_no_copy_needs_every_routed_call_indexed_and_folds_no_cast():
    indexed = {"state_io": "indexed", "final_cast": True, "calls_indexed": 4, "casts_folded": 0}
    assert "PASS" in _verdict(indexed) and "indexed 4/4" in _verdict(indexed)
    assert "FAIL" in _verdict({**indexed, "calls_indexed": 3, "casts_folded": 1})  # one call copied
    # the copy route with the same counts: its casts must be folded
    assert "FAIL" in _verdict({"final_cast": True, "calls_indexed": 0, "casts_folded": 0})
    assert "PASS" in _verdict({"final_cast": True, "calls_indexed": 0, "casts_folded": 4})
    # an indexed call where no copy was not asked for is not the run it claims to be
    assert "FAIL" in _verdict({"final_cast": True, "calls_indexed": 4, "casts_folded": 0})


@pytest.mark.parametrize("state_io", ["copy", "indexed"])
def test_the_children_get_the_state_io_switch_asked_for(state_io, tmp_path: pathlib.Path):
    env = layers_check.child_env(tmp_path / "site", "qwen_gdn", True, dry_run=True, state_io=state_io)
    assert env["KDA_PATCHES_STATE_IO"] == state_io


def test_auto_expects_the_twin_only_for_calls_of_at_least_its_crossover():
    auto = {"state_io": "auto", "final_cast": True, "auto_min_sequences": 40}
    below = {**auto, "num_prefills": 39}
    at = {**auto, "num_prefills": 40}
    assert "PASS" in _verdict({**below, "calls_indexed": 0, "casts_folded": 4})
    assert "FAIL" in _verdict({**below, "calls_indexed": 4, "casts_folded": 0})
    assert "PASS" in _verdict({**at, "calls_indexed": 4, "casts_folded": 0})
    assert "FAIL" in _verdict({**at, "calls_indexed": 0, "casts_folded": 4})


def _aside_lines(asked: str, case_fields: dict) -> list[str]:
    case = {"name": "c", "shape": "s", "outputs_equal": True, "cache_equal": True, "cache_bytes": 1,
            "calls_seen": 0, "calls_routed": 0, "calls_upstream": 4, "calls_bypassed": 0,
            "digest_baseline": "a", "digest_patched": "a", **case_fields}
    row = {"seqs": 1, "rounds": 3, "baseline_event_ms": 2.0, "patched_event_ms": 2.0, "baseline_wall_ms": 2.0,
           "patched_wall_ms": 2.0, "paired_step_speedup": 0.99, "paired_event_speedup": 1.0,
           "baseline_step_ms": 1.0, "patched_step_ms": 1.01, "burst": 8}
    on = {"patched_available": True, "cases": [case], "timing": [row],
          "facts": {"prefill_backend_asked": asked, "prefill_backend": "flashinfer"}}
    return layers_check.judge("qwen_gdn", on, {})


def test_a_seam_standing_aside_passes_only_on_vllm_s_own_backend_choice():
    verdict = next(line for line in _aside_lines("default", {}) if line.startswith("VERDICT"))
    assert "PASS stands aside on flashinfer" in verdict
    # forced to Triton, the seam must route: standing aside there is a failure
    assert "FAIL" in next(line for line in _aside_lines("triton", {}) if line.startswith("VERDICT"))


@pytest.mark.parametrize("broken", [{"outputs_equal": False}, {"cache_equal": False}, {"calls_bypassed": 1}])
def test_standing_aside_still_needs_equal_bytes_and_nothing_bypassed(broken):
    verdict = next(line for line in _aside_lines("default", broken) if line.startswith("VERDICT"))
    assert verdict.split(":", 1)[1].strip().startswith("FAIL")


def test_a_layer_that_stood_aside_reports_the_wrapper_cost_not_a_routing_decision():
    default = next(line for line in _aside_lines("default", {}) if line.startswith("DEFAULT"))
    assert default.startswith("DEFAULT qwen_gdn: stands aside on flashinfer") and "1: 0.990x" in default
    # the same timing where the seam routed is a routing decision (slower at one sequence: stand aside)
    routed = next(line for line in _aside_lines("triton", {"calls_seen": 4, "calls_routed": 4, "calls_upstream": 0})
                  if line.startswith("DEFAULT"))
    assert routed.startswith("DEFAULT qwen_gdn: stand aside (patched slower at 1 sequences")


@pytest.mark.parametrize("backend", ["triton", "default"])
def test_the_children_get_the_prefill_backend_asked_for(backend, tmp_path):
    args = layers_check.argparse.Namespace(rounds=20, settle=1, burst=8, graph_instances=4, copy_costs=False,
                                           dry_run=False, host_profile=[], prefill_backend=backend)
    argv = layers_check.child_argv("qwen_gdn", True, args, tmp_path / "child.json")
    assert argv[argv.index("--prefill-backend") + 1] == backend
    assert layers_check.PREFILL_BACKENDS["default"] == {}  # vLLM's own choice: nothing set
