"""The ``vllm`` workload refuses bad input with one error naming the thing, before any run starts.

No engine starts here: the checks read the model's ``config.json``, the prompts file and the
installed vLLM's ``EngineArgs`` fields. That no run started is checked on the work dir (a run
creates ``baseline/``) and on the report (both sides ``not run``).
"""

from __future__ import annotations

import json
import os

import pytest
import vllm_stack

from kda_patches.regress.cli import main
from kda_patches.regress.runner import run_ab
from kda_patches.regress.vllm_workload import engine_arg_names, read_prompts, validate_params
from kda_patches.regress.workloads import resolve_workload

vllm_stack.import_vllm("vllm")
VLLM = resolve_workload("vllm")


@pytest.fixture
def model_dir(tmp_path) -> str:
    """A directory with only a config.json (enough for the checks; no engine is started)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "vocab_size": 100}))
    return str(path)


def write_lines(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def refused(tmp_path, params: dict) -> str:
    """Run the A/B and return its single error, asserting no run started."""
    work = tmp_path / "work"
    report = run_ab(VLLM, params, work_dir=str(work))
    assert report.verdict == "error" and report.exit_code == 2
    assert report.baseline.source == report.patched.source == "not run"
    assert not (work / "baseline").exists() and not (work / "patched").exists()
    (error,) = report.errors
    return error


def test_missing_model_dir_is_named(tmp_path) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", ['{"prompt_token_ids": [1, 2]}'])
    missing = str(tmp_path / "no-such-model")
    error = refused(tmp_path, {"model": missing, "prompts": prompts})
    assert f"model directory {missing!r} does not exist" in error
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in refused(tmp_path, {"model": str(tmp_path / "empty"), "prompts": prompts})
    assert "needs --param model=DIR" in refused(tmp_path, {"prompts": prompts})


def test_prompts_file_that_is_not_json_lines_names_the_line(tmp_path, model_dir) -> None:
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt_token_ids": [1, 2]}', "", '{"prompt_token_ids": [3]}',
                                              "prompt_token_ids: [4]"])
    error = refused(tmp_path, {"model": model_dir, "prompts": path})
    assert f"prompts file {path!r} line 4: not JSON" in error
    cases = {
        '[1, 2, 3]': "line 1: expected a JSON object, got list",
        '{"prompt_token_ids": [1], "prompt": "x"}': "line 1: needs exactly one of",
        '{"max_tokens": 3}': "line 1: needs exactly one of",
        '{"prompt_token_ids": [1, -2]}': "non-negative integers",
        '{"prompt_token_ids": [1], "max_tokens": 0}': "'max_tokens' must be a positive integer",
        '{"prompt_token_ids": [1], "temperature": 1.0}': "unknown key(s) 'temperature'",
        '{"prompt_token_ids": [1, 100]}': "token id 100 is outside the model's vocabulary (vocab_size 100",
        '{"prompt": "hello"}': "a text prompt needs a tokenizer",
    }
    for line, expected in cases.items():
        path = write_lines(tmp_path / "case.jsonl", [line])
        assert expected in refused(tmp_path, {"model": model_dir, "prompts": path}), line
    empty = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    assert "has no prompts" in refused(tmp_path, {"model": model_dir, "prompts": empty})
    assert "does not exist" in refused(tmp_path, {"model": model_dir, "prompts": str(tmp_path / "none.jsonl")})


def test_unknown_engine_argument_suggests_close_matches(tmp_path, model_dir) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", ['{"prompt_token_ids": [1, 2]}'])
    error = refused(tmp_path, {"model": model_dir, "prompts": prompts, "tensor_paralel_size": 2,
                               "max_model_len": 64, "zzz_not_an_arg": 1})
    assert "'tensor_paralel_size' (did you mean tensor_parallel_size" in error
    assert "'zzz_not_an_arg'" in error and "max_model_len" not in error.split(";")[0]
    assert "vllm.engine.arg_utils.EngineArgs" in error


def test_engine_argument_names_are_the_installed_engine_args_fields() -> None:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    names = engine_arg_names()
    assert names == {field.name for field in dataclasses.fields(EngineArgs)}
    assert {"tensor_parallel_size", "distributed_executor_backend", "max_model_len", "enable_prefix_caching"} <= names


def test_valid_parameters_are_normalized_and_prompts_parsed(tmp_path, model_dir, monkeypatch) -> None:
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    write_lines(tmp_path / "p.jsonl", ['{"prompt_token_ids": [5, 6], "max_tokens": 3, "name": "ids"}', "",
                                       '{"prompt": "w5 w6"}'])
    params = validate_params({"model": "model", "prompts": "p.jsonl", "tensor_parallel_size": 2,
                              "distributed_executor_backend": "mp", "enable_prefix_caching": False})
    assert params["model"] == model_dir and params["prompts"] == str(tmp_path / "p.jsonl")
    first, second = read_prompts(params["prompts"])
    assert (first.line, first.prompt, first.max_tokens, first.name) == (1, {"prompt_token_ids": [5, 6]}, 3, "ids")
    assert (second.line, second.prompt, second.max_tokens, second.name) == (3, {"prompt": "w5 w6"}, None, "line3")


def test_cli_prints_the_one_error_and_exits_2(tmp_path, capsys) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", ['{"prompt_token_ids": [1]}'])
    missing = str(tmp_path / "nowhere")
    assert main(["--workload", "vllm", "--param", f"model={missing}", "--param", f"prompts={prompts}"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"kda-patches regress: error: workload 'vllm': model directory {missing!r} does "
                                    "not exist; pass --param model=DIR of a local model (config.json + weights)")
    assert "RESULT" not in captured.out
    assert main(["--list-workloads"]) == 0
    assert "vllm  kda_patches.regress.vllm_workload:run_vllm_prompts" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "nowhere")


def test_tiny_model_dir_has_a_tokenizer_that_round_trips_ids(tmp_path, capsys) -> None:
    assert main(["--tiny-model-dir", "--cache-dir", str(tmp_path / "cache")]) == 0
    model = capsys.readouterr().out.strip().splitlines()[-1]
    assert model.startswith(str(tmp_path / "cache" / "models" / "tiny-qwen3-next-"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    with open(os.path.join(model, "config.json")) as handle:
        vocab = json.load(handle)["vocab_size"]
    assert tokenizer.vocab_size == vocab >= 10000  # `vllm bench latency` draws prompt ids below 10000
    ids = [2, 17, 9999, vocab - 1, 5, 5]
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids  # what vllm bench's dataset does
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert validate_params({"model": model, "prompts": write_lines(tmp_path / "p.jsonl", ['{"prompt": "w5 w6"}'])})
