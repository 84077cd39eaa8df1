"""One engine run of the ``kv_cache_layout`` A/B test: greedy tokens of a fixed workload, as JSON.

Usage: ``python engine_ab_child.py MODEL_DIR OUT_JSON`` (switches come from the environment).
"""

from __future__ import annotations

import json
import os
import sys

PROMPT_LENGTHS = (5, 17, 40, 77, 130, 150)
SHARED_PREFIX = list(range(3, 67))  # 64 tokens: a prefix-cache hit for the last two prompts


def build_prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    """Return the fixed prompts (token ids below the tiny vocabulary)."""
    prompts = [[(7 * i + 13 * length) % 500 + 2 for i in range(length)] for length in lengths]
    prompts.append([*SHARED_PREFIX, 11, 12, 13])
    prompts.append([*SHARED_PREFIX, 21, 22])
    return prompts


def main(model_dir: str, out_path: str) -> None:
    """Run the workload on ``model_dir`` and write ``{"tokens": [...]}`` to ``out_path``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from kda_patches.regress.worker_ledger import with_ledger_writer
    from kda_patches.regress.workloads import generate_together, shutdown_engine

    extra = {}
    if os.environ.get("KDA_TEST_NUM_BLOCKS"):
        extra["num_gpu_blocks_override"] = int(os.environ["KDA_TEST_NUM_BLOCKS"])
    if os.environ.get("KDA_TEST_NO_PREFIX_CACHING") == "1":
        extra["enable_prefix_caching"] = False
    # every worker writes its ledger on request before the engine stops (shutdown_engine), not only at its exit,
    # which vLLM's executor may cut short with SIGTERM when a loaded machine makes the worker slow to exit
    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=512,
              max_num_batched_tokens=96, max_num_seqs=8, seed=0, **with_ledger_writer(extra))
    lengths = tuple(int(x) for x in os.environ.get("KDA_TEST_PROMPT_LENGTHS", "").split(",") if x) or PROMPT_LENGTHS
    # All requests reach the scheduler in one step: LLM.generate's one-by-one submission makes the first
    # batches (and so bf16 results) depend on timing, which would make any A/B flaky.
    outputs = generate_together(llm, build_prompts(lengths),
                                SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), "kv-ab")
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    shutdown_engine(llm)
    with open(out_path, "w") as handle:
        json.dump({"tokens": tokens}, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
