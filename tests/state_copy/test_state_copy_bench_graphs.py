"""Graph replay captures every call several times (``--graph-instances``): the schedule, the block-major samples,
a capture that fails, and the refusal of a split that does not divide the trials.

CUDA graphs cannot be captured on this machine's CPU, so the capture and the replay timing are the only stand-ins
(:func:`~kda_patches.bench.timing.capture_graph` and :func:`~kda_patches.bench.timing.time_graph`); the GPU suite
runs the real ones (``test_state_copy_bench.py``).
"""

from __future__ import annotations

import random

import pytest
import torch

from kda_patches.bench import main, stats, timing

CPU = torch.device("cpu")


def test_each_block_captures_every_call_anew_in_its_own_order_and_the_rounds_add_up_to_the_trials():
    keys = [f"impl{number}" for number in range(8)]
    blocks = timing.graph_schedule(keys, trials=12, instances=3, shuffler=random.Random(5))
    assert len(blocks) == 3
    assert all(sorted(capture) == sorted(keys) for capture, _ in blocks)
    assert [len(rounds) for _, rounds in blocks] == [4, 4, 4]
    assert all(sorted(order) == sorted(keys) for _, rounds in blocks for order in rounds)
    assert len({tuple(capture) for capture, _ in blocks}) > 1  # the captures are not in one fixed order


@pytest.mark.parametrize("trials, instances", [(30, 4), (6, 0), (5, 10)])
def test_a_split_that_does_not_divide_the_trials_is_refused_naming_both(trials, instances):
    with pytest.raises(ValueError, match=f"graph instances {instances} .*trials \\({trials}\\)"):
        timing.graph_schedule(["a"], trials, instances, random.Random(0))


def test_one_instance_per_call_is_todays_single_capture():
    blocks = timing.graph_schedule(["a", "b"], trials=3, instances=1, shuffler=random.Random(0))
    assert len(blocks) == 1 and len(blocks[0][1]) == 3


class StandInGraph:
    """What :func:`timing.capture_graph` returns here: which call, which capture."""

    def __init__(self, key: str, capture: int) -> None:
        self.key, self.capture = key, capture


def stand_in_device(monkeypatch, refuse: dict[str, int]) -> dict[str, int]:
    """Replace the capture and the replay timing; ``refuse[key] = n`` fails the n-th capture of ``key`` (0-based).
    Returns the captures counted per key."""
    captures: dict[str, int] = {}

    def capture_graph(call, calls, device):
        key = call(None)
        number = captures.get(key, 0)
        captures[key] = number + 1
        if refuse.get(key) == number:
            raise RuntimeError("operation not permitted when stream is capturing")
        return StandInGraph(key, number)

    monkeypatch.setattr(timing, "capture_graph", capture_graph)
    monkeypatch.setattr(timing, "time_graph", lambda graph, calls, device: float(graph.capture))
    return captures


def test_samples_come_block_after_block_each_from_that_blocks_own_capture(monkeypatch):
    captures = stand_in_device(monkeypatch, refuse={})
    calls = {key: (lambda step, key=key: key) for key in ("up", "plan", "twin")}
    samples = timing.replay_graphs(calls, graph_calls=5, trials=6, device=CPU, shuffler=random.Random(1),
                                   instances=3)
    assert captures == {"up": 3, "plan": 3, "twin": 3}
    assert samples == {key: [0.0, 0.0, 1.0, 1.0, 2.0, 2.0] for key in calls}
    assert list(samples) == list(calls)  # the calls' order, whatever order the captures and rounds took


def test_capture_medians_read_the_samples_back_one_capture_at_a_time(monkeypatch):
    stand_in_device(monkeypatch, refuse={})
    samples = timing.replay_graphs({"plan": lambda step: step}, graph_calls=5, trials=6, device=CPU,
                                   shuffler=random.Random(3), instances=3)["plan"]
    assert stats.capture_medians(samples, 3) == [0.0, 1.0, 2.0]  # the block's own capture, not the whole median
    assert stats.capture_medians([1.0, 3.0, 8.0, 9.0], 1) == [5.5]
    with pytest.raises(ValueError, match="must be at least 1 and divide the trials"):
        stats.capture_medians(samples, 4)  # 6 samples do not come from 4 equal captures


def test_a_call_whose_capture_fails_in_any_block_is_left_out_entirely(monkeypatch, capsys):
    stand_in_device(monkeypatch, refuse={"syncs": 1})
    calls = {key: (lambda step, key=key: key) for key in ("plan", "syncs")}
    samples = timing.replay_graphs(calls, graph_calls=5, trials=4, device=CPU, shuffler=random.Random(2),
                                   instances=2)
    assert set(samples) == {"plan"} and samples["plan"] == [0.0, 0.0, 1.0, 1.0]
    assert "syncs cannot be captured in a CUDA graph" in capsys.readouterr().out


def test_the_bench_refuses_graph_instances_that_do_not_divide_its_trials_before_measuring(tmp_path, capsys):
    output = tmp_path / "gdn.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["gdn-state-copy", "--output", str(output), "--device", "cpu", "--trials", "3",
              "--graph-instances", "2"])
    assert exit_info.value.code == 2 and not output.exists()
    assert "--graph-instances / --trials: graph instances 2" in capsys.readouterr().err
