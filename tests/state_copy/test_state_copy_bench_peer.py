"""``kda-patches bench peer``: the fork's released GDN kernels beside the plans, and its summary rules.

On the CPU the fork's gather does not run under the interpreter (a scalar load mask); the peer is then
reported as not run, never silently dropped. On a GPU (``--run-gpu``) it is measured and checked bit-exact.
"""

from __future__ import annotations

import json

import pytest
import torch

from kda_patches.bench import main
from kda_patches.bench.entries import CompilerEntryCounter
from kda_patches.bench.gdn_report import PEER_LEAD, summarize_gdn
from kda_patches.bench.peer import DEFAULT_RELEASE, fork_gdn_impl, peer_unrunnable

ARGV = ["--rows", "12", "--shapes", "tiny=2,3,8", "--gap-items", "5", "--selected", "1,3", "--trials", "2",
        "--graph-calls", "3", "--cases", "bfloat16:float32", "--seed", "3"]


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
        assert label in impls and result["peers"] == [label]
        assert result["peer_jit_entries"]["_gather_ssm_states_kernel"] > 0
        assert sum(result["compiler_entries_after_seal"].values()) == 0
        assert label in result["summary"]["peers"]
    else:
        assert "mask" in reason and device.type == "cpu"
        assert label not in impls and result["peers_not_run"] == {label: reason}


def test_a_release_that_is_not_vllm_ascend_is_refused(tmp_path, capsys):
    assert main(["peer", "--output", str(tmp_path / "x.json"), "--release", "vllm==0.32.0", *ARGV]) == 2
    assert "measures vllm-ascend's kernels" in capsys.readouterr().out


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
