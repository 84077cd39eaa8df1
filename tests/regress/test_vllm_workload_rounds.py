"""The vllm workload's rounds, top-K logprobs and preemption count, and the ledger flush before shutdown (issue 26).

No engine starts here: vLLM's request outputs are plain stand-in objects with the attributes the workload reads.
"""

from __future__ import annotations

import json
import types

import pytest

from kda_patches import ledger
from kda_patches.regress import worker_ledger, workloads
from kda_patches.regress.vllm_workload import (
    WorkloadInputError,
    describe_output,
    logprob_count,
    parse_prompt_line,
    read_preemptions,
)


def test_a_line_names_its_round_and_defaults_to_the_first():
    assert parse_prompt_line(1, json.dumps({"prompt_token_ids": [1, 2]})).round == 1
    assert parse_prompt_line(2, json.dumps({"prompt_token_ids": [1, 2], "round": 3})).round == 3


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_round_that_is_not_a_positive_integer_is_refused_with_its_line(bad):
    with pytest.raises(WorkloadInputError, match="line 4: 'round' must be a positive integer"):
        parse_prompt_line(4, json.dumps({"prompt_token_ids": [1], "round": bad}))


def test_logprobs_true_asks_for_the_chosen_token_and_k_for_the_top_k():
    assert logprob_count(False) is None and logprob_count(None) is None
    assert logprob_count(True) == 0 and logprob_count(5) == 5


@pytest.mark.parametrize("bad", [0, -2, 2.5, "5"])
def test_logprobs_other_than_true_false_or_k_are_refused(bad):
    with pytest.raises(WorkloadInputError, match="logprobs"):
        logprob_count(bad)


def fake_output(tokens, entries):
    completion = types.SimpleNamespace(token_ids=tokens, logprobs=entries, finish_reason="length", text="")
    return types.SimpleNamespace(outputs=[completion], prompt_token_ids=[1, 2, 3], num_cached_tokens=2)


def logprob(value, rank):
    return types.SimpleNamespace(logprob=value, rank=rank)


def test_top_k_records_the_k_best_candidates_per_position_and_leaves_out_a_lower_chosen_token():
    item = parse_prompt_line(1, json.dumps({"prompt_token_ids": [1, 2, 3], "name": "a", "round": 2}))
    entries = [{7: logprob(-0.1, 1), 8: logprob(-2.0, 2), 9: logprob(-3.0, 3)},
               {5: logprob(-5.0, 4), 4: logprob(-0.5, 1), 3: logprob(-0.7, 2)}]  # chosen 5 ranks 4th
    record = describe_output(item, fake_output([7, 5], entries), 2)
    assert record["logprobs"] == [-0.1, -5.0]
    assert record["top_logprobs"] == [[[7, -0.1], [8, -2.0]], [[4, -0.5], [3, -0.7]]]
    assert record["round"] == 2 and record["cached_prompt_tokens"] == 2
    assert "top_logprobs" not in describe_output(item, fake_output([7, 5], entries), True)
    assert "logprobs" not in describe_output(item, fake_output([7, 5], entries), False)


def test_the_preemption_count_is_read_from_vllms_counter_or_unknown():
    metrics = [types.SimpleNamespace(name="vllm:num_preemptions", value=3.0),
               types.SimpleNamespace(name="vllm:other", value=9.0)]
    assert read_preemptions(types.SimpleNamespace(get_metrics=lambda: metrics)) == 3
    assert read_preemptions(types.SimpleNamespace(get_metrics=lambda: [])) is None

    def no_metrics():
        raise AssertionError("metrics are off")

    assert read_preemptions(types.SimpleNamespace(get_metrics=no_metrics)) is None


class FakeLLM:
    """What shutdown_engine touches: collective_rpc, then the engine core's shutdown."""

    def __init__(self, rpc_fails: bool = False) -> None:
        self.events: list[str] = []
        self.rpc_fails = rpc_fails
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(
            shutdown=lambda timeout: self.events.append("shutdown")))

    def collective_rpc(self, method):
        if self.rpc_fails:
            raise RuntimeError("engine is gone")
        self.events.append("flush")
        worker = type("Worker", (worker_ledger.LedgerWriterExtension,), {})()  # vLLM mixes the extension in
        return [getattr(worker, method)()]


def test_every_worker_writes_its_ledger_before_the_engine_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "_LEDGER", None)
    own = ledger.get_ledger()
    own.status_dir = str(tmp_path)
    own.count("gdn_state_copy", "calls_seen")  # the first count is written at once
    own.count("gdn_state_copy", "calls_seen")  # inside the flush interval: not written yet
    path = tmp_path / f"ledger-{own.pid}.json"
    assert json.loads(path.read_text())["counters"]["gdn_state_copy"]["calls_seen"] == 1
    llm = FakeLLM()
    workloads.shutdown_engine(llm)
    assert llm.events == ["flush", "shutdown"]
    assert json.loads(path.read_text())["counters"]["gdn_state_copy"]["calls_seen"] == 2


def test_a_flush_that_fails_is_printed_and_the_engine_still_stops(capsys):
    llm = FakeLLM(rpc_fails=True)
    workloads.shutdown_engine(llm)
    assert llm.events == ["shutdown"]
    assert "could not have the workers write their ledgers" in capsys.readouterr().err


def test_the_ab_names_its_worker_extension_and_refuses_another():
    args = worker_ledger.with_ledger_writer({"max_model_len": 64})
    assert args == {"max_model_len": 64, "worker_extension_cls": worker_ledger.EXTENSION}
    assert worker_ledger.with_ledger_writer(args) == args
    with pytest.raises(ValueError, match=r"worker_extension_cls='my\.Ext'"):
        worker_ledger.with_ledger_writer({"worker_extension_cls": "my.Ext"})


def test_wakes_sent_to_an_engine_core_that_outlived_its_sigterm_are_printed(monkeypatch, capsys):
    from kda_patches.regress import engine_stop

    monkeypatch.setattr(engine_stop, "stop_engine_core", lambda engine_core, timeout_s: 2)
    workloads.shutdown_engine(FakeLLM())
    assert "still running after its SIGTERM; sent it 2 wake(s)" in capsys.readouterr().err
    monkeypatch.setattr(engine_stop, "stop_engine_core", lambda engine_core, timeout_s: 0)
    workloads.shutdown_engine(FakeLLM())
    assert "wake" not in capsys.readouterr().err
