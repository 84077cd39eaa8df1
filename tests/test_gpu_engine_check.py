"""``scripts/gpu/vllm_engine_check.py`` on the CPU (issues 18, 26): its dry run, the op recorder's rules -- a missing
compiled op stays missing unless declared, a declared lookup-only op refuses to run (never with the real library),
and torch's lookup comes back -- and every rule a case is judged by, the seeded weights, the prompts and the mutant.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import types

import pytest
import torch
from script_loader import load_script as load_script_at

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "vllm_engine_check.py"


def load_script():
    return load_script_at("gpu/vllm_engine_check.py", "vllm_engine_check_under_test")


@pytest.fixture
def recorder():
    module = load_script()
    recorder = module.OpRecorder()
    recorder.install()
    yield module, recorder
    recorder.uninstall()


def test_the_dry_run_writes_models_prompts_and_the_plan_and_starts_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--dry-run"], capture_output=True,
                          text=True, check=True)
    assert "DRYRUN" in done.stdout
    report = json.loads((tmp_path / "vllm_engine.json").read_text())
    module = load_script()
    for name, spec in module.MODELS.items():
        assert json.loads((tmp_path / "models" / name / "config.json").read_text()) == spec.config
    assert set(report["plan"]) == {case.name for case in module.CASES}
    for case in module.CASES:
        argv = report["plan"][case.name]
        assert argv[argv.index("--baseline-runs") + 1] == ("1" if case.mutant else "2")
        # a case that stands aside expects no routed call; every other case makes regress require one
        assert (f"{module.MODELS[case.model].patch}:calls_routed" in argv) is not (
            case.stands_aside or bool(case.aside_on_backend))
        # a case standing aside on its backend requires the calls it left to upstream, counted
        assert (f"{module.MODELS[case.model].patch}:calls_upstream" in argv) is bool(case.aside_on_backend)
    assert report["runs"] == [] and "vllm.vllm_flash_attn" in report["stood_in"]
    assert set(report["throughput_plan"]) == set(module.THROUGHPUT_SHAPES) == set(report["bisect_plan"])


def test_an_undeclared_missing_op_stays_missing_and_is_recorded(recorder):
    _, recorder = recorder
    name = "kda_test_op_that_does_not_exist"
    assert not hasattr(torch.ops._C, name)  # a capability probe keeps its answer
    assert name in recorder.looked_up and recorder.looked_up[name].endswith(str(_line_of_hasattr()))


def _line_of_hasattr() -> int:
    source = pathlib.Path(__file__).read_text().splitlines()
    return next(number for number, line in enumerate(source, 1) if "assert not hasattr(torch.ops._C, name)" in line)


def test_a_declared_lookup_only_op_is_found_and_refuses_to_run(recorder, monkeypatch):
    module, recorder = recorder
    monkeypatch.setitem(module.OP_LOOKUP_ONLY, "kda_test_lookup_only", "a test declaration")
    op = torch.ops._C.kda_test_lookup_only
    with pytest.raises(module.StoodInOpCalled, match="kda_test_lookup_only"):
        op(torch.zeros(2))


def test_uninstall_gives_torch_its_own_lookup_back(recorder, monkeypatch):
    module, recorder = recorder
    monkeypatch.setitem(module.OP_LOOKUP_ONLY, "kda_test_lookup_only", "a test declaration")
    recorder.uninstall()
    with pytest.raises(AttributeError):
        torch.ops._C.kda_test_lookup_only  # noqa: B018


def test_a_cuda_view_of_unpinned_memory_is_refused():
    module = load_script()
    with pytest.raises(RuntimeError, match="pinned"):
        module.cuda_view_of(torch.zeros(4, dtype=torch.int32))


def test_with_the_real_library_no_op_is_stood_in(monkeypatch):
    module = load_script()
    recorder = module.OpRecorder(library=True)
    monkeypatch.setitem(module.OP_LOOKUP_ONLY, "kda_test_lookup_only", "a test declaration")
    assert recorder.stand_in("kda_test_lookup_only") is None and "kda_test_lookup_only" in recorder.looked_up
    assert recorder.stand_in("get_cuda_view_from_cpu_tensor") is None
    assert module.OpRecorder(library=False).stand_in("get_cuda_view_from_cpu_tensor") is module.cuda_view_of


# ---------------------------------------------------------------- judging a case: each rule alone decides

PASSING_REPORT = {"verdict": "equal", "patched_counter_totals": {"gdn_state_copy": {"calls_routed": 6,
                                                                                  "calls_seen": 6}}}


def passing_outputs(module, hit=800, preemptions=2):
    return {"patched": {"cached_prompt_tokens": {module.CONTINUATION: hit},
                        "engine_stats": {"preemptions": preemptions}}}


def case(module, **changes):
    base = {"name": "t", "model": "qwen3_5", "runner": "v2", "prefix_caching": True, "eager": True}
    return module.Case(**{**base, **changes})


def test_an_equal_case_with_every_call_routed_passes():
    module = load_script()
    passed, why = module.judge_case(case(module), PASSING_REPORT, passing_outputs(module))
    assert passed and "routed 6 == seen 6" in why


def test_a_verdict_other_than_expected_fails():
    module = load_script()
    assert not module.judge_case(case(module), dict(PASSING_REPORT, verdict="different"), passing_outputs(module))[0]
    negative = case(module, mutant="scatter-halved")
    assert not module.judge_case(negative, PASSING_REPORT, passing_outputs(module))[0]
    assert module.judge_case(negative, dict(PASSING_REPORT, verdict="different"), passing_outputs(module))[0]


def test_a_case_whose_state_copy_never_ran_fails_negative_control_included():
    module = load_script()
    idle = {"verdict": "equal", "patched_counter_totals": {"gdn_state_copy": {"calls_seen": 0}}}
    assert not module.judge_case(case(module), idle, passing_outputs(module))[0]
    negative = case(module, mutant="scatter-halved")
    assert not module.judge_case(negative, dict(idle, verdict="different"), passing_outputs(module))[0]


def test_a_bypassed_call_fails_an_equal_case():
    module = load_script()
    bypassed = {"verdict": "equal", "patched_counter_totals": {"gdn_state_copy": {"calls_routed": 5,
                                                                                 "calls_seen": 6}}}
    passed, why = module.judge_case(case(module), bypassed, passing_outputs(module))
    assert not passed and "bypassed" in why


def test_prefix_caching_without_a_cache_hit_fails():
    module = load_script()
    assert not module.judge_case(case(module), PASSING_REPORT, passing_outputs(module, hit=0))[0]
    assert module.judge_case(case(module, prefix_caching=False), PASSING_REPORT, passing_outputs(module, hit=0))[0]


def test_a_small_cache_without_a_preemption_fails():
    module = load_script()
    small = case(module, kv_blocks=7)
    assert not module.judge_case(small, PASSING_REPORT, passing_outputs(module, preemptions=0))[0]
    assert not module.judge_case(small, PASSING_REPORT, passing_outputs(module, preemptions=None))[0]
    assert module.judge_case(small, PASSING_REPORT, passing_outputs(module, preemptions=1))[0]
    assert module.judge_case(case(module), PASSING_REPORT, passing_outputs(module, preemptions=0))[0]


def test_a_case_on_a_runner_its_model_cannot_use_is_refused():
    module = load_script()
    assert "v2" not in module.MODELS["kimi_k3"].runners
    module.CASES = (*module.CASES, case(module, name="kimi-v2", model="kimi_k3", runner="v2"))
    with pytest.raises(ValueError, match="kimi_k3 runs on"):
        module.validate_cases(["kimi-v2"])
    with pytest.raises(ValueError, match="unknown case"):
        module.validate_cases(["no-such-case"])


def test_the_preempting_cases_cap_the_model_length_their_small_cache_must_hold(tmp_path):
    module = load_script()
    prompts = tmp_path / "p.jsonl"
    records = module.write_prompts(prompts)
    records += module.write_prompts(tmp_path / "q.jsonl", preempt=True)
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in records)
    params = module.engine_params(case(module, kv_blocks=7), tmp_path, prompts)
    assert params["num_gpu_blocks_override"] == 7 and longest <= params["max_model_len"]
    assert "num_gpu_blocks_override" not in module.engine_params(case(module), tmp_path, prompts)


# ---------------------------------------------------------------- prompts, weights, mutant


def test_round_two_continues_a_chunked_round_one_prompt(tmp_path):
    module = load_script()
    records = module.write_prompts(tmp_path / "p.jsonl")
    by_name = {r["name"]: r for r in records}
    continued, source = by_name[module.CONTINUATION], by_name["r1-long-1100"]
    assert continued["round"] == 2 and continued["prompt_token_ids"][:1100] == source["prompt_token_ids"]
    assert all(0 <= t < module.VOCAB for r in records for t in r["prompt_token_ids"])
    assert any(len(r["prompt_token_ids"]) > 256 for r in records if r.get("round", 1) == 1)  # chunked prefill
    lines = (tmp_path / "p.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records


def test_the_wide_round_prefills_more_sequences_than_the_auto_crossover_in_one_step(tmp_path):
    from kda_patches.indexed_chunk import AUTO_MIN_SEQUENCES

    module = load_script()
    default = module.write_prompts(tmp_path / "p.jsonl")
    records = module.write_prompts(tmp_path / "w.jsonl", wide=True)
    assert records[:len(default)] == default  # the default rounds first, unchanged
    wide = [r for r in records if r.get("round") == 3]
    params = module.engine_params(case(module, wide=True), tmp_path, tmp_path / "w.jsonl")
    assert len(wide) > AUTO_MIN_SEQUENCES and len(wide) <= params["max_num_seqs"]  # one step holds them all
    assert sum(len(r["prompt_token_ids"]) for r in wide) <= params["max_num_batched_tokens"]
    assert case(module, wide=True).prompt_set == "wide" and case(module).prompt_set == "default"


def test_seeded_weights_depend_on_the_name_not_the_order_and_have_a_realistic_scale():
    module = load_script()
    first = module.seeded_values("model.layers.0.mlp.down_proj.weight", (256, 512), 7)
    again = module.seeded_values("model.layers.0.mlp.down_proj.weight", (256, 512), 7)
    other = module.seeded_values("model.layers.1.mlp.down_proj.weight", (256, 512), 7)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert 0.018 < float(first.std()) < 0.022
    assert torch.equal(module.seeded_values("model.norm.weight", (8,), 7), torch.ones(8))
    assert torch.equal(module.seeded_values("model.layers.0.linear_attn.dt_bias", (12,), 7), torch.ones(12))
    decay = module.seeded_values("model.layers.0.linear_attn.A_log", (12,), 7)
    assert float(decay.min()) >= 0.0 and float(decay.max()) <= float(torch.log(torch.tensor(16.0))) + 1e-6


def test_reinit_overwrites_every_parameter_in_place():
    module = load_script()
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(64, 32), "norm": torch.nn.LayerNorm(32)})
    pointers = [p.data_ptr() for p in model.parameters()]
    assert module.reinit_weights(model, 3) == 4
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert torch.equal(model["proj"].weight, module.seeded_values("proj.weight", (32, 64), 3))
    assert torch.equal(model["proj"].bias, torch.zeros(32)) and torch.equal(model["norm"].bias, torch.zeros(32))
    assert torch.equal(model["norm"].weight, torch.ones(32))


def test_the_mutant_halves_what_the_plan_is_given_to_scatter():
    module = load_script()
    seen = {}

    def scatter(state, packed, indices, layer=None):
        seen.update(packed=packed, indices=indices, layer=layer)

    packed = torch.randn(3, 2, 4, 4)
    module._halve_before_scatter(scatter, None, ("state", packed, "idx"), {"layer": "L"})
    assert torch.equal(seen["packed"], packed * 0.5) and seen["indices"] == "idx" and seen["layer"] == "L"


def test_the_upstream_mutant_halves_upstream_s_scatter_in_patched_processes_only(monkeypatch):
    module = load_script()
    target = types.ModuleType("kda_test_upstream_scatter_target")
    stored = {}

    def scatter_states(state, source, indices):
        stored.update(source=source, indices=indices)

    target.scatter_states = scatter_states
    monkeypatch.setitem(sys.modules, target.__name__, target)
    monkeypatch.setattr(module, "UPSTREAM_SCATTER", (target.__name__, "scatter_states"))
    assert module.install_mutant("upstream-scatter-halved", patched=False) == []
    assert target.scatter_states is scatter_states  # a baseline process runs upstream's scatter as released
    source = torch.randn(3, 2, 4, 4)
    assert module.install_mutant("upstream-scatter-halved", patched=True) == [f"{target.__name__}:scatter_states"]
    target.scatter_states("cache", source, "idx")
    assert torch.equal(stored["source"], source * 0.5) and stored["indices"] == "idx"


def test_an_unknown_mutant_is_refused_by_name(monkeypatch):
    module = load_script()
    monkeypatch.setenv(module.MUTANT_ENV, "no-such-mutant")
    monkeypatch.delenv(module.SEEDED_WEIGHTS_ENV, raising=False)
    try:
        with pytest.raises(ValueError, match="no-such-mutant"):
            module.install_engine_stand_ins()
    finally:
        module.RECORDER.uninstall()


def test_the_preempting_prompts_each_decode_past_any_block_their_prompt_was_admitted_with(tmp_path):
    module = load_script()
    records = module.write_prompts(tmp_path / "p.jsonl", preempt=True)
    assert len(records) == 8 and all(r["max_tokens"] > 2 * len(r["prompt_token_ids"]) for r in records)
    assert all(r.get("round", 1) == 1 for r in records)


def test_a_model_whose_library_was_not_carried_is_not_run_and_says_why(tmp_path):
    module = load_script()
    cases = module.validate_cases(["qwen3_5-v2-prefix-eager", "qwen3_next-v2-prefix-eager"])
    ready, not_run = module.runnable(cases, tmp_path, gpus=1)
    assert [c.name for c in ready] == ["qwen3_5-v2-prefix-eager"]
    assert "carry --with-moe" in not_run["qwen3_next-v2-prefix-eager"]
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / module.MOE_LIBRARY).write_bytes(b"\x7fELF")
    ready, not_run = module.runnable(cases, tmp_path, gpus=1)
    assert len(ready) == 2 and not_run == {}


def test_a_case_at_the_defaults_runs_only_where_the_package_vllm_picks_there_was_carried(tmp_path):
    module = load_script()
    cases = module.validate_cases(["qwen3_next-v2-prefix-defaults-034", "qwen3_next-v2-prefix-eager-034"])
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / module.MOE_LIBRARY).write_bytes(b"\x7fELF")
    ready, not_run = module.runnable(cases, tmp_path, gpus=1, version="0.34.0")
    assert [c.name for c in ready] == ["qwen3_next-v2-prefix-eager-034"]
    assert "--with-fa3" in not_run["qwen3_next-v2-prefix-defaults-034"]  # its attention layers: FlashAttention 3
    (tmp_path / "vllm" / "vllm_flash_attn").mkdir()
    (tmp_path / "vllm" / module.gpu_harness.FA3_LIBRARY).write_bytes(b"\x7fELF")
    ready, not_run = module.runnable(cases, tmp_path, gpus=1, version="0.34.0")
    assert "carry --with-flashinfer" in not_run["qwen3_next-v2-prefix-defaults-034"]
    sampler = "VLLM_USE_FLASHINFER_SAMPLER"
    assert module.case_env(cases[0], tmp_path, tmp_path)[sampler] == "0"  # FlashInfer absent: vLLM's own sampler
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("")
    assert len(module.runnable(cases, tmp_path, gpus=1, version="0.34.0")[0]) == 2
    assert sampler not in module.case_env(cases[0], tmp_path, tmp_path)  # carried: vLLM's default sampler
    assert module.case_env(cases[1], tmp_path, tmp_path)[sampler] == "0"  # a forced-backend case keeps its override
    assert sampler not in module.bench_env("b", tmp_path, tmp_path, "qwen3_next-short-defaults")
    assert module.bench_env("b", tmp_path, tmp_path, "short")[sampler] == "0"


def test_a_case_needing_more_gpus_than_the_machine_has_is_not_run_and_names_the_kind(tmp_path):
    module = load_script()
    cases = module.validate_cases(["qwen3_5-v2-prefix-eager-tp2"])
    ready, not_run = module.runnable(cases, tmp_path, gpus=1)
    assert ready == [] and "nvidia-h200-x2" in not_run["qwen3_5-v2-prefix-eager-tp2"]
    assert module.runnable(cases, tmp_path, gpus=2)[0] == cases
    params = module.engine_params(cases[0], tmp_path, tmp_path / "p.jsonl")
    assert params["tensor_parallel_size"] == 2 and params["distributed_executor_backend"] == "mp"


def tp2_report(module, rank1_devices=("cuda:1",), rank1_counts=(8, 8), ranks_met=True):
    def worker(rank, devices, counts):
        facts = {f"model.layers.{i}.linear_attn": {"signature": [device, "torch.bfloat16"]}
                 for i, device in enumerate(devices)}
        return {"role": f"VllmWorker-{rank}", "counters": {"gdn_state_copy": {"calls_routed": counts[0],
                                                                               "calls_seen": counts[1]}},
                "facts": {"state_copy": {"initialization": {"ok": True}, **facts}}}
    return {"ranks": [{"label": "rank 0", "met": True}, {"label": "rank 1", "met": ranks_met, "detail": "x"}],
            "runs": {"patched": {"ledgers": [worker(0, ("cuda:0", "cuda:0"), (8, 8)),
                                             worker(1, rank1_devices, rank1_counts)]}}}


def test_every_rank_must_route_through_plans_on_its_own_gpu():
    module = load_script()
    tp2 = module.validate_cases(["qwen3_5-v2-prefix-eager-tp2"])[0]
    assert module.judge_ranks(tp2, tp2_report(module)) == (True, "rank 0 8 == 8 on cuda:0; rank 1 8 == 8 on cuda:1")
    assert not module.judge_ranks(tp2, tp2_report(module, rank1_devices=("cuda:0",)))[0]
    assert not module.judge_ranks(tp2, tp2_report(module, rank1_devices=("cuda:1", "cuda:0")))[0]
    assert not module.judge_ranks(tp2, tp2_report(module, rank1_counts=(7, 8)))[0]
    assert not module.judge_ranks(tp2, tp2_report(module, rank1_counts=(0, 0)))[0]
    assert not module.judge_ranks(tp2, tp2_report(module, ranks_met=False))[0]
    negative = module.validate_cases(["qwen3_5-v2-prefix-eager-tp2-NEGATIVE"])[0]
    assert module.judge_ranks(negative, tp2_report(module, rank1_counts=(7, 8)))[0]
    assert module.judge_ranks(case(module), {}) == (True, "")


def test_every_process_must_have_multicast_off(tmp_path, monkeypatch):
    module = load_script()
    assert not module.check_process_envs(tmp_path / "none")[0]
    for name, value in module.NO_MULTICAST.items():
        monkeypatch.setenv(name, value)
    module.record_process_env(tmp_path)
    assert module.check_process_envs(tmp_path)[0]
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    (tmp_path / "env-1.json").write_text(json.dumps({"pid": 1, "argv": [], "env": {
        **module.NO_MULTICAST, "NCCL_NVLS_ENABLE": None}}))
    ok, why = module.check_process_envs(tmp_path)
    assert not ok and "1 of 2 processes" in why


def test_a_throughput_shape_needing_more_gpus_is_not_run(tmp_path):
    module = load_script()
    assert module.shape_gpus("long") == 1 and module.shape_gpus("long-tp2") == 2
    result = module.run_throughput("long-tp2", tmp_path, tmp_path, tmp_path, tmp_path, rounds=5, gpus=1)
    assert result["exit_code"] is None and "needs 2 GPUs" in result["problems"][0]
    assert not (tmp_path / "throughput-long-tp2").exists()


def test_ray_actors_are_counted_and_each_holds_its_plans_on_one_device():
    module = load_script()
    ray = module.validate_cases(["qwen3_5-v2-prefix-eager-tp2-ray"])[0]
    report = tp2_report(module, rank1_devices=("cuda:0",))  # each actor sees its GPU as cuda:0
    for ledger in report["runs"]["patched"]["ledgers"]:
        ledger["argv"] = ["/usr/lib/python3/site-packages/ray/_private/workers/default_worker.py"]
    assert module.judge_ranks(ray, report)[0]
    report["runs"]["patched"]["ledgers"][1]["facts"]["state_copy"]["model.layers.9"] = {"signature": ["cuda:1"]}
    assert "expected one device" in module.judge_ranks(ray, report)[1]
    report["runs"]["patched"]["ledgers"].pop()
    assert module.judge_ranks(ray, report) == (False, "1 Ray actor ledgers, expected 2")


def test_a_ray_case_runs_only_where_ray_was_carried(tmp_path):
    module = load_script()
    cases = module.validate_cases(["qwen3_5-v2-prefix-eager-tp2-ray"])
    ready, not_run = module.runnable(cases, tmp_path, gpus=2)
    assert ready == [] and "--with-ray" in not_run[cases[0].name]
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("")
    assert module.runnable(cases, tmp_path, gpus=2)[0] == cases
    assert module.engine_params(cases[0], tmp_path, tmp_path / "p")["distributed_executor_backend"] == "ray"


def test_every_throughput_shape_states_lengths_the_benchmark_reads(tmp_path):
    from kda_patches.bench.token_totals import requested_token_totals

    module = load_script()
    for shape in module.THROUGHPUT_SHAPES:
        argv = module.throughput_argv(shape, tmp_path / "model", 5, tmp_path / shape)
        bench = argv[argv.index("--") + 1:]
        assert "--input-len" not in bench and "--output-len" not in bench, shape  # ignored by vLLM 0.33 (run 4)
        totals = requested_token_totals(bench)
        assert totals is not None and set(totals) == {"prompt", "output"}, shape


def test_a_throughput_call_warms_up_first_and_a_later_call_resumes(tmp_path):
    module = load_script()
    target = tmp_path / "throughput-long"
    first = module.throughput_argv("long", tmp_path, 5, target, time_budget_s=540.4)
    assert "--warmup" in first and "--resume" not in first
    assert first[first.index("--time-budget") + 1] == "540" and first.index("--time-budget") < first.index("--")
    target.mkdir()
    (target / "serve_ab.json").write_text("{}")
    later = module.throughput_argv("long", tmp_path, 5, target)
    assert "--resume" in later and "--warmup" not in later and "--time-budget" not in later


def test_a_bisection_runs_the_shapes_requests_with_the_benchmarks_engine_settings(tmp_path):
    from kda_patches.bench import step_times
    from kda_patches.bench.engine_repeat import child_parser, engine_kwargs

    module = load_script()
    assert module.STEP_TIMES_ENV == step_times.ENV
    for shape in module.THROUGHPUT_SHAPES:
        argv = module.bisect_argv(shape, tmp_path / "model", tmp_path / shape, ["patched", "a:X=1"], 3)
        assert argv[argv.index("--out") + 1] == str(tmp_path / shape) and argv.count("--arm") == 2
        child = child_parser().parse_args([*argv[argv.index("--") + 1:], "--result", "r"])
        bench = module.throughput_argv(shape, tmp_path / "model", 5, tmp_path / "t")
        bench = bench[bench.index("--") + 1:]

        def option(name, bench=bench):
            return int(bench[bench.index(name) + 1])
        assert (child.input_len, child.output_len, child.num_prompts, child.max_num_seqs, child.repeats) == (
            option("--random-input-len"), option("--random-output-len"), option("--num-prompts"),
            option("--max-num-seqs"), 3)
        kwargs = engine_kwargs(child)
        assert kwargs["gpu_memory_utilization"] == 0.6
        if shape in module.SHAPES_AT_DEFAULTS:  # no backend argument: vLLM picks, in both tools
            assert "attention_backend" not in kwargs and "additional_config" not in kwargs
            assert "--attention-backend" not in bench and "--additional-config" not in bench
        else:
            assert kwargs["attention_backend"] == "TRITON_ATTN"
            assert kwargs["additional_config"] == {"gdn_prefill_backend": "triton"}
            assert bench[bench.index("--attention-backend") + 1] == "TRITON_ATTN"
        if "--tensor-parallel-size" in bench:
            assert kwargs["tensor_parallel_size"] == option("--tensor-parallel-size")
    argv = module.bisect_argv("short", tmp_path, tmp_path / "b", ["patched"], 2, num_prompts=1024)
    assert argv[argv.index("--num-prompts") + 1] == "1024" and "--interleave" not in argv
    driver = module.bisect_argv("short", tmp_path, tmp_path / "b", ["patched"], 2, interleave=6, cpus="2-9")
    driver = driver[:driver.index("--")]
    assert driver[driver.index("--interleave") + 1] == "6"  # an engine_repeat option, not the child's
    assert driver[driver.index("--cpus") + 1] == "2-9"
    module.THROUGHPUT_SHAPES["odd"] = (("--dataset-name", "sharegpt"), "an option engine_repeat cannot follow")
    try:
        with pytest.raises(ValueError, match="--dataset-name has no engine_repeat counterpart"):
            module.bisect_argv("odd", tmp_path, tmp_path / "c", ["patched"], 2)
    finally:
        del module.THROUGHPUT_SHAPES["odd"]


def test_the_peer_run_measures_the_unpacked_releases_own_ops_on_both_shapes(tmp_path):
    from kda_patches.bench.cli import build_parser

    module = load_script()
    argv = module.peer_argv("0.33.0", tmp_path / "peer.json")
    args = build_parser().parse_args(argv[argv.index("bench") + 1:])
    assert (args.benchmark, args.release, args.device, args.output) == ("peer", "vllm==0.33.0", "cuda",
                                                                       str(tmp_path / "peer.json"))
    assert [shape.split("=")[1] for shape in args.shapes.split(";")] == ["12,128,128", "32,128,128"]
    assert args.pdl  # the plan with programmatic dependent launch measured beside it
    assert args.seed == 0
    reseeded = module.peer_argv("0.33.0", tmp_path / "peer.json", seed=43)
    assert build_parser().parse_args(reseeded[reseeded.index("bench") + 1:]).seed == 43


@pytest.mark.parametrize("mode", ["bisect", "peer"])
def test_the_bisect_and_peer_runs_start_one_child_in_the_engine_environment(tmp_path, monkeypatch, mode):
    # the device steps before the child (unpacking, the library check) are stood in; what the child gets is real
    module = load_script()
    harness = module.gpu_harness
    monkeypatch.setattr(harness, "prepare_site", lambda *a, **k: {"vllm_version": "0.33.0", "bundle": {}})
    monkeypatch.setattr(harness, "library_present", lambda *a, **k: True)
    monkeypatch.setattr(harness, "SITE_DIR", tmp_path / "site")
    started = []
    monkeypatch.setattr(module.subprocess, "run", lambda argv, env, cwd: started.append((argv, env)) or
                        subprocess.CompletedProcess(argv, 7))
    extra = (["--bisect", "short", "--num-prompts", "64", "--repeats", "2", "--interleave", "5"] if mode == "bisect"
             else ["--peer", "--peer-seed", "43"])
    assert module.main(["--out", str(tmp_path / "out"), *extra]) == 7  # the child's exit status
    (argv, env), = started
    assert str(tmp_path / "site-engine-hook") == env["PYTHONPATH"].split(":")[0]  # the stand-in hook first
    assert module.SEEDED_WEIGHTS_ENV not in env
    if mode == "bisect":
        assert argv[argv.index("--out") + 1] == str(tmp_path / "out" / "bisect-short")
        assert argv[argv.index("--num-prompts") + 1] == "64" and env[module.STEP_TIMES_ENV] == "1"
        assert argv[argv.index("--interleave") + 1] == "5"
        assert (tmp_path / "out" / "models" / "qwen3_5_bench" / "config.json").is_file()
    else:
        assert argv[argv.index("--release") + 1] == "vllm==0.33.0"
        assert argv[argv.index("--seed") + 1] == "43"


def test_the_throughput_line_says_a_shape_stopped_for_time():
    module = load_script()
    result = {"shape": "long", "exit_code": 3, "rounds_done": 2, "rounds": 5, "problems": [],
              "metrics": {"tokens_per_second": {"min": 0.99, "median": 1.01, "max": 1.02}}}
    line = module.throughput_line(result)
    assert "exit 3, 2 of 5 rounds (stopped for time: run the same command again to continue)" in line
    assert "tokens_per_second 0.990/1.010/1.020" in line
    assert "stopped for time" not in module.throughput_line({**result, "exit_code": 0, "rounds_done": 5})


def staged_release(tmp_path: pathlib.Path, harness, version: str) -> pathlib.Path:
    """Stage a tiny carry of vLLM ``version`` (a bundle whose manifest names it, with one minimal wheel)."""
    import zipfile

    wheel = tmp_path / "kdafakeeng-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("kdafakeeng/__init__.py", "")
        archive.writestr("kdafakeeng-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: kdafakeeng\nVersion: 0.1\n")
        archive.writestr("kdafakeeng-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("kdafakeeng-0.1.dist-info/RECORD", "")
    bundle = tmp_path / f"vllm-{version}-cp312.zip"
    with zipfile.ZipFile(bundle, "w") as archive:
        archive.writestr("site/vllm/__init__.py", "")
        archive.writestr(f"site/vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\n")
        archive.write(wheel, f"wheels/{wheel.name}")
        archive.writestr("manifest.json", json.dumps({"vllm_version": version}))
    harness.write_carry({bundle.name: bundle}, tmp_path / "carry", 1 << 20, vllm_version=version)
    stage = tmp_path / "stage"
    harness.stage_pieces(tmp_path / "carry" / "run1", stage)
    return stage


@pytest.mark.parametrize("version", ["0.34.0", "0.33.0"])
def test_the_report_names_the_staged_release_never_an_assumed_one(tmp_path, monkeypatch, version):
    module = load_script()
    harness = module.gpu_harness
    stage = staged_release(tmp_path, harness, version)
    monkeypatch.setattr(harness, "STAGE_DIR", stage)
    assert module.main(["--out", str(tmp_path / "out"), "--dry-run", "--cases", "qwen3_5-v2-prefix-eager"]) == 0
    assert json.loads((tmp_path / "out" / "vllm_engine.json").read_text())["vllm"] == version
    # the run itself: unpacks what was staged and reports its version (here no case can run: no GPU)
    monkeypatch.setattr(harness, "SITE_DIR", tmp_path / "site")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert module.main(["--out", str(tmp_path / "run"), "--cases", "qwen3_5-v2-prefix-eager"]) == 0
    report = json.loads((tmp_path / "run" / "vllm_engine.json").read_text())
    assert report["vllm"] == report["bundle"]["vllm_version"] == version
    assert set(report["not_run"]) == {"qwen3_5-v2-prefix-eager"} and report["runs"] == []
    prepared = harness.prepare_site(None, tmp_path / "site", stage)
    assert module.report_version(prepared) == version
    with pytest.raises(RuntimeError, match="names no vllm_version"):
        module.report_version({**prepared, "vllm_version": None, "bundle": {}})


def test_a_dry_run_with_nothing_staged_names_no_release(tmp_path, monkeypatch):
    module = load_script()
    monkeypatch.setattr(module.gpu_harness, "STAGE_DIR", tmp_path / "empty-stage")
    assert module.main(["--out", str(tmp_path / "out"), "--dry-run", "--cases", "qwen3_5-v2-prefix-eager"]) == 0
    assert json.loads((tmp_path / "out" / "vllm_engine.json").read_text())["vllm"] is None



# ---------------------------------------------------------------- vLLM 0.34 cases (issue 27): each rule alone decides

def stood_aside_report(module, state="not-applicable", reason="... so the overlay stands aside (...)", seen=0):
    """A regress report whose patched ledgers are what the runner keeps of real ledger snapshots (H200 run 9: the
    summary once dropped every target but the applied ones, so a real stand-aside read as "no record")."""
    from kda_patches.ledger import Ledger
    from kda_patches.regress.ledgers import summarize_ledger

    core, worker = Ledger(), Ledger()
    core.role, worker.role = "EngineCore", "VllmWorker-0"
    worker.record_target("gdn_state_copy", "vllm.v1.worker.gpu.model_runner:GPUModelRunner.initialize_kv_cache",
                         "applied", "wrapped")
    worker.record_target("gdn_state_copy", module.QWEN_GDN_SEAM, state, reason)
    ledgers = [summarize_ledger(ledger.snapshot()) for ledger in (core, worker)]
    return {"verdict": "equal", "patched_counter_totals": {"gdn_state_copy": {"calls_seen": seen}},
            "runs": {"patched": {"ledgers": ledgers}}}


def test_a_case_that_stands_aside_passes_only_when_the_seam_is_visibly_left_alone():
    module = load_script()
    aside = case(module, model="qwen3_next", release="0.34.0", stands_aside=True, extensible=True)
    passed, why = module.judge_case(aside, stood_aside_report(module), passing_outputs(module))
    assert passed and "stands aside" in why
    assert not module.judge_case(aside, stood_aside_report(module, seen=4), passing_outputs(module))[0]
    assert not module.judge_case(aside, stood_aside_report(module, state="applied"), passing_outputs(module))[0]
    unexplained = stood_aside_report(module, reason="waiting for import of the module")
    assert not module.judge_case(aside, unexplained, passing_outputs(module))[0]
    assert not module.judge_case(aside, dict(stood_aside_report(module), verdict="different"),
                                 passing_outputs(module))[0]
    assert not module.judge_case(case(module, model="qwen3_next"), stood_aside_report(module),
                                 passing_outputs(module))[0]  # the same run fails a case that must route


def test_the_extensible_cache_must_rebind_the_routed_plans_and_a_disabled_one_never():
    module = load_script()
    rebound = {"verdict": "equal", "patched_counter_totals": {"gdn_state_copy": {"calls_routed": 6, "calls_seen": 6,
                                                                                "rebinds": 2}}}
    extensible = case(module, model="qwen3_next", release="0.34.0", gdn_ops="overlay", extensible=True)
    assert module.judge_case(extensible, rebound, passing_outputs(module))[0]
    passed, why = module.judge_case(extensible, PASSING_REPORT, passing_outputs(module))
    assert not passed and "republished no plan" in why
    fixed = case(module, model="qwen3_next", release="0.34.0", gdn_ops="overlay", extensible=False)
    assert module.judge_case(fixed, PASSING_REPORT, passing_outputs(module))[0]
    assert not module.judge_case(fixed, rebound, passing_outputs(module))[0]
    assert module.judge_case(case(module), rebound, passing_outputs(module))[0]  # 0.33: nothing to expect


def pdl_report(*facts):
    ledgers = [{"facts": {"state_copy": {f"layer.{n}": {"pdl": pdl, "signature": ["cuda:0"]} for n, pdl in group}}}
               for group in facts]
    return dict(PASSING_REPORT, runs={"patched": {"ledgers": ledgers}})


def test_a_pdl_case_passes_only_when_every_routed_plan_of_every_process_launched_with_pdl(tmp_path, monkeypatch):
    monkeypatch.delenv("KDA_PATCHES_PDL", raising=False)
    module = load_script()
    launched = case(module, pdl=True)
    passed, why = module.judge_case(launched, pdl_report([(0, True), (1, True)], [(2, True)]), passing_outputs(module))
    assert passed and "3 layer plan(s) with PDL" in why
    passed, why = module.judge_case(launched, pdl_report([(0, True)], [(1, False)]), passing_outputs(module))
    assert not passed and "layer.1" in why and "launch plainly" in why
    assert not module.judge_case(launched, pdl_report(), passing_outputs(module))[0]  # no plan recorded
    assert not module.judge_case(launched, PASSING_REPORT, passing_outputs(module))[0]  # no ledger at all
    assert module.judge_case(case(module), pdl_report([(0, False)]), passing_outputs(module))[0]  # not a PDL case
    # a PDL case runs the switch's default (auto) even where the caller turned it off
    monkeypatch.setenv("KDA_PATCHES_PDL", "0")
    assert "KDA_PATCHES_PDL" not in module.case_env(launched, tmp_path, tmp_path)
    assert module.case_env(case(module), tmp_path, tmp_path)["KDA_PATCHES_PDL"] == "0"
    from kda_patches.state_copy.errors import LEDGER_SECTION

    assert module.STATE_COPY_SECTION == LEDGER_SECTION  # the section the judge reads is the one the plans write
    names = {c.name: c for c in module.CASES}
    assert all(names[n].pdl for n in ("qwen3_next-v2-prefix-compiled-034-overlay-pdl",
                                      "qwen3_next-v2-prefix-eager-034-overlay-pdl-NEGATIVE",
                                      "kimi_k3-v2-prefix-eager-034-pdl"))


def test_034_cases_set_the_seam_choice_the_cache_and_the_jit_monitor(tmp_path):
    module = load_script()
    by_name = {c.name: c for c in module.CASES}
    overlay = by_name["qwen3_next-v2-prefix-compiled-034-overlay-jit-watch"]
    params = module.engine_params(overlay, tmp_path, tmp_path / "p.jsonl")
    assert params["jit_monitor_mode"] == "warn" and "kv_cache_memory_bytes" not in params  # else 0.34 turns it off
    assert module.case_env(overlay, tmp_path, tmp_path)["KDA_PATCHES_GDN_OPS"] == "overlay"
    fixed = module.engine_params(by_name["qwen3_next-v2-prefix-eager-034-overlay-not-extensible"], tmp_path,
                                 tmp_path / "p.jsonl")
    assert fixed["enable_extensible_kv_cache"] is False and fixed["kv_cache_memory_bytes"] == 2 << 30
    default = by_name["qwen3_next-v2-prefix-eager-034"]
    assert "KDA_PATCHES_GDN_OPS" not in module.case_env(default, tmp_path, tmp_path) and not default.stands_aside
    upstream = by_name["qwen3_next-v2-prefix-eager-034-upstream"]
    assert upstream.stands_aside and module.case_env(upstream, tmp_path, tmp_path)["KDA_PATCHES_GDN_OPS"] == "upstream"
    assert "jit_monitor_mode" not in module.engine_params(default, tmp_path, tmp_path / "p.jsonl")
    assert "enable_extensible_kv_cache" not in module.engine_params(by_name["qwen3_5-v2-prefix-eager"], tmp_path,
                                                                    tmp_path / "p.jsonl")


def test_a_case_runs_only_on_the_release_it_was_written_for(tmp_path):
    module = load_script()
    cases = module.validate_cases(["qwen3_5-v2-prefix-eager", "kimi_k3-v2-prefix-eager-034"])
    ready, not_run = module.runnable(cases, tmp_path, gpus=1, version="0.34.0")
    assert [c.name for c in ready] == ["kimi_k3-v2-prefix-eager-034"]
    assert "needs vLLM 0.33.0's bundle" in not_run["qwen3_5-v2-prefix-eager"]
    ready, not_run = module.runnable(cases, tmp_path, gpus=1, version="0.33.0")
    assert [c.name for c in ready] == ["qwen3_5-v2-prefix-eager"] and "kimi_k3-v2-prefix-eager-034" in not_run


def test_034_has_only_the_v2_runner_and_a_stand_aside_needs_a_declared_seam():
    module = load_script()
    v1 = module.Case("x", "qwen3_next", "v1", True, True, release="0.34.0")
    aside = module.Case("y", "kimi_k3", "v2", True, True, release="0.34.0", stands_aside=True)
    for bad, message in ((v1, "runs on \\('v2',\\) under vLLM 0.34.0"), (aside, "declares no seam")):
        original = module.CASES
        module.CASES = (*original, bad)
        try:
            with pytest.raises(ValueError, match=message):
                module.validate_cases([bad.name])
        finally:
            module.CASES = original


# vLLM 0.34's JIT monitor as its warn mode logs it (utils/jit_monitor.py _handle_jit_event; a line of H200 run 9)
JIT_LOG = ("INFO [jit_monitor.py:87] Kernel JIT monitor activated; monitored JIT compilations during inference will "
           "use mode=warn.\n")
UPSTREAM_JIT = ("WARNING [jit_monitor.py:143] Triton kernel JIT compilation during inference: kernel_unified_attention"
                ". This causes a latency spike; consider extending warmup to cover this shape/config.\n")
OVERLAY_JIT = UPSTREAM_JIT.replace("kernel_unified_attention", "fused_state_copy_kernel (num_warps=4)")


def jit_outputs(module, baseline_log, patched_log):
    outputs = passing_outputs(module)
    outputs["baseline"] = {"jit": module.jit_compiles(baseline_log)}
    outputs["patched"]["jit"] = module.jit_compiles(patched_log)
    return outputs


def test_a_jit_watch_case_fails_only_on_a_compile_the_baseline_did_not_have():
    module = load_script()
    watch = case(module, eager=False, jit_watch=True)
    both = JIT_LOG + UPSTREAM_JIT
    assert module.jit_compiles(both)["events"] == [
        "Triton kernel JIT compilation: kernel_unified_attention"]
    passed, why = module.judge_case(watch, PASSING_REPORT, jit_outputs(module, both, both))
    assert passed and "beyond the baseline's 1" in why
    passed, why = module.judge_case(watch, PASSING_REPORT, jit_outputs(module, both, both + OVERLAY_JIT))
    assert not passed and "fused_state_copy_kernel (num_warps=4)" in why
    passed, why = module.judge_case(watch, PASSING_REPORT, jit_outputs(module, both, UPSTREAM_JIT))
    assert not passed and "not activated" in why  # a monitor that never ran shows nothing
    assert module.judge_case(case(module), PASSING_REPORT, jit_outputs(module, both, UPSTREAM_JIT))[0]  # no watch


def test_summarize_outputs_reads_each_side_s_jit_compiles_from_its_log(tmp_path):
    module = load_script()
    for side, log in (("baseline", JIT_LOG + UPSTREAM_JIT), ("patched", "")):
        (tmp_path / side).mkdir()
        (tmp_path / side / "outputs.json").write_text(json.dumps({"outputs": {"requests": []}}))
        (tmp_path / side / "run.log").write_text(log)
    summary = module.summarize_outputs(tmp_path)
    assert summary["baseline"]["jit"] == {"monitor_on": True,
                                          "events": ["Triton kernel JIT compilation: kernel_unified_attention"]}
    assert summary["patched"]["jit"] == {"monitor_on": False, "events": []}


def test_cases_that_profile_memory_run_alone_after_the_shared_wave():
    module = load_script()
    fixed = [case(module, name=f"f{i}") for i in range(3)]
    profiling = [case(module, name=f"p{i}", release="0.34.0", extensible=True) for i in range(2)]
    off = case(module, name="off", release="0.34.0", extensible=False)
    waves = module.schedule_cases([profiling[0], *fixed, profiling[1], off], parallel=8)
    assert [([c.name for c in wave], workers) for wave, workers in waves] == [
        (["f0", "f1", "f2", "off"], 4), (["p0"], 1), (["p1"], 1)]
    assert module.schedule_cases(fixed, parallel=2) == [(fixed, 2)]


# ---------------------------------------------------------------- issue 50: vLLM's defaults, breakable graphs

def kimi_report(backends, captured=None):
    """A passing Kimi K3 report whose patched ledger names each routed layer's prefill backend."""
    ledger = {"facts": {"kimi_prefill": {f"model.layers.{i}.self_attn": {"plan_kind": "fused", "prefill_backend": b}
                                         for i, b in enumerate(backends)}}}
    totals = {"kimi_prefill": {"calls_routed": 9, "calls_seen": 9, "rebinds": 3}}
    if captured is not None:
        totals["kimi_prefill:capture"] = captured
    return {"verdict": "equal", "patched_counter_totals": totals, "runs": {"patched": {"ledgers": [ledger]}}}


def test_a_case_at_the_defaults_passes_only_on_the_backend_vllm_picks_there():
    module = load_script()
    at_defaults = case(module, model="kimi_k3", eager=False, release="0.34.0", extensible=True, at_defaults=True)
    passed, why = module.judge_case(at_defaults, kimi_report(["flashkda"] * 3), passing_outputs(module))
    assert passed and "prefilled with flashkda" in why
    passed, why = module.judge_case(at_defaults, kimi_report(["flashkda", "triton", "flashkda"]),
                                    passing_outputs(module))
    assert not passed and "triton" in why
    forced = case(module, model="kimi_k3", eager=False, release="0.34.0", extensible=True)
    assert module.judge_case(forced, kimi_report(["triton"] * 3), passing_outputs(module))[0]  # no such claim


def aside_report(facts, seen=0, upstream=12):
    """A Qwen3-Next report whose patched ledger holds the given layer facts and counters."""
    ledger = {"facts": {"gdn_state_copy": {f"model.layers.{i}.linear_attn": fact for i, fact in enumerate(facts)}}}
    totals = {"gdn_state_copy": {"calls_seen": seen, "calls_routed": seen, "calls_upstream": upstream}}
    return {"verdict": "equal", "patched_counter_totals": totals, "runs": {"patched": {"ledgers": [ledger]}}}


def test_a_case_at_the_defaults_standing_aside_on_its_backend_passes_only_with_every_layer_left_to_upstream():
    module = load_script()
    qwen = {c.name: c for c in module.CASES}["qwen3_next-v2-prefix-defaults-034"]
    assert qwen.aside_on_backend == "flashinfer"
    aside = {"decision": "stands-aside", "backend": "flashinfer", "reason": "one call, two owners"}
    outputs = dict(passing_outputs(module), baseline={"jit": {"monitor_on": True, "events": []}})
    outputs["patched"]["jit"] = {"monitor_on": True, "events": []}
    passed, why = module.judge_case(qwen, aside_report([aside] * 3), outputs)
    assert passed and "left 12 calls to upstream" in why and "3 layer facts stand aside on flashinfer" in why
    for report in (aside_report([aside] * 3, seen=2),  # a call the seam saw
                   aside_report([aside] * 3, upstream=0),  # no call reached the layers at all
                   aside_report([aside, dict(aside, backend="triton")]),  # a layer on another backend
                   aside_report([aside, dict(aside, reason="")]),  # standing aside without a reason
                   aside_report([aside, {"plan_kind": "fused", "prefill_backend": "flashinfer"}]),  # a planned layer
                   aside_report([])):  # nothing recorded
        assert not module.judge_case(qwen, report, outputs)[0], report
    # the same run fails the forced-Triton case, which must route
    assert not module.judge_case({c.name: c for c in module.CASES}["qwen3_next-v2-prefix-eager-034"],
                                 aside_report([aside] * 3), outputs)[0]


def test_capture_time_calls_must_all_be_routed_and_are_named():
    module = load_script()
    graphs = case(module, model="kimi_k3", eager=False, release="0.34.0", extensible=True)
    passed, why = module.judge_case(graphs, kimi_report(["triton"] * 3, {"calls_seen": 6, "calls_routed": 6}),
                                    passing_outputs(module))
    assert passed and "at graph capture routed 6 == seen 6" in why
    passed, why = module.judge_case(graphs, kimi_report(["triton"] * 3, {"calls_seen": 6, "calls_routed": 5,
                                                                         "calls_bypassed": 1}),
                                    passing_outputs(module))
    assert not passed and "graph capture routed 5 of 6" in why


def test_a_case_at_the_defaults_sets_no_backend_and_its_line_says_so(tmp_path):
    """Every argument a case sets that differs from vLLM's default is listed with why; only path arguments
    (backends, eager, cache modes) label the ENGINE line non-default."""
    module = load_script()
    names = {c.name: c for c in module.CASES}
    at_defaults, forced = names["kimi_k3-v2-prefix-defaults-034"], names["kimi_k3-v2-prefix-graphs-034"]
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    for current, paths in ((at_defaults, set()), (forced, {"attention_backend", "additional_config"}),
                           (names["kimi_k3-v2-prefix-eager-034"], {"attention_backend", "additional_config",
                                                                    "enforce_eager"})):
        params = module.engine_params(current, tmp_path, tmp_path / "prompts.jsonl")
        overrides = module.case_overrides(current, params, env)
        assert {item["name"] for item in overrides if item["kind"] == "path"} == paths, current.name
        assert all(item["why"] for item in overrides)
        assert "VLLM_USE_FLASHINFER_SAMPLER" in {item["name"] for item in overrides}
        record = {"case": {"name": current.name}, "report": {}, "outputs": {}, "passed": True, "why": "x",
                  "overrides": overrides}
        line = module.engine_line(record)
        assert ("[vLLM's defaults]" in line) == (not paths) and all(f"{name}=" in line for name in paths)
    needs = {case.name: " ".join(module.not_carried(case.model, case.at_defaults, tmp_path))
             for case in (at_defaults, forced)}
    assert module.FLASHKDA_LIBRARY in needs[at_defaults.name] and module.FLASHKDA_LIBRARY not in needs[forced.name]


def test_a_no_copy_case_passes_only_when_every_routed_call_was_indexed():
    module = load_script()
    indexed = case(module, state_io="indexed")
    totals = {"calls_routed": 6, "calls_seen": 6}
    short = {"verdict": "equal", "patched_counter_totals": {"gdn_state_copy": {**totals, "calls_indexed": 5}}}
    full = {"verdict": "equal", "patched_counter_totals": {"gdn_state_copy": {**totals, "calls_indexed": 6}}}
    assert not module.judge_case(indexed, short, passing_outputs(module))[0]
    passed, why = module.judge_case(indexed, full, passing_outputs(module))
    assert passed and "indexed 6 == routed" in why
    assert module.judge_case(case(module), short, passing_outputs(module))[0]  # a copy case does not ask


def test_a_wide_case_at_the_default_passes_only_when_the_twin_and_the_plan_both_ran():
    module = load_script()
    wide = case(module, wide=True)
    totals = {"calls_routed": 6, "calls_seen": 6}
    for indexed, passes in ((0, False), (2, True), (6, False)):  # none / the wide step only / every call
        report = {"verdict": "equal", "patched_counter_totals": {"gdn_state_copy": {**totals,
                                                                                   "calls_indexed": indexed}}}
        passed, why = module.judge_case(wide, report, passing_outputs(module))
        assert passed is passes, (indexed, why)
    assert "indexed 2 of 6 routed" in module.judge_case(wide, {"verdict": "equal", "patched_counter_totals": {
        "gdn_state_copy": {**totals, "calls_indexed": 2}}}, passing_outputs(module))[1]


def test_the_indexed_mutant_halves_the_valid_rows_the_twin_stored():
    module = load_script()
    cache = torch.randn(4, 2, 3, 3)
    before = cache.clone()
    rows = torch.tensor([2, -1, 0, 4])
    module._halve_after_indexed(lambda *args, **kwargs: "result", None, ("twin", cache, rows, None), {})
    assert torch.equal(cache[[0, 2]], before[[0, 2]] * 0.5) and torch.equal(cache[[1, 3]], before[[1, 3]])
