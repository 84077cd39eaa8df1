"""serve-ab across device calls: ``--resume``, ``--time-budget`` and ``--warmup`` (issue 26).

No benchmark process starts here (``serve_ab_fakes.fake_run`` stands in for ``run_bench_once``).
"""

from __future__ import annotations

import json
import os
import random

import pytest
from serve_ab_fakes import BENCH, fake_run

from kda_patches.bench import serve_ab
from kda_patches.bench.serve_ab_resume import load_unfinished, round_fits, set_aside_unfinished


def read(out: str) -> dict:
    return json.load(open(os.path.join(out, "serve_ab.json")))


def orders_of(seed: int, rounds: int) -> list[list[str]]:
    rng, orders = random.Random(seed), []
    for _ in range(rounds):
        order = ["baseline", "patched"]
        rng.shuffle(order)
        orders.append(order)
    return orders


def test_a_cut_ab_resumes_where_it_stopped_with_the_orders_of_an_uninterrupted_run(tmp_path, monkeypatch):
    seed = 3
    # the replay matters only if the orders after the cut differ from a fresh draw: make sure they do for this seed
    assert orders_of(seed, 5)[2:] != orders_of(seed, 3)
    out = str(tmp_path / "ab")
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run([], out, stop_at_round=2))
    with pytest.raises(KeyboardInterrupt):
        serve_ab.run_serve_ab(BENCH, 5, out, seed=seed)
    assert read(out)["rounds_done"] == 2
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run([], out))
    assert serve_ab.run_serve_ab(BENCH, 5, out, seed=seed, resume=True) == 0
    document = read(out)
    assert document["complete"] is True and document["rounds_done"] == 5
    assert [record["order"] for record in document["raw"]] == orders_of(seed, 5)
    assert [record["round"] for record in document["raw"]] == [0, 1, 2, 3, 4]
    cut = f"round2-{orders_of(seed, 3)[2][0]}"
    assert document["resumed"] == [{"at_round": 2, "set_aside": [f"{cut}.cut1"]}]
    assert os.path.isdir(os.path.join(out, f"{cut}.cut1")) and os.path.isdir(os.path.join(out, cut))
    assert document["metrics"]["tokens_per_second"]["ratios"] == [1.0, 1.01, 1.02, 1.03, 1.04]


def test_without_resume_a_used_directory_is_refused(tmp_path, monkeypatch):
    out = str(tmp_path / "ab")
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run([], out))
    serve_ab.run_serve_ab(BENCH, 1, out)
    with pytest.raises(ValueError, match="not empty; pass a new directory \\(or --resume\\)"):
        serve_ab.run_serve_ab(BENCH, 2, out)


@pytest.mark.parametrize("change, message", [
    ({"bench": [*BENCH, "--num-prompts", "8"]}, "ran with bench_args"),
    ({"seed": 9}, "ran with seed 0, this call with 9"),
    ({"entry": "module"}, "ran with entry 'cli', this call with 'module'"),
])
def test_resume_refuses_an_ab_with_other_arguments(tmp_path, monkeypatch, change, message):
    out = str(tmp_path / "ab")
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run([], out))
    serve_ab.run_serve_ab(BENCH, 1, out)
    arguments = {"bench": BENCH, "seed": 0, "entry": "cli", **change}
    with pytest.raises(ValueError, match=message):
        serve_ab.run_serve_ab(arguments["bench"], 3, out, seed=arguments["seed"], entry=arguments["entry"],
                              resume=True)
    assert read(out)["rounds_done"] == 1  # nothing ran


def test_resume_refuses_a_failed_ab_and_a_missing_one(tmp_path, monkeypatch):
    out = str(tmp_path / "ab")
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run([], out, fail="round0-baseline"))
    assert serve_ab.run_serve_ab(BENCH, 3, out) == 2
    with pytest.raises(ValueError, match="has a failed run \\(round 0 baseline: exited with status 1\\)"):
        load_unfinished(out, BENCH, 0, "cli")
    with pytest.raises(ValueError, match="does not exist; nothing to continue"):
        load_unfinished(str(tmp_path / "elsewhere"), BENCH, 0, "cli")


def test_set_aside_renames_only_unfinished_rounds_and_never_reuses_a_name(tmp_path):
    for name in ("round0-baseline", "round0-patched", "round1-patched", "round1-patched.cut1", "warmup-patched"):
        (tmp_path / name).mkdir()
    assert set_aside_unfinished(str(tmp_path), 1) == ["round1-patched.cut2"]
    assert sorted(os.listdir(tmp_path)) == ["round0-baseline", "round0-patched", "round1-patched.cut1",
                                            "round1-patched.cut2", "warmup-patched"]


def test_round_fits_uses_the_longest_round_so_far():
    assert round_fits(100.0, [], 50.0)  # nothing timed yet: the first round always starts
    assert round_fits(1e9, [10.0], None)  # no budget
    assert round_fits(40.0, [10.0, 20.0], 60.0)  # 40 + 20 == 60: ends in time
    assert not round_fits(40.5, [10.0, 20.0], 60.0)


def test_the_time_budget_stops_between_rounds_and_resume_finishes(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "ab")
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run([], out, wall_s=30.0))  # 60 s a round
    assert serve_ab.run_serve_ab(BENCH, 3, out, time_budget_s=59.0) == 3
    document = read(out)
    assert (document["rounds_done"], document["complete"], document["stopped_for_time"]) == (1, False, True)
    assert "stopped before round 1" in capsys.readouterr().out
    assert serve_ab.run_serve_ab(BENCH, 3, out, resume=True) == 0
    assert read(out)["rounds_done"] == 3 and read(out)["complete"] is True


def test_the_warmup_is_the_first_rounds_time_estimate(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "ab")
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run([], out, wall_s=30.0))  # warm-up: 60 s
    assert serve_ab.run_serve_ab(BENCH, 2, out, time_budget_s=59.0, warmup=True) == 3
    assert read(out)["rounds_done"] == 0 and "stopped before round 0" in capsys.readouterr().out
    assert serve_ab.run_serve_ab(BENCH, 2, out, resume=True, time_budget_s=59.0) == 3  # resumed: still the warm-up's
    assert read(out)["rounds_done"] == 0
    assert serve_ab.run_serve_ab(BENCH, 2, out, resume=True, time_budget_s=61.0) == 0  # each round ~0 s + 60 s
    assert read(out)["rounds_done"] == 2


def test_warmup_runs_each_side_once_unmeasured_and_not_again_on_resume(tmp_path, monkeypatch):
    out = str(tmp_path / "ab")
    seen: list = []
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run(seen, out, stop_at_round=1))
    with pytest.raises(KeyboardInterrupt):
        serve_ab.run_serve_ab(BENCH, 2, out, warmup=True)
    document = read(out)
    assert sorted(document["warmup"]) == ["baseline", "patched"] and document["rounds_done"] == 1
    assert seen[2]["warmup"] and seen[2]["rounds_done"] == 0  # on disk before round 0 started
    assert document["metrics"]["tokens_per_second"]["ratios"] == [1.0]  # the warm-up is in no ratio
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run([], out))
    assert serve_ab.run_serve_ab(BENCH, 2, out, resume=True, warmup=True) == 0
    assert not any(name.startswith("warmup-") and ".cut" in name for name in os.listdir(out))
    assert sorted(name for name in os.listdir(out) if name.startswith("warmup")) == ["warmup-baseline",
                                                                                     "warmup-patched"]


def test_a_failed_warmup_fails_the_ab_before_any_round(tmp_path, monkeypatch):
    out = str(tmp_path / "ab")
    monkeypatch.setattr(serve_ab, "run_bench_once", fake_run([], out, fail="warmup-patched"))
    assert serve_ab.run_serve_ab(BENCH, 2, out, warmup=True) == 2
    document = read(out)
    assert document["rounds_done"] == 0 and document["metrics"] == {}
    assert document["problems"][0].startswith("warm-up patched: exited with status 1")
    with pytest.raises(ValueError, match="warm-up patched"):
        load_unfinished(out, BENCH, 0, "cli")


def test_resume_needs_an_out_directory(capsys):
    with pytest.raises(SystemExit):
        serve_ab.main(["--resume", "--", *BENCH])
    assert "--resume continues the A/B in --out DIR" in capsys.readouterr().err
