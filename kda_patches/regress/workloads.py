"""Workloads the A/B runner can run: a name registry plus any importable ``module:function``.

A workload is a callable that takes keyword parameters and returns JSON-able outputs (tensors
allowed, see :mod:`kda_patches.regress.compare`). It runs in a fresh interpreter; the runner
passes ``cache_dir`` when the callable accepts a parameter of that name.

The built-in ``vllm`` workload (:mod:`kda_patches.regress.vllm_workload`) serves any local model
with prompts from a JSON-lines file and engine arguments passed through.

The embedded default, ``tiny-qwen3-next``, serves the tiny random-weight Qwen3-Next model of
:mod:`kda_patches.regress.tiny_model` with the real CPU vLLM engine: greedy sampling over fixed
prompt token ids of varied lengths, chunked prefill with a 96-token budget (so long prompts are
prefilled in chunks, each later chunk continuing the recurrent state the earlier ones left) mixed
with decodes, and a second round whose prompt continues a first-round prompt plus its output:
with prefix caching (mamba ``align`` mode) its first 256 tokens come from the cache, so that
prefill starts from a cached recurrent state. Requests of a round reach the scheduler together
(see :func:`generate_together`), which makes the outputs reproducible across processes.
"""

from __future__ import annotations

import importlib
import os
import random
from dataclasses import dataclass
from typing import Any, Callable

DEFAULT_WORKLOAD = "tiny-qwen3-next"
PROMPT_SEED = 4242
ROUND_ONE_LENGTHS: tuple[int, ...] = (5, 17, 64, 130, 300, 33)
CONTINUED_PROMPT = 4  # index into ROUND_ONE_LENGTHS of the prompt that round two continues
CONTINUATION_LENGTH = 40
FRESH_LENGTH = 90


@dataclass(frozen=True)
class Workload:
    """A registered workload.

    Attributes:
        name: registry name (or the ``module:function`` spec itself).
        target: ``module:function`` of the callable.
        summary: one line for ``--list-workloads``.
        expect: ``patch:counter`` requirements on the patched run: some process has the patch
            ``applied`` with that counter > 0 (proves the patched path really ran).
        timeout_s: wall-clock limit of one run.
        validate: ``module:function`` called in the parent with the parameters before any run; it
            returns the (normalized) parameters or raises ``ValueError`` naming what is wrong.
        engine_key: key of the outputs that describes the vLLM engine's layout; when set, the
            patched run must have a patched ledger from every rank (:mod:`kda_patches.regress.ranks`).
        schedule: how the workload makes the engine's schedule independent of timing (stated in the
            report); empty for a workload that does not say.
    """

    name: str
    target: str
    summary: str = ""
    expect: tuple[str, ...] = ()
    timeout_s: float = 900.0
    validate: str = ""
    engine_key: str | None = None
    schedule: str = ""


TOGETHER = ("timing-independent: each round's requests are queued while the engine's scheduler is paused and "
            "released in one step (generate_together), so the batches do not depend on arrival timing")


WORKLOADS: dict[str, Workload] = {
    DEFAULT_WORKLOAD: Workload(
        name=DEFAULT_WORKLOAD,
        target="kda_patches.regress.workloads:run_tiny_qwen3_next",
        summary="tiny random-weight Qwen3-Next (GDN + full attention) on the real CPU vLLM engine, greedy, "
                "chunked prefill + prefix continuation",
        expect=("gdn_host_flags:builds_flagged",),
        engine_key="engine",
        schedule=TOGETHER,
    ),
    "vllm": Workload(
        name="vllm",
        target="kda_patches.regress.vllm_workload:run_vllm_prompts",
        summary="any local model: --param model=DIR --param prompts=FILE.jsonl (one {\"prompt_token_ids\": [...]} "
                "or {\"prompt\": \"...\"} per line, optional \"max_tokens\"), other --param are vLLM engine "
                "arguments (tensor_parallel_size, distributed_executor_backend, max_model_len, ...); greedy",
        timeout_s=3600.0,
        validate="kda_patches.regress.vllm_workload:validate_params",
        engine_key="engine",
        schedule=TOGETHER,
    ),
}


def resolve_workload(spec: str) -> Workload:
    """Return the registered workload named ``spec``, or an ad-hoc one for a ``module:function`` spec.

    Raises:
        ValueError: ``spec`` is neither a registered name nor of the form ``module:function``.
    """
    if spec in WORKLOADS:
        return WORKLOADS[spec]
    module, _, function = spec.partition(":")
    if not module or not function:
        raise ValueError(f"unknown workload {spec!r}; registered: {', '.join(sorted(WORKLOADS))}; "
                         "or pass an importable module:function")
    return Workload(name=spec, target=spec)


def load_callable(target: str) -> Callable[..., Any]:
    """Import ``module:function`` (dotted attribute paths allowed after the colon) and return it."""
    module_name, _, qualname = target.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        value = getattr(value, part)
    if not callable(value):
        raise TypeError(f"workload {target!r} is not callable")
    return value


def make_prompts(seed: int = PROMPT_SEED, vocab_size: int = 2048) -> tuple[list[list[int]], random.Random]:
    """Return the round-one prompts (token ids 2..vocab-1) and the generator, for round two."""
    generator = random.Random(seed)
    prompts = [[generator.randrange(2, vocab_size) for _ in range(length)] for length in ROUND_ONE_LENGTHS]
    return prompts, generator


def describe_request(name: str, output: Any) -> dict[str, Any]:
    """Return the compared record of one vLLM ``RequestOutput`` (tokens exact; logprobs as floats)."""
    completion = output.outputs[0]
    logprobs = []
    for token, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
        logprobs.append(float(entry[token].logprob))
    return {"name": name, "prompt_len": len(output.prompt_token_ids),
            "cached_prompt_tokens": int(output.num_cached_tokens or 0),
            "token_ids": [int(token) for token in completion.token_ids], "logprobs": logprobs}


def generate_together(llm: Any, prompts: list[list[int]], sampling: Any, tag: str) -> list[Any]:
    """Generate for ``prompts`` with all of them reaching the scheduler in the same step.

    ``LLM.generate`` sends requests to the engine-core process one by one while it is already
    stepping, so how the first batches are composed (and chunked) depends on timing, and bf16
    results with them. Here the scheduler is paused (mode ``keep``), every request is queued, and
    the resume flushes them together: the schedule, and so the outputs, are reproducible.

    Args:
        llm: a ``vllm.LLM``.
        prompts: per request, token ids or a vLLM prompt dict (``{"prompt": text}``,
            ``{"prompt_token_ids": [...]}``).
        sampling: the ``SamplingParams`` of every request, or one per request.
        tag: request-id prefix (unique per call).
    Returns:
        The finished ``RequestOutput`` per prompt, in prompt order.
    """
    engine = llm.llm_engine
    client = engine.engine_core
    per_request = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    client.call_utility("pause_scheduler", "keep", False)
    ids = [f"{tag}-{index}" for index in range(len(prompts))]
    for request_id, prompt, params in zip(ids, prompts, per_request, strict=True):
        engine.add_request(request_id, prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}, params)
    client.call_utility("resume_scheduler")
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[request_id] for request_id in ids]


def flush_engine_ledgers(llm: Any) -> list[Any]:
    """Have every worker process of ``llm`` write its ledger now, before the engine is stopped.

    The engine must have been built with :func:`~kda_patches.regress.worker_ledger.with_ledger_writer`'s
    engine arguments (see :mod:`kda_patches.regress.worker_ledger` for why). Returns the ledger paths written.
    """
    from kda_patches.regress.worker_ledger import METHOD

    return llm.collective_rpc(METHOD)


def shutdown_engine(llm: Any, timeout_s: float = 30.0) -> None:
    """Write every worker's ledger, stop vLLM's engine-core process and wait for it.

    A failure to write the ledgers is printed (the A/B then judges whatever ledgers were written), and the
    engine is stopped regardless, through :func:`~kda_patches.regress.engine_stop.stop_engine_core` (which wakes
    an engine core that missed vLLM's SIGTERM instead of waiting ``timeout_s`` for the force-kill).
    """
    import gc
    import sys

    from kda_patches.regress.engine_stop import WAKE_EVERY_S, stop_engine_core

    try:
        flush_engine_ledgers(llm)
    except Exception as error:  # a dead engine cannot answer; the original failure is the one that matters
        print(f"kda-patches regress: could not have the workers write their ledgers before shutdown: "
              f"{type(error).__name__}: {error}", file=sys.stderr)
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    wakes = stop_engine_core(engine_core, timeout_s)
    if wakes:
        print(f"kda-patches regress: vLLM's engine core was still running after its SIGTERM; sent it {wakes} "
              f"wake(s), one every {WAKE_EVERY_S:g} s (kda_patches.regress.engine_stop)", file=sys.stderr)
    del llm, engine_core
    gc.collect()


def run_tiny_qwen3_next(cache_dir: str | None = None, max_tokens: int = 12,
                        prefix_caching: bool = True) -> dict[str, Any]:
    """Serve the tiny Qwen3-Next with the CPU vLLM engine and return what it generated.

    Args:
        cache_dir: where the model is built/cached (default ``~/.cache/kda-patches``).
        max_tokens: tokens generated per request (EOS ignored, so lengths are fixed).
        prefix_caching: enable vLLM prefix caching (mamba ``align`` mode), so round two's
            continuation prefills from a cached state.
    Returns:
        ``{"model": {...}, "engine": {...}, "requests": [{name, prompt_len, cached_prompt_tokens, token_ids,
        logprobs}]}``.
    """
    from kda_patches.regress.tiny_model import TINY_QWEN3_NEXT_CONFIG, ensure_tiny_model, fingerprint_model
    from kda_patches.regress.vllm_workload import describe_engine

    model_dir = ensure_tiny_model(cache_dir)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from kda_patches.regress.worker_ledger import with_ledger_writer

    llm = LLM(model=model_dir, **with_ledger_writer(dict(
        skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=512, max_num_batched_tokens=96,
        max_num_seqs=8, enable_chunked_prefill=True, enable_prefix_caching=prefix_caching, seed=0)))
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    prompts, generator = make_prompts(vocab_size=TINY_QWEN3_NEXT_CONFIG["vocab_size"])
    vocab = TINY_QWEN3_NEXT_CONFIG["vocab_size"]
    try:
        engine = describe_engine(llm)
        first = generate_together(llm, prompts, sampling, "round1")
        requests = [describe_request(f"round1-len{len(p)}", out) for p, out in zip(prompts, first, strict=True)]
        continued = (prompts[CONTINUED_PROMPT] + list(first[CONTINUED_PROMPT].outputs[0].token_ids)
                     + [generator.randrange(2, vocab) for _ in range(CONTINUATION_LENGTH)])
        fresh = [generator.randrange(2, vocab) for _ in range(FRESH_LENGTH)]
        second = generate_together(llm, [continued, fresh], sampling, "round2")
        requests.append(describe_request(f"round2-continues-round1-len{len(prompts[CONTINUED_PROMPT])}",
                                         second[0]))
        requests.append(describe_request(f"round2-len{len(fresh)}", second[1]))
    finally:
        shutdown_engine(llm)
    return {"model": {"dir": os.path.basename(model_dir), "sha256": fingerprint_model(model_dir)},
            "engine": engine, "requests": requests}
