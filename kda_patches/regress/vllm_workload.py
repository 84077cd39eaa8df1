"""The built-in ``vllm`` workload: any model directory, prompts from a JSON-lines file, engine args passed through.

``kda-patches regress --workload vllm --param model=DIR --param prompts=FILE.jsonl
[--param tensor_parallel_size=2 --param distributed_executor_backend=ray --param max_model_len=4096 ...]``

Prompts file: one JSON object per line (blank lines are skipped), each with exactly one of
``"prompt_token_ids": [int, ...]`` or ``"prompt": "text"`` (text needs the model's tokenizer),
and optionally ``"max_tokens": int`` (default: the ``max_tokens`` parameter), ``"name": str`` and
``"round": int`` (default 1). Sampling is greedy; rounds run one after another, and every request of a
round reaches the scheduler in the same step (:func:`~kda_patches.regress.workloads.generate_together`),
so the outputs are reproducible across processes and are compared token by token. A later round can
reuse what an earlier one cached (prefix caching): each record states its ``cached_prompt_tokens``.

``logprobs``: ``true`` compares the chosen token's logprob per position; an integer ``K`` also compares the
top-``K`` candidates (token id and logprob) per position. The engine's preemption count (vLLM's
``vllm:num_preemptions`` metric; needs ``disable_log_stats=false``) is part of the outputs when available.

Parameters other than ``model``, ``prompts``, ``max_tokens``, ``ignore_eos`` and ``logprobs``
are ``vllm.LLM`` engine arguments; :func:`validate_params` checks them against the installed
vLLM's own ``EngineArgs`` fields (close matches suggested), checks the model directory and
every prompts line, all in the parent before any engine starts.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

WORKLOAD_PARAMS = ("model", "prompts", "max_tokens", "ignore_eos", "logprobs")
DEFAULT_MAX_TOKENS = 16
PROMPT_KEYS = ("prompt_token_ids", "prompt", "max_tokens", "name", "round")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class WorkloadInputError(ValueError):
    """A workload parameter is wrong; raised in the parent before any engine starts."""


@dataclass(frozen=True)
class PromptLine:
    """One request of the prompts file.

    Attributes:
        line: 1-based line number in the file.
        prompt: ``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}`` (vLLM's prompt dicts).
        max_tokens: tokens to generate, or None for the workload default.
        name: the line's name (default ``line<N>``).
        round: the round it is sent in (1 first); rounds run one after another.
    """

    line: int
    prompt: dict[str, Any]
    max_tokens: int | None
    name: str
    round: int = 1


def parse_prompt_line(number: int, text: str) -> PromptLine:
    """Parse one line of a prompts file.

    Raises:
        WorkloadInputError: naming the line and what is wrong with it.
    """
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise WorkloadInputError(f"line {number}: not JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise WorkloadInputError(f"line {number}: expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(PROMPT_KEYS))
    if unknown:
        raise WorkloadInputError(f"line {number}: unknown key(s) {', '.join(map(repr, unknown))}; "
                                 f"allowed: {', '.join(PROMPT_KEYS)}")
    has_ids, has_text = "prompt_token_ids" in record, "prompt" in record
    if has_ids == has_text:
        raise WorkloadInputError(f"line {number}: needs exactly one of 'prompt_token_ids' or 'prompt'")
    if has_ids:
        ids = record["prompt_token_ids"]
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise WorkloadInputError(f"line {number}: 'prompt_token_ids' must be a non-empty list of "
                                     "non-negative integers")
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
    else:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise WorkloadInputError(f"line {number}: 'prompt' must be a non-empty string")
        prompt = {"prompt": record["prompt"]}
    max_tokens = record.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise WorkloadInputError(f"line {number}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    name = record.get("name", f"line{number}")
    if not isinstance(name, str):
        raise WorkloadInputError(f"line {number}: 'name' must be a string")
    round_number = record.get("round", 1)
    if not isinstance(round_number, int) or isinstance(round_number, bool) or round_number < 1:
        raise WorkloadInputError(f"line {number}: 'round' must be a positive integer, got {round_number!r}")
    return PromptLine(line=number, prompt=prompt, max_tokens=max_tokens, name=name, round=round_number)


def read_prompts(path: str) -> list[PromptLine]:
    """Read a JSON-lines prompts file.

    Raises:
        WorkloadInputError: the file is missing, empty, or a line is not a valid prompt object
            (the message names the file and the line number).
    """
    if not os.path.isfile(path):
        raise WorkloadInputError(f"prompts file {path!r} does not exist; pass --param prompts=FILE.jsonl")
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                prompts.append(parse_prompt_line(number, text))
            except WorkloadInputError as error:
                raise WorkloadInputError(f"prompts file {path!r} {error} (one JSON object per line, e.g. "
                                         '{"prompt_token_ids": [1, 2, 3], "max_tokens": 8} or '
                                         '{"prompt": "Hello"})') from None
    if not prompts:
        raise WorkloadInputError(f"prompts file {path!r} has no prompts")
    return prompts


def engine_arg_names() -> set[str]:
    """Return the field names of the installed vLLM's ``EngineArgs`` (imports vLLM)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {field.name for field in dataclasses.fields(EngineArgs)}


def check_engine_args(engine_args: dict[str, Any], known: set[str]) -> None:
    """Refuse engine arguments that are not ``EngineArgs`` fields, suggesting close matches.

    Raises:
        WorkloadInputError: one message naming every unknown argument.
    """
    problems = []
    for name in sorted(engine_args):
        if name in known:
            continue
        close = difflib.get_close_matches(name.replace("-", "_"), sorted(known), n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        problems.append(f"{name!r}{hint}")
    if problems:
        raise WorkloadInputError("unknown vLLM engine argument(s) " + ", ".join(problems)
                                 + "; --param names must be fields of vllm.engine.arg_utils.EngineArgs "
                                 f"or one of the workload's own ({', '.join(WORKLOAD_PARAMS)})")


def has_tokenizer(model_dir: str) -> bool:
    """Return whether the model directory ships tokenizer files."""
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES)


def read_vocab_size(model_dir: str) -> int | None:
    """Return ``vocab_size`` from the model's ``config.json`` (top level or ``text_config``), if any."""
    with open(os.path.join(model_dir, "config.json")) as handle:
        config = json.load(handle)
    for section in (config, config.get("text_config") or {}):
        if isinstance(section.get("vocab_size"), int):
            return section["vocab_size"]
    return None


def validate_params(params: dict[str, Any]) -> dict[str, Any]:
    """Check the workload's parameters in the parent, before any engine starts.

    Args:
        params: ``--param`` values.
    Returns:
        The parameters with ``model`` and ``prompts`` made absolute.
    Raises:
        WorkloadInputError: the model directory is missing or has no ``config.json``, the prompts
            file is not valid JSON lines (line number named), ``logprobs`` is not true/false/K, a token id is
            outside the model's
            vocabulary, text prompts lack a tokenizer, or an engine argument is unknown.
    """
    for name in ("model", "prompts"):
        if not isinstance(params.get(name), str) or not params[name]:
            raise WorkloadInputError(f"the vllm workload needs --param {name}=" + ("DIR" if name == "model" else
                                                                                  "FILE.jsonl"))
    model = os.path.abspath(os.path.expanduser(params["model"]))
    if not os.path.isdir(model):
        raise WorkloadInputError(f"model directory {model!r} does not exist; pass --param model=DIR of a "
                                 "local model (config.json + weights)")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise WorkloadInputError(f"model directory {model!r} has no config.json")
    prompts_path = os.path.abspath(os.path.expanduser(params["prompts"]))
    prompts = read_prompts(prompts_path)
    logprob_count(params.get("logprobs"))
    engine_args = {key: value for key, value in params.items() if key not in WORKLOAD_PARAMS}
    check_engine_args(engine_args, engine_arg_names())
    from kda_patches.regress.worker_ledger import with_ledger_writer

    try:
        with_ledger_writer(engine_args)
    except ValueError as error:
        raise WorkloadInputError(str(error)) from None
    vocab = read_vocab_size(model)
    for item in prompts:
        ids = item.prompt.get("prompt_token_ids", [])
        if vocab is not None and ids and max(ids) >= vocab:
            raise WorkloadInputError(f"prompts file {prompts_path!r} line {item.line}: token id {max(ids)} is "
                                     f"outside the model's vocabulary (vocab_size {vocab} in config.json)")
    text_line = next((item.line for item in prompts if "prompt" in item.prompt), None)
    tokenizer_off = bool(engine_args.get("skip_tokenizer_init"))
    if text_line is not None and (tokenizer_off or not (has_tokenizer(model) or engine_args.get("tokenizer"))):
        why = "skip_tokenizer_init is set" if tokenizer_off else f"{model!r} has no tokenizer files"
        raise WorkloadInputError(f"prompts file {prompts_path!r} line {text_line}: a text prompt needs a "
                                 f"tokenizer, but {why}; use prompt_token_ids or pass --param tokenizer=DIR")
    return dict(params, model=model, prompts=prompts_path)


def describe_engine(llm: Any) -> dict[str, Any]:
    """Return the engine's effective parallel layout (for the per-rank ledger check)."""
    from vllm import envs

    parallel = llm.llm_engine.vllm_config.parallel_config
    backend = parallel.distributed_executor_backend
    return {"executor": backend if isinstance(backend, str) or backend is None else backend.__name__,
            "tensor_parallel_size": parallel.tensor_parallel_size,
            "pipeline_parallel_size": parallel.pipeline_parallel_size,
            "data_parallel_size": parallel.data_parallel_size,
            "world_size": parallel.world_size,
            "multiprocessing": bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)}


def logprob_count(logprobs: Any) -> int | None:
    """Return vLLM's ``SamplingParams.logprobs`` for the workload's ``logprobs`` parameter.

    ``False``/``None`` -> None (no logprobs); ``True`` -> 0 (the chosen token only); an integer ``K >= 1`` -> K.

    Raises:
        WorkloadInputError: anything else (a negative or non-integer value).
    """
    if logprobs is None or logprobs is False:
        return None
    if logprobs is True:
        return 0
    if isinstance(logprobs, int) and logprobs >= 1:
        return logprobs
    raise WorkloadInputError(f"--param logprobs must be true, false or a positive integer K (top-K), got "
                             f"{logprobs!r}")


def describe_output(item: PromptLine, output: Any, logprobs: Any) -> dict[str, Any]:
    """Return the compared record of one request: token ids exact, text and finish reason too.

    With ``logprobs`` the chosen token's logprob per position; with an integer ``K`` also ``top_logprobs``: per
    position the ``K`` best candidates as ``[token_id, logprob]``, best first (ties by token id).
    """
    completion = output.outputs[0]
    record: dict[str, Any] = {"name": item.name, "line": item.line, "round": item.round,
                              "prompt_len": len(output.prompt_token_ids),
                              "cached_prompt_tokens": int(output.num_cached_tokens or 0),
                              "token_ids": [int(token) for token in completion.token_ids],
                              "finish_reason": completion.finish_reason}
    if completion.text:
        record["text"] = completion.text
    count = logprob_count(logprobs)
    if count is not None:
        entries = list(zip(completion.token_ids, completion.logprobs or [], strict=False))
        record["logprobs"] = [float(entry[token].logprob) for token, entry in entries]
        if count:
            record["top_logprobs"] = [
                sorted(([int(candidate), float(value.logprob)] for candidate, value in entry.items()
                        if value.rank is not None and value.rank <= count), key=lambda pair: (-pair[1], pair[0]))
                for _, entry in entries]
    return record


def read_preemptions(llm: Any) -> int | None:
    """Return the engine's ``vllm:num_preemptions`` counter, or None where vLLM collects no metrics."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # metrics off (disable_log_stats) or not offered by this vLLM: reported as unknown
        return None
    values = [getattr(metric, "value", None) for metric in metrics if getattr(metric, "name", "")
              == "vllm:num_preemptions"]
    return int(sum(values)) if values and None not in values else None


def file_sha256(path: str) -> str:
    """Return the sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_vllm_prompts(model: str, prompts: str, max_tokens: int = DEFAULT_MAX_TOKENS, ignore_eos: bool = False,
                     logprobs: bool | int = False, cache_dir: str | None = None, **engine_args: Any
                     ) -> dict[str, Any]:
    """Serve ``model`` with ``vllm.LLM(**engine_args)`` and generate greedily for every line of ``prompts``.

    Args:
        model: the model directory.
        prompts: the JSON-lines prompts file.
        max_tokens: tokens per request where a line gives no ``max_tokens``.
        ignore_eos: keep generating past EOS (fixed output lengths).
        logprobs: also compare the chosen tokens' logprobs (``true``) or the top-K candidates (``K``) (floats:
            ``--rtol``/``--atol`` apply).
        cache_dir: the runner's cache dir (unused here; named so it never reaches ``vllm.LLM``).
        engine_args: passed to ``vllm.LLM`` (vLLM's own defaults otherwise); ``skip_tokenizer_init``
            defaults to True when the model has no tokenizer files (then only token-id prompts are
            accepted); the effective arguments are part of the outputs. ``worker_extension_cls`` is the A/B's
            own (:mod:`~kda_patches.regress.worker_ledger`): every worker writes its ledger before the stop.
    Returns:
        ``{"model", "prompts", "engine", "engine_args", "engine_stats", "requests": [...]}``, requests in file
        order whatever their rounds.
    """
    from kda_patches.regress.worker_ledger import with_ledger_writer
    from kda_patches.regress.workloads import generate_together, shutdown_engine

    items = read_prompts(prompts)
    engine_args = dict(engine_args)
    if not has_tokenizer(model) and "tokenizer" not in engine_args:
        engine_args.setdefault("skip_tokenizer_init", True)
    from vllm import LLM, SamplingParams

    count = logprob_count(logprobs)
    started = time.perf_counter()
    llm = LLM(model=model, **with_ledger_writer(engine_args))
    # the engine's start-up time (plans prepared included), for the log only: outputs are compared, times are not
    print(f"kda-patches regress: engine started in {time.perf_counter() - started:.1f} s", file=sys.stderr,
          flush=True)
    sampling = [SamplingParams(temperature=0.0, max_tokens=item.max_tokens or max_tokens, ignore_eos=ignore_eos,
                               logprobs=count) for item in items]
    outputs: list[Any] = [None] * len(items)
    try:
        engine = describe_engine(llm)
        for round_number in sorted({item.round for item in items}):
            chosen = [index for index, item in enumerate(items) if item.round == round_number]
            done = generate_together(llm, [items[index].prompt for index in chosen],
                                     [sampling[index] for index in chosen], f"vllm-round{round_number}")
            for index, output in zip(chosen, done, strict=True):
                outputs[index] = output
        engine_stats = {"preemptions": read_preemptions(llm)}
    finally:
        shutdown_engine(llm)
    with open(os.path.join(model, "config.json"), "rb") as handle:
        config_sha = hashlib.sha256(handle.read()).hexdigest()
    weights = {name: os.path.getsize(os.path.join(model, name)) for name in sorted(os.listdir(model))
               if name.endswith((".safetensors", ".bin", ".pt"))}
    return {"model": {"dir": model, "config_sha256": config_sha, "weight_files": weights},
            "prompts": {"file": prompts, "sha256": file_sha256(prompts), "count": len(items)},
            "engine": engine, "engine_args": engine_args, "engine_stats": engine_stats,
            "requests": [describe_output(item, output, logprobs) for item, output in zip(items, outputs, strict=True)]}
