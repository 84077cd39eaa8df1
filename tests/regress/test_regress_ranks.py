"""Per-rank ledger check: the processes an engine layout implies, found patched or reported missing."""

from __future__ import annotations

from kda_patches.regress.compare import compare_outputs
from kda_patches.regress.ranks import check_ranks
from kda_patches.regress.runner import ABReport, RunResult


def summary(pid: int, role: str, state: str = "applied", enabled: bool = True, argv: tuple = ("x",),
            counters: dict | None = None) -> dict:
    return {"pid": pid, "role": role, "argv": list(argv), "enabled": enabled, "final": True,
            "patches": {"gdn_host_flags": {"state": state, "reason": "why", "applied_targets": []},
                        "kimi_prefill": {"state": "pending", "reason": "waiting", "applied_targets": []}},
            "counters": counters or {}}


MP2 = {"executor": "mp", "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "world_size": 2,
       "multiprocessing": True}


def test_every_mp_rank_and_the_engine_core_patched() -> None:
    ledgers = [summary(1, "main"), summary(2, "EngineCore", state="pending"),
               summary(3, "VllmWorker-0", counters={"gdn_host_flags": {"builds_seen": 4}}), summary(4, "VllmWorker-1")]
    checks = check_ranks(MP2, ledgers)
    assert [(c.label, c.role, c.met) for c in checks] == [
        ("engine core", "EngineCore", True), ("rank 0", "VllmWorker-0", True), ("rank 1", "VllmWorker-1", True)]
    assert checks[1].detail == "pid 3 applied gdn_host_flags; counters gdn_host_flags: builds_seen=4"
    assert checks[0].detail == "pid 2 applied NOTHING"


def test_missing_or_unpatched_rank_fails() -> None:
    four = dict(MP2, tensor_parallel_size=2, pipeline_parallel_size=2, world_size=4)
    ledgers = [summary(2, "EngineCore"), summary(3, "VllmWorker-0"), summary(4, "VllmWorker-1", state="pending"),
               summary(5, "VllmWorker-2", state="skipped"), summary(6, "VllmWorker-9")]
    checks = {c.label: c for c in check_ranks(four, ledgers)}
    assert [label for label, c in checks.items() if not c.met] == ["rank 1", "rank 2", "rank 3"]
    assert checks["rank 1"].detail == "pid 4 applied NOTHING"
    assert "NOT applied: gdn_host_flags skipped (why)" in checks["rank 2"].detail
    assert checks["rank 3"].detail == "no ledger from this worker process"


def test_engine_core_missing_or_with_the_overlay_off_fails() -> None:
    first = check_ranks(MP2, [summary(3, "VllmWorker-0"), summary(4, "VllmWorker-1")])[0]
    assert (first.label, first.met, first.detail) == ("engine core", False, "no ledger from an EngineCore process")
    off = check_ranks(MP2, [summary(2, "EngineCore", enabled=False), summary(3, "VllmWorker-0"),
                            summary(4, "VllmWorker-1")])
    assert not off[0].met and "overlay NOT enabled" in off[0].detail


def test_ray_actors_are_counted_and_uni_runs_in_the_engine_core() -> None:
    ray = dict(MP2, executor="ray")
    actor = ("/venv/bin/python", "/venv/ray/_private/workers/default_worker.py", "--node-ip-address=127.0.0.1")
    checks = check_ranks(ray, [summary(2, "EngineCore"), summary(7, "main", argv=actor)])
    assert [(c.label, c.met) for c in checks] == [("engine core", True), ("Ray actor 1 of 2", True),
                                                  ("Ray actor 2 of 2", False)]
    assert checks[2].detail == "only 1 Ray actor ledger(s) for world size 2"
    uni = dict(MP2, executor="uni", tensor_parallel_size=1, world_size=1)
    assert [(c.label, c.met) for c in check_ranks(uni, [summary(2, "EngineCore")])] == [
        ("engine core", True), ("rank 0 (in the engine core)", True)]
    inline = dict(uni, multiprocessing=False)
    assert [(c.label, c.met) for c in check_ranks(inline, [summary(1, "main", state="pending")])] == [
        ("rank 0 (in main)", False)]


def test_an_unpatched_rank_fails_the_ab_even_with_equal_outputs() -> None:
    report = ABReport(workload="w", target="m:f", params={}, rtol=0.0, atol=0.0,
                      baseline=RunResult(label="baseline"), patched=RunResult(label="patched"))
    report.comparison = compare_outputs([1, 2], [1, 2])
    report.ranks = check_ranks(MP2, [summary(2, "EngineCore"), summary(3, "VllmWorker-0")])
    assert report.verdict == "equal" and report.exit_code == 1
    report.ranks = check_ranks(MP2, [summary(2, "EngineCore"), summary(3, "VllmWorker-0"), summary(4, "VllmWorker-1")])
    assert report.exit_code == 0
