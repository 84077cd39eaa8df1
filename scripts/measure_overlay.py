"""Measure the overlay's own costs (DESIGN §6): import time and the gdn_host_flags wrapper per call.

Usage: python scripts/measure_overlay.py [--runs 20] [--calls 2000] [--output FILE.json]
Import time: median wall time of ``python -c "import kda_patches"`` minus ``python -c pass`` over fresh
interpreters. Wrapper cost: median per-call time of the real vLLM 0.32 GDN builder's ``build`` through the
wrapper vs its ``__wrapped__`` original, for a decode-only batch (pure wrapper overhead) and a prefill batch
(wrapper + host-flag computation), interleaved in rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def measure_import(runs: int) -> dict:
    # Measured as installed packages run: with bytecode caches (a sandbox may set PYTHONDONTWRITEBYTECODE,
    # which would make every start compile kda_patches from source).
    import compileall

    compileall.compile_dir(os.path.join(os.path.dirname(__file__), "..", "kda_patches"), quiet=1)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KDA_PATCHES") and k != "PYTHONDONTWRITEBYTECODE"}

    def median_wall(code: str) -> float:
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], env=env, check=True)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e3

    bare, overlay = median_wall("pass"), median_wall("import kda_patches")
    return {"bare_python_ms": bare, "import_kda_patches_ms": overlay, "delta_ms": overlay - bare, "runs": runs}


def measure_wrapper(calls: int) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "patches"))
    import torch
    from test_gdn_host_flags import make_batch
    from transformers import Qwen3NextConfig
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.attention.backends import gdn_attn
    from vllm.v1.kv_cache_interface import MambaSpec

    from kda_patches import registry
    from kda_patches.patches import gdn_host_flags

    model_dir = tempfile.mkdtemp()
    Qwen3NextConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                    linear_value_head_dim=64, intermediate_size=512, moe_intermediate_size=128, num_experts=4,
                    num_experts_per_tok=2, vocab_size=1024, full_attention_interval=2).save_pretrained(model_dir)
    config = VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                                                 max_model_len=512))
    spec = MambaSpec(block_size=16, shapes=((3, 256), (4, 64, 64)), dtypes=(torch.bfloat16, torch.float32))
    registry.register_patch(gdn_host_flags.PATCH)
    registry.apply_target(gdn_host_flags.PATCH, gdn_host_flags.PATCH.targets[0], gdn_attn)
    builder = gdn_attn.GDNAttentionMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))
    original = type(builder).build.__wrapped__
    results = {}
    for name, batch in (("decode_only_8", make_batch([17] * 8, [])),
                        ("prefill_8_plus_8_decodes", make_batch([17] * 8, [(100, 0)] * 4 + [(60, 40)] * 4))):
        samples = {"wrapped": [], "original": []}
        for _ in range(calls):
            for label, call in (("original", lambda b=batch: original(builder, 0, b)),
                                ("wrapped", lambda b=batch: builder.build(0, b))):
                start = time.perf_counter_ns()
                call()
                samples[label].append(time.perf_counter_ns() - start)
        wrapped, plain = statistics.median(samples["wrapped"]), statistics.median(samples["original"])
        results[name] = {"wrapped_us": wrapped / 1e3, "original_us": plain / 1e3, "added_us": (wrapped - plain) / 1e3}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--output")
    args = parser.parse_args()
    report = {"import": measure_import(args.runs), "gdn_host_flags_wrapper": measure_wrapper(args.calls)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        with open(args.output, "x") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
