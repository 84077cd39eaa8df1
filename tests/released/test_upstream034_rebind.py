"""vLLM 0.34.0's extensible-KV-cache rebind, the release's own code on the CPU: plans republished, nothing compiled.

:mod:`rebind034_child` once per side with the same fresh seed, every case in that one process (issue 28: two
fresh processes for the whole file): ``baseline`` (``KDA_PATCHES=0``) and ``patched`` (``KDA_PATCHES=1``,
``KDA_PATCHES_GDN_OPS=overlay`` so that Qwen's seam is routed as Kimi K3's is), both STRICT.

Executed from the release: ``Worker.extend_kv_cache`` -> ``extend_kv_cache`` (through ``gpu_worker``'s by-name
alias) -> ``ExtensibleKVCache.commit`` / ``committed_views`` (``ExtensibleTensor`` over a host-memory stand-in of
the VMM driver) -> ``bind_kv_caches`` -> ``MambaBase.bind_kv_cache``, with ``initialize_kv_cache``'s
``ExtensibleKVCache`` / ``init_kv_cache`` / ``allocate_kv_cache`` before it, and the released Qwen and Kimi K3
layers serving prefills before (warmup, on the capacity views) and after the rebind
(:mod:`rebind034_standins` lists what is stood in). Cases (layer:recurrent-state dtype:mode): ``grow`` (warmup
committed fewer blocks than the final count), ``shrink`` (more: the release remaps the reservation), ``fixed``
(``--no-enable-extensible-kv-cache``: no rebind).

Checked: the rebound views have the release's new row count with the same pointer and strides; the overlay
republishes the very plans published at ``initialize_kv_cache`` with zero ``compile_variant`` calls after startup
(the counter counts at startup), the ledger fact ``rebind`` has old/new rows and the same pointers; every output
and every byte of the layers' regions equal the baseline's, warmup and after the rebind; poisoned page gaps and
dropped rows untouched; upstream's state kernels never launched on the patched side; ``kv_cache_layout``'s
read-only verifier proved each real rebind's views (ledger fact ``upstream_layout``) and changed nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import released_ab
import torch
from batch_plan import PREFILL_CALLS
from rebind034_child import CAPACITY, FINAL_BLOCKS, WARMUP_BLOCKS
from upstream034_standins import GATHER_MODULE, SCATTER_MODULE, SECTION

RELEASE = "0.34.0"
CASES = ("qwen:bfloat16:grow", "k3:float32:shrink", "qwen:float32:fixed", "k3:bfloat16:fixed")
EXTENSIBLE = tuple(case for case in CASES if not case.endswith(":fixed"))
GATHER, SCATTER = "_gather_initial_states_kernel", "_scatter_states_kernel"
ALIAS = "vllm.v1.worker.gpu_worker.extend_kv_cache"
EXTEND_KEY = "vllm.v1.worker.extensible_kv_cache:extend_kv_cache"
CHILD_TIMEOUT_S = 900
SIDES = {"baseline": released_ab.child_env(False, {"KDA_PATCHES_GDN_OPS": "overlay"}),
         "patched": released_ab.child_env(True, {"KDA_PATCHES_GDN_OPS": "overlay"})}


@pytest.fixture(scope="module")
def runs() -> tuple[int, str, dict[str, dict]]:
    """Both sides over every case: ``(seed, release root, side -> saved dict)``; the two processes run at once."""
    from kda_patches.releases.fetch import release_dir

    root = str(release_dir("vllm", RELEASE))
    seed = released_ab.fresh_seed()
    here = os.path.dirname(os.path.abspath(__file__))
    saved = {}
    with tempfile.TemporaryDirectory(prefix="kda-rebind034-") as folder:
        procs = {side: subprocess.Popen([sys.executable, os.path.join(here, "rebind034_child.py"), root, str(seed),
                                         *CASES, os.path.join(folder, f"{side}.pt")], env=env, cwd=here,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for side, env in SIDES.items()}
        for side, proc in procs.items():
            try:
                log = proc.communicate(timeout=CHILD_TIMEOUT_S)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                log = proc.communicate()[0] + "\n(killed)"
            path = os.path.join(folder, f"{side}.pt")
            assert proc.returncode == 0 and os.path.isfile(path), f"seed {seed}: {side} exited {proc.returncode}:\n" \
                                                                  f"{log[-6000:]}"
            saved[side] = torch.load(path, weights_only=False)
    return seed, root, saved


def context_of(runs: tuple, case: str, side: str) -> str:
    """Record the executed rebind path with its stand-ins (and the driver calls) and return the failure context."""
    seed, _, saved = runs
    run = saved[side]
    standins = dict(run["standins"])
    for name, result in run["cases"].items():
        if result["driver"]:
            standins[f"VMM driver calls ({side}, {name})"] = ", ".join(call[0] for call in result["driver"])
    title = (f"vLLM {RELEASE} extend_kv_cache rebind (Worker.extend_kv_cache -> extend_kv_cache -> bind_kv_caches "
             f"-> MambaBase.bind_kv_cache) under the released Qwen / Kimi K3 layers [{side}]")
    return released_ab.note_run(title, {"standins": standins, "bound": run["bound"]}) + \
        f"\nseed {seed}, case {case}, side {side}"


@pytest.mark.parametrize("side", SIDES)
def test_the_releases_rebind_code_ran_and_rebound_the_views(runs: tuple, side: str) -> None:
    _, root, saved = runs
    run = saved[side]
    context = context_of(runs, "-", side)
    wrapped = run["wrapped"]
    release_file = os.path.join(root, "vllm", "v1", "worker")
    assert wrapped["worker_method_file"] == os.path.join(release_file, "gpu_worker.py"), context + f"\n{wrapped}"
    assert wrapped["extend_file"] == os.path.join(release_file, "extensible_kv_cache.py"), context + f"\n{wrapped}"
    assert wrapped["alias_is_module_attribute"], context + f"\n{wrapped}"  # gpu_worker calls what the module holds
    assert wrapped["extensible"] == ("FunctionWrapper" if side == "patched" else "function"), context + f"\n{wrapped}"
    for name, path in run["files"].items():  # the function on the rebind path came from the release's file
        assert path.startswith(root), context + f"\n{name}: {path}"
    for case in CASES:
        result = run["cases"][case]
        assert result["layer_file"].startswith(root) and result["bind_kv_cache"].startswith(root), \
            context + f"\n{case}: {result['layer_file']} {result['bind_kv_cache']}"
        before = result["views"]["before"]
        if case.endswith(":fixed"):
            assert all(view["rows"] == FINAL_BLOCKS for slot in before.values() for view in slot.values()), \
                context + f"\n{case}: {before}"
            continue
        after = result["views"]["after"]
        for slot in (0, 1):  # conv and recurrent state: capacity rows, then the final rows at the same place
            for name, view in before[slot].items():
                assert view["rows"] == CAPACITY and after[slot][name]["rows"] == FINAL_BLOCKS, context + f"\n{case}"
                assert {**view, "rows": FINAL_BLOCKS} == after[slot][name], context + f"\n{case} {name}: {view}"
        mode = case.split(":")[2]
        assert result["committed_warmup"] == WARMUP_BLOCKS[mode], context + f"\n{case}: {result['committed_warmup']}"
        assert result["committed"] == result["runner_num_blocks"] == result["worker_num_gpu_blocks"] == FINAL_BLOCKS, \
            context + f"\n{case}"
        names = [call[0] for call in result["driver"]]
        remapped = "unmap" in names[names.index("map"):]  # a shrinking commit unmaps after the warmup's maps
        assert remapped == (mode == "shrink") and names.count("reserve") == 1, context + f"\n{case}: {names}"


@pytest.mark.parametrize("case", EXTENSIBLE)
def test_plans_are_republished_after_the_real_rebind_without_compiling(runs: tuple, case: str) -> None:
    _, _, saved = runs
    context = context_of(runs, case, "patched")
    result = saved["patched"]["cases"][case]
    section = SECTION[case.split(":")[0]]
    compiles = result["compiles"]
    assert compiles["startup"] > 0, context + f"\n{compiles}"  # the counter sees the plans' compiles at startup
    assert compiles["warmup"] == compiles["extend"] == compiles["serve"] == 0, context + f"\n{compiles}"
    assert all(binding == {"before": True, "same": True} for binding in result["bindings"].values()), \
        context + f"\n{result['bindings']}"  # the very binding published at initialize_kv_cache, republished
    fact = result["facts"][section]
    rebind = fact["rebind"]
    assert rebind is not None, context + f"\nno ledger fact rebind in {section}: {fact}"
    assert rebind["ok"] and rebind["recompiled"] is False and "without compiling" in rebind["reason"], \
        context + f"\n{rebind}"
    names = sorted(result["bindings"])
    assert rebind["layers"] == {name: {"old_rows": CAPACITY, "new_rows": FINAL_BLOCKS, "same_data_ptr": True,
                                       "same_strides": True} for name in names}, context + f"\n{rebind}"
    assert all(fact[name]["cache_shape"][0] == FINAL_BLOCKS for name in names), context + f"\n{fact}"
    seen = result["counters"][section]
    assert seen["rebinds"] == len(names), context + f"\n{seen}"
    assert seen["calls_seen"] == seen["calls_routed"] == 2 * PREFILL_CALLS, context + f"\n{seen}"  # warmup + serve
    assert not seen.get("calls_refused") and not seen.get("calls_bypassed"), context + f"\n{seen}"
    assert not any(result["launches"].values()), context + f"\nupstream's kernels ran: {result['launches']}"
    aliases = saved["patched"]["ledger"]["facts"]["aliases"]
    for patch in ("gdn_state_copy", "kimi_prefill"):
        assert ALIAS in aliases[f"{patch} {EXTEND_KEY}"], context + f"\n{aliases}"


def test_kv_cache_layout_verifies_every_real_rebind_and_changes_nothing(runs: tuple) -> None:
    """The verifier (kv_cache_layout on 0.34) ran after each extensible case's real rebind, through gpu_worker's
    alias, proved the rebound views and changed nothing (the byte-equality test below covers the outputs)."""
    _, _, saved = runs
    ledger = saved["patched"]["ledger"]
    context = context_of(runs, "-", "patched")
    assert ledger["counters"]["kv_cache_layout"]["rebinds_verified"] == len(EXTENSIBLE), context + f"\n{ledger}"
    assert not ledger["counters"]["kv_cache_layout"].get("refusals"), context
    fact = ledger["facts"]["kv_cache_layout"]["upstream_layout"]
    assert fact["status"] == "upstream layout proven" and fact["verdict"] == "proven", context + f"\n{fact}"
    assert f"block ids 0-{FINAL_BLOCKS - 1}" in fact["checked"], context + f"\n{fact}"
    assert ALIAS in ledger["facts"]["aliases"][f"kv_cache_layout {EXTEND_KEY}"], context
    assert "kv_cache_layout" not in saved["baseline"]["ledger"].get("counters", {}), context


@pytest.mark.parametrize("case", [case for case in CASES if case.endswith(":fixed")])
def test_with_the_extensible_cache_off_nothing_is_rebound_and_the_plans_still_route(runs: tuple, case: str) -> None:
    _, _, saved = runs
    context = context_of(runs, case, "patched")
    result = saved["patched"]["cases"][case]
    section = SECTION[case.split(":")[0]]
    assert result["compiles"]["startup"] > 0 and result["compiles"]["serve"] == 0, context + f"\n{result['compiles']}"
    assert all(binding == {"before": True, "same": True} for binding in result["bindings"].values()), \
        context + f"\n{result['bindings']}"
    assert result["facts"][section]["rebind"] == result["facts_before"][section], context  # no rebind recorded
    seen = result["counters"][section]
    assert "rebinds" not in seen and seen["calls_seen"] == seen["calls_routed"] == PREFILL_CALLS, \
        context + f"\n{seen}"
    assert not any(result["launches"].values()), context + f"\nupstream's kernels ran: {result['launches']}"
    assert result["driver"] == [], context + f"\n{result['driver']}"  # nothing reserved: vLLM's own zeroed buffer


@pytest.mark.parametrize("case", CASES)
def test_patched_equals_baseline_with_poisoned_gaps_untouched(runs: tuple, case: str) -> None:
    _, _, saved = runs
    context = context_of(runs, case, "patched")
    baseline, patched = saved["baseline"]["cases"][case], saved["patched"]["cases"][case]
    for phase in ("warmup", "final"):
        if phase not in baseline:
            continue
        (outputs, snapshots), (outputs_patched, snapshots_patched) = baseline[phase], patched[phase]
        problems = released_ab.compare_runs({"outputs": outputs, "snapshots": snapshots},
                                            {"outputs": outputs_patched, "snapshots": snapshots_patched})
        assert not problems, context + f"\n{phase}:\n" + "\n".join(problems)
        assert len(outputs) == 8, context  # 4 batches x 2 layers
    for side, result in (("baseline", baseline), ("patched", patched)):
        assert result["poison"] == [] and result.get("poison_warmup", []) == [], \
            context + f"\n{side}: {result['poison']} {result.get('poison_warmup')}"
    assert saved["baseline"]["cases"][case]["compiles"] == {key: 0 for key in baseline["compiles"]}, context
    assert not any(section in baseline["counters"] for section in ("gdn_state_copy", "kimi_prefill")), \
        context + f"\n{baseline['counters']}"
    kind = case.split(":")[0]
    expected = {GATHER: 1, SCATTER: 1 if kind == "qwen" else 0}  # K3 scatters by index_put upstream
    launched = {name: bool(count) for name, count in baseline["launches"].items()}
    assert launched == {name: bool(count) for name, count in expected.items()}, \
        context + f"\nbaseline launches {baseline['launches']} ({GATHER_MODULE}, {SCATTER_MODULE})"
