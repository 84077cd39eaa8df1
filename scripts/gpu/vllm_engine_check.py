"""vLLM's whole engine on the H200 (issue 26): an A/B that can fail, per model, runner and engine mode.

Each *case* (:data:`CASES`) is one ``kda-patches regress --workload vllm`` -- fresh processes, the baseline twice
(``KDA_PATCHES=0``; a baseline that differs from itself is ``BASELINE UNSTABLE``), then ``KDA_PATCHES=1`` +
``KDA_PATCHES_STRICT=1``, every process's ledger -- on a tiny model of one family (:data:`MODELS`) with vLLM's real
compiled op library (carried by ``gpu_harness``) and seeded random weights at a realistic scale
(:func:`reinit_weights`: std 0.02 matrices, unit norms, HF-style decay parameters, drawn per parameter name from a
fixed seed on the CPU, so every process serves the same bytes). Compared: token ids, the chosen token's logprob and
the top-5 candidates at every position, exactly; cached prompt tokens and the preemption count too. The prompts
(:func:`write_prompts`) make the state copy matter: chunked prefills (later chunks start from the state the earlier
ones left), short requests decoding beside them (mixed batches), and a second round that continues a first-round
prompt (a prefix-cache hit, with prefix caching on). Two Qwen3.5 cases shrink the KV cache to 8 blocks and let eight
requests decode 1000 tokens each, which forces preemptions. Cases on two GPUs (issue 29) are judged per rank; a case
this machine cannot run (GPUs, a library or Ray not carried) is reported NOT RUN with what it needs.

The *negative control* is the same A/B with the plan's scatter deliberately wrong in the patched processes
(:data:`MUTANTS`, applied by this script's stand-in hook): it must come out DIFFERENT, or the A/B proves nothing.

Stand-ins (``gpu_harness.stood_in_record``): FlashAttention's compiled package, when the library is carried; on
vLLM >= 0.34 also MiniMax M3's MSA warm-up module (it imports the CuTe DSL, which is not carried).
Missing ``torch.ops._C`` lookups are recorded with their call site (:class:`OpRecorder`); without the library the
declared op stand-ins of :data:`OP_STAND_INS` / :data:`OP_LOOKUP_ONLY` answer.

Usage (GPU machine, after ``gpu_harness.py stage`` joined the carried pieces):
``python3 scripts/gpu/vllm_engine_check.py --out DIR [--cases NAME ...] [--parallel N]``, or
``... --throughput short long [--rounds 5]`` (``kda-patches bench serve-ab``, alone on the GPU);
``--dry-run`` (any machine) writes the model configs, the prompts and the plan and starts nothing.
Writes ``DIR/vllm_engine.json``; prints one ``ENGINE`` line per case and one ``THROUGHPUT`` line per shape.
The release that runs is the one staged (``vllm_bundle.py carry --vllm-version V``): the report's ``vllm`` is the
unpacked bundle's own ``vllm_version`` (:func:`report_version`), never assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

SCRIPT_DIR = pathlib.Path(__file__).resolve().parent
ROOT = SCRIPT_DIR.parents[1]
sys.path.insert(0, str(SCRIPT_DIR))
import gpu_harness  # noqa: E402  (carry, stand-ins, caches)

sys.path.remove(str(SCRIPT_DIR))

RUNNERS = {"v1": "0", "v2": "1"}  # VLLM_USE_V2_MODEL_RUNNER
WEIGHT_SEED = 20261203
PROMPT_SEED = 2612
VOCAB = 1024
TOP_LOGPROBS = 5
SEEDED_WEIGHTS_ENV = "KDA_ENGINE_SEEDED_WEIGHTS"
MUTANT_ENV = "KDA_ENGINE_MUTANT"
STEP_TIMES_ENV = "KDA_BENCH_STEP_TIMES"  # kda_patches.bench.step_times.ENV (this script runs before it is importable)
CONTINUATION = "r2-continues-r1-long"  # the round-two request that continues a round-one prompt
STARTUP_LINE = re.compile(r"kda-patches regress: engine started in ([0-9.]+) s")

_QWEN3_5 = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 1024,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
            "linear_num_key_heads": 4, "linear_num_value_heads": 12, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 2048,
            "vocab_size": VOCAB, "torch_dtype": "bfloat16", "max_position_embeddings": 4096,
            "full_attention_interval": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "layer_types": ["linear_attention", "full_attention"] * 2}


def _kimi(full_rank_gate: bool, heads: int = 12) -> dict[str, Any]:
    """Kimi Linear config, every layer KDA (its full-attention layers are MLA, whose prefill needs FlashAttention).

    Without the full-rank gate vLLM 0.33 packs the input projection row as q, k, v (heads x 128 each), one beta per
    head and 128 gate columns with no padding, so the row and the gate's start are 16-byte aligned only when the
    heads per GPU are a multiple of 8; at 12 heads both are 8 (mod 16) bytes and the baseline itself stopped on a
    misaligned address (runs 2-4). The full-rank branch (Kimi K3) pads the row, so 12 heads work there.
    """
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": 2048,
            "num_hidden_layers": 3, "num_attention_heads": 16, "intermediate_size": 2048, "vocab_size": VOCAB,
            "torch_dtype": "bfloat16", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "linear_attn_config": {"head_dim": 128, "num_heads": heads, "short_conv_kernel_size": 4,
                                   "use_full_rank_gate": full_rank_gate, "kda_layers": [1, 2, 3],
                                   "full_attn_layers": [], "gate_lower_bound": -5.0}}


_QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 1024,
               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
               "linear_num_key_heads": 4, "linear_num_value_heads": 12, "linear_key_head_dim": 128,
               "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 1024,
               "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256, "num_experts": 8,
               "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True, "vocab_size": VOCAB,
               "full_attention_interval": 2, "torch_dtype": "bfloat16", "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
               "layer_types": ["linear_attention", "full_attention"] * 2}
MOE_LIBRARY = "_moe_C_stable_libtorch.abi3.so"


@dataclass(frozen=True)
class ModelSpec:
    """A tiny model family: its config, the patch that routes its state copies, the runners and libraries it needs.

    ``libraries``: vLLM compiled libraries (files in ``vllm/``) beyond the op library that its layers call; a case
    of the model runs only where they were carried (``vllm_bundle.py carry --with-moe``), else it is reported as
    not run with that reason. ``seam``: the ledger key of the target the patch routes (``module:qualname``), where
    a case may expect the overlay to stand aside on it (vLLM >= 0.34's own GDN ops). ``runners``: on vLLM 0.33
    (0.34 has only the V2 runner, :data:`RELEASE_RUNNERS`).
    """

    config: dict[str, Any]
    patch: str
    runners: tuple[str, ...]
    note: str
    libraries: tuple[str, ...] = ()
    seam: str | None = None


_GDN_SEAMS = "vllm.model_executor.layers.mamba.gdn"
QWEN_GDN_SEAM = f"{_GDN_SEAMS}.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention._forward_core"
KIMI_GDN_SEAM = f"{_GDN_SEAMS}.kimi_gdn_linear_attn:KimiGatedDeltaNetAttention._forward"
MODELS = {
    "qwen3_5": ModelSpec(_QWEN3_5, "gdn_state_copy", ("v1", "v2"),
                         "dense Qwen3.5 GDN hybrid, GDN heads of Qwen3.6-27B at TP4 (12 value x 128 x 128)",
                         seam=QWEN_GDN_SEAM),
    "kimi_k3": ModelSpec(_kimi(True), "kimi_prefill", ("v1",),
                         "KimiLinearForCausalLM with the full-rank gate: vLLM builds KimiK3DeltaAttention; V1 runner "
                         "(its metadata builder computes aligned state indices itself)"),
    "kimi_linear": ModelSpec(_kimi(False, heads=16), "gdn_state_copy", ("v1", "v2"),
                             "KimiLinearForCausalLM without the full-rank gate: KimiLinearGatedDeltaNetAttention, "
                             "16 heads (its unpadded projection row is aligned only at a multiple of 8 heads)",
                             seam=KIMI_GDN_SEAM),
    "qwen3_next": ModelSpec(_QWEN3_NEXT, "gdn_state_copy", ("v1", "v2"),
                            "Qwen3-Next MoE GDN hybrid (8 experts, top 2); its MoE layers call vLLM's MoE library",
                            libraries=(MOE_LIBRARY,), seam=QWEN_GDN_SEAM),
}
FLASHKDA_LIBRARY = "_flashkda_C.abi3.so"


@dataclass(frozen=True)
class AtDefaults:
    """What vLLM 0.34 picks for a model at its defaults on SM90, beyond the op library.

    Attributes:
        prefill: the prefill backend a case at the defaults must find its layers running.
        libraries: vLLM compiled libraries (files in ``vllm/``) that backend choice needs carried.
        packages: carried packages (folders of the site) it needs.
        stands_aside: the seam stands aside on that backend's layers (its ``BackendGate``: every call left to
            upstream, counted ``calls_upstream``) instead of routing them.
    """

    prefill: str
    libraries: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    stands_aside: bool = False


AT_DEFAULTS = {
    # Kimi K3's KDA prefill is FlashKDA (`resolve_kda_prefill_backend`: head_dim 128, BF16, a bounded gate); its
    # native fused decode is in the op library
    "kimi_k3": AtDefaults("flashkda", (FLASHKDA_LIBRARY,)),
    # Qwen's GDN prefill is FlashInfer's on every SM90 device (`_resolve_gdn_prefill_backend`; a wheel set,
    # vllm_bundle.py carry --with-flashinfer), whose layers the Qwen seam stands aside on; its attention layers run
    # FlashAttention 3 (H100 run 21: without it the selector stops on "FlashAttention version not detected")
    "qwen3_next": AtDefaults("flashinfer", (gpu_harness.FA3_LIBRARY,), ("flashinfer",), stands_aside=True),
}
# the carry flag that brings each library or package (vllm_bundle.py carry ...)
CARRY_FLAGS = {MOE_LIBRARY: "--with-moe", FLASHKDA_LIBRARY: "--with-flashkda", gpu_harness.FA3_LIBRARY: "--with-fa3",
               "flashinfer": "--with-flashinfer"}


def not_carried(model: str, at_defaults: bool, site: pathlib.Path) -> list[str]:
    """Return what a run of ``model`` (at vLLM's defaults or not) needs that ``site`` lacks, each with its carry
    flag (:data:`CARRY_FLAGS`): the model's libraries, and at the defaults :data:`AT_DEFAULTS`' libraries and
    packages."""
    chosen = AT_DEFAULTS.get(model) if at_defaults else None
    libraries = (*MODELS[model].libraries, *(chosen.libraries if chosen else ()))
    packages = chosen.packages if chosen else ()
    lacking = [file for file in libraries if not gpu_harness.library_present(site, file)]
    lacking += [package for package in packages if not (site / package / "__init__.py").is_file()]
    return [f"{item} (vllm_bundle.py carry {CARRY_FLAGS[item]})" for item in lacking]
DEFAULT_RELEASE = "0.33.0"
RELEASE_RUNNERS = {"0.34.0": ("v2",)}  # 0.34's Worker always builds the V2 runner (VLLM_USE_V2_MODEL_RUNNER=1)


@dataclass(frozen=True)
class Case:
    """One engine A/B: a model, a runner, prefix caching, eager or compiled, optionally a mutant or a small cache."""

    name: str
    model: str
    runner: str
    prefix_caching: bool
    eager: bool
    mutant: str | None = None
    kv_blocks: int | None = None
    tp: int = 1  # tensor_parallel_size: that many GPUs, one worker process each
    executor: str = "mp"  # distributed_executor_backend where tp > 1: mp or ray
    release: str = DEFAULT_RELEASE  # the vLLM release whose bundle must be staged (vllm_bundle.py --vllm-version)
    gdn_ops: str | None = None  # KDA_PATCHES_GDN_OPS (vLLM >= 0.34: ``overlay`` routes Qwen / Kimi Linear GDN)
    stands_aside: bool = False  # the overlay must leave the model's seam to vLLM's own ops (0.34's default)
    extensible: bool | None = None  # vLLM >= 0.34: the extensible KV cache on (its default) or off; None: 0.33
    # vLLM >= 0.34: the JIT monitor watches (mode warn) and the patched run may JIT-compile nothing the baseline did
    # not: mode error stops vLLM's own baseline with TRITON_ATTN (H200 run 9: kernel_unified_attention compiles
    # while serving), so it cannot tell the overlay apart
    jit_watch: bool = False
    # KDA_PATCHES_PDL at its default (auto; unset even where the caller set it): on an SM90+ GPU the plans compile
    # with programmatic dependent launch, and the patched processes' ledgers must say every routed layer's plan did,
    # else the case proves nothing about PDL (or the default stopped choosing it)
    pdl: bool = False
    # no backend argument at all (attention, GDN / KDA prefill and decode left to vLLM): the case runs what vLLM picks
    # on this GPU, which needs what it picks carried (:data:`AT_DEFAULTS`)
    at_defaults: bool = False
    # KDA_PATCHES_STATE_IO (issue 51: ``indexed`` -- the chunk kernel reads and stores the cache rows, no copy); an
    # indexed case must find every routed call indexed (``calls_indexed == calls_routed``)
    state_io: str | None = None
    # a third round of WIDE_PREFILL_REQUESTS short prompts prefilled in one step (max_num_seqs WIDE_MAX_NUM_SEQS): at
    # the default KDA_PATCHES_STATE_IO (measured: auto on a measured seam) that step's call runs the indexed twin and
    # the narrower ones copy, so the case must find both (0 < calls_indexed < calls_routed)
    wide: bool = False

    @property
    def prompt_set(self) -> str:
        """The prompts file the case serves: ``preempt`` (a small cache), ``wide`` or ``default``."""
        return "preempt" if self.kv_blocks else "wide" if self.wide else "default"

    @property
    def aside_on_backend(self) -> str | None:
        """The prefill backend whose layers the seam must stand aside on (a case at the defaults of a model whose
        :data:`AT_DEFAULTS` entry stands aside), else None."""
        chosen = AT_DEFAULTS.get(self.model) if self.at_defaults else None
        return chosen.prefill if chosen and chosen.stands_aside else None

    @property
    def profiles_memory(self) -> bool:
        """vLLM sizes this case's KV cache from the GPU's free memory (0.34's extensible cache: no fixed budget), so
        no other engine may start or stop beside it (H200 run 9: "Error in memory profiling" and "No available
        memory for the cache blocks" with eight cases at a time)."""
        return bool(self.extensible)

    @property
    def expected(self) -> str:
        """The verdict the case must reach: ``different`` for a negative control, ``equal`` otherwise."""
        return "different" if self.mutant else "equal"


CASES = (
    Case("qwen3_5-v2-prefix-eager", "qwen3_5", "v2", True, True),
    Case("qwen3_5-v2-prefix-eager-NEGATIVE", "qwen3_5", "v2", True, True, mutant="scatter-halved"),
    Case("qwen3_5-v1-noprefix-compiled", "qwen3_5", "v1", False, False),
    Case("qwen3_5-v2-prefix-compiled", "qwen3_5", "v2", True, False),
    Case("qwen3_5-v1-noprefix-eager-preempt", "qwen3_5", "v1", False, True, kv_blocks=8),
    Case("qwen3_5-v2-noprefix-eager-preempt", "qwen3_5", "v2", False, True, kv_blocks=8),
    Case("kimi_k3-v1-prefix-eager", "kimi_k3", "v1", True, True),
    Case("kimi_k3-v1-prefix-eager-NEGATIVE", "kimi_k3", "v1", True, True, mutant="scatter-halved"),
    Case("kimi_linear-v1-noprefix-eager", "kimi_linear", "v1", False, True),
    Case("kimi_linear-v2-prefix-compiled", "kimi_linear", "v2", True, False),
    Case("qwen3_next-v2-prefix-eager", "qwen3_next", "v2", True, True),
    # issue 29 (nvidia-h200-x2): every rank prepares and routes through its own plans on its own GPU
    Case("qwen3_5-v2-prefix-eager-tp2", "qwen3_5", "v2", True, True, tp=2),
    Case("qwen3_5-v2-prefix-eager-tp2-NEGATIVE", "qwen3_5", "v2", True, True, mutant="scatter-halved", tp=2),
    Case("qwen3_5-v1-noprefix-compiled-tp2", "qwen3_5", "v1", False, False, tp=2),
    Case("qwen3_5-v2-prefix-eager-tp2-ray", "qwen3_5", "v2", True, True, tp=2, executor="ray"),
    # issue 27 (vLLM 0.34, its bundle staged): Qwen3-Next for the Qwen GDN seam (0.34 builds Qwen3.5 on CUDA with
    # FlashInfer's norm, which is not carried); the default (KDA_PATCHES_GDN_OPS=measured) routes Qwen's seam, as
    # the H200 layer check of 0.34 measured; KDA_PATCHES_GDN_OPS=upstream stands aside for upstream's own ops
    *(Case(f"qwen3_next-v2-prefix-{mode}-034{suffix}", "qwen3_next", "v2", True, mode == "eager", release="0.34.0",
           extensible=extensible, gdn_ops=gdn_ops, stands_aside=gdn_ops == "upstream", mutant=mutant,
           jit_watch=mode == "compiled")
      for mode, suffix, extensible, gdn_ops, mutant in (
          ("eager", "", True, None, None),
          ("eager", "-upstream", True, "upstream", None),
          ("eager", "-overlay", True, "overlay", None),
          ("eager", "-overlay-NEGATIVE", True, "overlay", "scatter-halved"),
          ("eager", "-overlay-not-extensible", False, "overlay", None),
          ("compiled", "-jit-watch", True, None, None),
          ("compiled", "-upstream-jit-watch", True, "upstream", None),
          ("compiled", "-overlay-jit-watch", True, "overlay", None))),
    Case("kimi_k3-v2-prefix-eager-034", "kimi_k3", "v2", True, True, release="0.34.0", extensible=True),
    Case("kimi_k3-v2-prefix-eager-034-NEGATIVE", "kimi_k3", "v2", True, True, release="0.34.0", extensible=True,
         mutant="scatter-halved"),
    # the plans launched with PDL (KDA_PATCHES_PDL's default, auto, on SM90+) in the engine, CUDA graphs included
    Case("qwen3_next-v2-prefix-compiled-034-overlay-pdl", "qwen3_next", "v2", True, False, release="0.34.0",
         extensible=True, gdn_ops="overlay", jit_watch=True, pdl=True),
    Case("qwen3_next-v2-prefix-eager-034-overlay-pdl-NEGATIVE", "qwen3_next", "v2", True, True, release="0.34.0",
         extensible=True, gdn_ops="overlay", mutant="scatter-halved", pdl=True),
    Case("kimi_k3-v2-prefix-eager-034-pdl", "kimi_k3", "v2", True, True, release="0.34.0", extensible=True, pdl=True),
    # issue 50: Kimi K3 as vLLM 0.34 serves it by default on SM90 -- no backend argument (FlashKDA prefill, native
    # fused decode), not eager (torch.compile + breakable CUDA graphs, on by default for KimiLinearForCausalLM, whose
    # _forward is an eager break: replays must run the routed call), prefix caching and the extensible cache on
    Case("kimi_k3-v2-prefix-defaults-034", "kimi_k3", "v2", True, False, release="0.34.0", extensible=True,
         at_defaults=True),
    Case("kimi_k3-v2-prefix-defaults-034-NEGATIVE", "kimi_k3", "v2", True, False, release="0.34.0", extensible=True,
         at_defaults=True, mutant="scatter-halved"),
    # Qwen3-Next as vLLM 0.34 serves it by default on SM90 (FlashInfer carried): no backend argument, FlashInfer's GDN
    # prefill, whose layers the Qwen seam stands aside on (QWEN_FLASHINFER_GATE: upstream keeps both copies),
    # torch.compile + piecewise CUDA graphs; the negative control halves the states upstream's own scatter stores in
    # the patched processes: at these settings the A/B must still see a wrong store
    Case("qwen3_next-v2-prefix-defaults-034", "qwen3_next", "v2", True, False, release="0.34.0", extensible=True,
         at_defaults=True, jit_watch=True),
    Case("qwen3_next-v2-prefix-defaults-034-NEGATIVE", "qwen3_next", "v2", True, False, release="0.34.0",
         extensible=True, at_defaults=True, mutant="upstream-scatter-halved"),
    # the same with the Triton prefill/decode backends forced (FlashKDA not carried): breakable graphs alone
    Case("kimi_k3-v2-prefix-graphs-034", "kimi_k3", "v2", True, False, release="0.34.0", extensible=True),
    # Kimi Linear on vLLM 0.34 (none ran before): its seam routed (KDA_PATCHES_GDN_OPS=overlay; the default leaves it
    # to upstream until this case passes), the Triton prefill forced as in every forced case, breakable CUDA graphs
    # (KimiLinearForCausalLM's default), the default KDA_PATCHES_STATE_IO (measured: auto on this seam)
    Case("kimi_linear-v2-prefix-graphs-034-overlay-jit-watch", "kimi_linear", "v2", True, False, release="0.34.0",
         extensible=True, gdn_ops="overlay", jit_watch=True),
    Case("kimi_linear-v2-prefix-eager-034-overlay-NEGATIVE", "kimi_linear", "v2", True, True, release="0.34.0",
         extensible=True, gdn_ops="overlay", mutant="scatter-halved"),
    # the default KDA_PATCHES_STATE_IO (measured) in the engine: Qwen's seam copies narrow prefills through the plan
    # and runs the indexed twin for the wide round's step (>= AUTO_MIN_SEQUENCES sequences); JIT watch on (the twin
    # must not compile while serving); the negative control halves only what the twin stored
    Case("qwen3_next-v2-prefix-compiled-034-wide-jit-watch", "qwen3_next", "v2", True, False, release="0.34.0",
         extensible=True, jit_watch=True, wide=True),
    Case("qwen3_next-v2-prefix-eager-034-wide-NEGATIVE", "qwen3_next", "v2", True, True, release="0.34.0",
         extensible=True, wide=True, mutant="indexed-halved"),
    # issue 51: no copy -- Qwen's seam routed (Triton GDN prefill, forced as in every Qwen3-Next case), its chunk
    # kernel the indexed twin; compiled + CUDA graphs with the JIT watch (the twin compiles before serving), and a
    # negative control whose twin leaves halved states in the cache
    Case("qwen3_next-v2-prefix-compiled-034-indexed-jit-watch", "qwen3_next", "v2", True, False, release="0.34.0",
         extensible=True, jit_watch=True, state_io="indexed"),
    Case("qwen3_next-v2-prefix-eager-034-indexed-NEGATIVE", "qwen3_next", "v2", True, True, release="0.34.0",
         extensible=True, state_io="indexed", mutant="indexed-halved"),
    # Kimi K3 with no copy (its Triton KDA prefill: FlashKDA layers keep the plan's copies), breakable CUDA graphs,
    # the JIT watch, and its negative control; needs no MoE library
    Case("kimi_k3-v2-prefix-graphs-034-indexed-jit-watch", "kimi_k3", "v2", True, False, release="0.34.0",
         extensible=True, jit_watch=True, state_io="indexed"),
    Case("kimi_k3-v2-prefix-eager-034-indexed-NEGATIVE", "kimi_k3", "v2", True, True, release="0.34.0",
         extensible=True, state_io="indexed", mutant="indexed-halved"),
)
# kda_patches.state_copy.errors.LEDGER_SECTION (the plans' per-layer facts), written out like STEP_TIMES_ENV: this
# script's module level runs before kda_patches is importable; a test keeps the two equal
STATE_COPY_SECTION = "state_copy"
RAY_WORKER_MARK = "default_worker.py"  # Ray's worker processes run this script (their rank is not in the name)
# Multicast over NVLink stays off in every process vLLM starts on the multi-GPU machines (the device tool's KINDS.md:
# a program that uses it can take the shared host's GPUs out of service); recorded per process and checked
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ENV_RECORD_ENV = "KDA_ENGINE_ENV_RECORD_DIR"
PREEMPT_MAX_MODEL_LEN = 1408  # the longest request holds 1340 tokens; a small cache must still hold one request
MUTANTS = {"scatter-halved": "every final state the plan scatters is halved first (a wrong store): the cache "
                             "then holds states the unpatched engine never wrote",
           "indexed-halved": "every cache row the indexed twin stored is halved after it (a wrong store without a "
                             "scatter: KDA_PATCHES_STATE_IO=indexed)",
           "upstream-scatter-halved": "in the patched processes only, every final state vLLM's own scatter_states "
                                      "stores from the Qwen GDN layer is halved first (a seam standing aside leaves "
                                      "that store to upstream; the A/B must still catch a wrong one)"}
# where the upstream-scatter-halved mutant wraps vLLM's own scatter (the name the Qwen GDN layer calls)
UPSTREAM_SCATTER = ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "scatter_states")
OP_LOOKUP_ONLY = {
    "silu_and_mul": "SiluAndMul.__init__ (layers/activation.py) stores it on CUDA; with custom_ops none its native "
    "forward runs",
}
OP_STAND_INS = {
    "get_cuda_view_from_cpu_tensor": "the V2 runner's UVA buffers: a CUDA tensor over the same pinned host memory "
    "(CUDA unified addressing maps a pinned host pointer to the same device address), built through "
    "__cuda_array_interface__; the real op does the same through cudaHostGetDevicePointer",
}


# ---------------------------------------------------------------- in every engine process (the stand-in hook)


class StoodInOpCalled(RuntimeError):
    """vLLM called a compiled op that is only stood in for its lookup."""


class LookedUpOp:
    """What ``torch.ops._C.<name>`` returns for an op declared lookup-only: recorded; raises when called."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise StoodInOpCalled(f"torch.ops._C.{self.name} was called, and it is only stood in for its lookup (vLLM's "
                              "compiled library is not carried): this call site needs a real stand-in")


def cuda_view_of(cpu_tensor: Any) -> Any:
    """:data:`OP_STAND_INS` ``get_cuda_view_from_cpu_tensor``: a CUDA view of pinned host memory."""
    import torch

    if not cpu_tensor.is_pinned():
        raise RuntimeError("get_cuda_view_from_cpu_tensor needs pinned host memory (as vLLM's own op does)")
    typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.int32: "<i4", torch.int64: "<i8",
               torch.bool: "|b1", torch.uint8: "|u1", torch.int8: "|i1"}[cpu_tensor.dtype]
    size = cpu_tensor.element_size()
    view = type("PinnedView", (), {})()
    view.__cuda_array_interface__ = {"shape": tuple(cpu_tensor.shape), "typestr": typestr, "version": 3,
                                     "data": (cpu_tensor.data_ptr(), False),
                                     "strides": tuple(stride * size for stride in cpu_tensor.stride())}
    return torch.as_tensor(view, device="cuda")


STAND_IN_FUNCTIONS = {"get_cuda_view_from_cpu_tensor": cuda_view_of}  # OP_STAND_INS' implementations


class OpRecorder:
    """Records every miss of a ``torch.ops._C`` lookup; without the real library answers the declared stand-ins.

    Args:
        library: vLLM's real compiled library is loaded: then no op is stood in, misses are only recorded.
    """

    def __init__(self, library: bool = False) -> None:
        self.looked_up: dict[str, str] = {}
        self.original: Any = None
        self.library = library

    def install(self) -> None:
        import torch._ops

        namespace_class = torch._ops._OpNamespace
        original = self.original = namespace_class.__getattr__
        recorder = self

        def lookup(namespace: Any, name: str) -> Any:
            try:
                return original(namespace, name)
            except AttributeError:
                if namespace.name != "_C" or name.startswith("__"):
                    raise
                answer = recorder.stand_in(name)
                if answer is None:
                    raise
                return answer

        namespace_class.__getattr__ = lookup

    def uninstall(self) -> None:
        """Put torch's own lookup back."""
        import torch._ops

        if self.original is not None:
            torch._ops._OpNamespace.__getattr__ = self.original
            self.original = None

    def stand_in(self, name: str) -> Any:
        """Record the miss of ``torch.ops._C.<name>``; return its declared stand-in, or None (the miss stands)."""
        caller = traceback.extract_stack(limit=3)[0]  # [the looking-up frame, lookup, stand_in (here)]
        self.looked_up.setdefault(name, f"{caller.filename.split('site-packages/')[-1]}:{caller.lineno}")
        if self.library:
            return None
        if name in OP_STAND_INS:
            return STAND_IN_FUNCTIONS[name]
        return LookedUpOp(name) if name in OP_LOOKUP_ONLY else None


RECORDER = OpRecorder()


def seeded_values(name: str, shape: tuple[int, ...], seed: int) -> Any:
    """Return the CPU float32 values :func:`reinit_weights` gives the parameter ``name`` of ``shape``.

    Matrices and convolutions: normal, std 0.02 (HF's ``initializer_range``); norm weights: ones; biases: zeros;
    ``A_log``: log of uniform(1, 16) (GDN/KDA decay rates, as HF initializes them); ``dt_bias``: ones; any other
    vector: normal, std 0.02. The generator is seeded by ``seed`` and the name, so the values do not depend on the
    order parameters are visited in.
    """
    import torch

    generator = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log" or name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
    if "dt_bias" in name:
        return torch.ones(shape)
    if len(shape) >= 2:
        return torch.randn(shape, generator=generator) * 0.02
    if leaf == "bias":
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    return torch.randn(shape, generator=generator) * 0.02


def reinit_weights(model: Any, seed: int) -> int:
    """Overwrite every parameter of ``model`` with :func:`seeded_values`; return how many were written."""
    import torch

    count = 0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(seeded_values(name, tuple(parameter.shape), seed).to(parameter.dtype))
            count += 1
    return count


def _seed_after_dummy_load(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs["model"]
    reinit_weights(model, int(os.environ[SEEDED_WEIGHTS_ENV]))
    return result


def _halve_before_scatter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    state, packed, *rest = args
    return wrapped(state, packed * 0.5, *rest, **kwargs)


def _halve_upstream_source(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    state, source, *rest = args
    return wrapped(state, source * 0.5, *rest, **kwargs)


def _halve_after_indexed(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    _, cache, rows, *_ = args
    result = wrapped(*args, **kwargs)
    valid = rows[(rows >= 0) & (rows < cache.shape[0])].long()
    cache[valid] = cache[valid] * 0.5
    return result


def record_process_env(folder: pathlib.Path) -> pathlib.Path:
    """Write ``folder/env-<pid>.json``: this process's command line and its :data:`NO_MULTICAST` variables."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"env-{os.getpid()}.json"
    path.write_text(json.dumps({"pid": os.getpid(), "argv": sys.argv[:3],
                                "env": {name: os.environ.get(name) for name in NO_MULTICAST}}))
    return path


def check_process_envs(folder: pathlib.Path) -> tuple[bool, str]:
    """Return whether every process that recorded its environment had :data:`NO_MULTICAST` exactly, and why."""
    records = [json.loads(path.read_text()) for path in sorted(folder.glob("env-*.json"))] if folder.is_dir() else []
    if not records:
        return False, f"no process recorded its environment in {folder}"
    wrong = [f"pid {r['pid']} {r['env']}" for r in records if r["env"] != NO_MULTICAST]
    if wrong:
        return False, f"{len(wrong)} of {len(records)} processes without {NO_MULTICAST}: {'; '.join(wrong)[:300]}"
    return True, f"{len(records)} processes with {', '.join(f'{k}={v}' for k, v in NO_MULTICAST.items())}"


def install_engine_stand_ins() -> None:
    """What the generated sitecustomize runs in every engine process: stand-ins, op recorder, weights, mutant.

    ``KDA_ENGINE_SEEDED_WEIGHTS=SEED``: vLLM's dummy loader's weights are overwritten by :func:`reinit_weights`.
    ``KDA_ENGINE_MUTANT=scatter-halved``: the overlay's plan scatters halved final states (negative control; the
    baseline has no plan, so only the patched run is wrong).
    ``KDA_BENCH_STEP_TIMES=1``: engine steps and runner calls timed (:mod:`kda_patches.bench.step_times`).
    """
    import wrapt

    from kda_patches.bench.step_times import install_from_env

    gpu_harness.install_stand_ins()
    install_from_env()  # KDA_BENCH_STEP_TIMES=1: each throughput run's engine steps timed, both sides
    RECORDER.library = gpu_harness.library_present()
    RECORDER.install()
    if os.environ.get(ENV_RECORD_ENV):
        record_process_env(pathlib.Path(os.environ[ENV_RECORD_ENV]))
    if os.environ.get(SEEDED_WEIGHTS_ENV):
        wrapt.register_post_import_hook(lambda module: wrapt.wrap_function_wrapper(
            module, "DummyModelLoader.load_weights", _seed_after_dummy_load),
            "vllm.model_executor.model_loader.dummy_loader")
    if os.environ.get(MUTANT_ENV):
        install_mutant(os.environ[MUTANT_ENV], patched=os.environ.get("KDA_PATCHES") != "0")


def install_mutant(mutant: str, patched: bool) -> list[str]:
    """Register the post-import wrap of one of :data:`MUTANTS` in this process.

    Args:
        mutant: the mutant's name.
        patched: this is a patched process (``KDA_PATCHES`` not 0); ``upstream-scatter-halved`` wraps nothing in a
            baseline process, whose upstream scatter must run as released.
    Returns:
        The ``module:attribute`` targets registered (empty where the mutant leaves this process alone).
    Raises:
        ValueError: an unknown mutant.
    """
    import wrapt

    if mutant not in MUTANTS:
        raise ValueError(f"{MUTANT_ENV}={mutant!r}: known mutants {sorted(MUTANTS)}")
    if mutant == "upstream-scatter-halved":
        if not patched:
            return []
        module, name, wrapper = *UPSTREAM_SCATTER, _halve_upstream_source
    elif mutant == "indexed-halved":  # the route calls the twin by its module-level name
        module, name, wrapper = "kda_patches.indexed_chunk.route", "run_bound", _halve_after_indexed
    else:
        module, name, wrapper = "kda_patches.state_copy.plan", "StateCopyPlan.scatter_eager", _halve_before_scatter
    wrapt.register_post_import_hook(lambda loaded: wrapt.wrap_function_wrapper(loaded, name, wrapper), module)
    return [f"{module}:{name}"]


# ---------------------------------------------------------------- the plan of a run (parent)


def write_model_dir(model: str, root: pathlib.Path) -> pathlib.Path:
    """Write ``root/<model>/config.json`` of :data:`MODELS` and return the directory."""
    path = root / model
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODELS[model].config))
    return path


WIDE_PREFILL_REQUESTS = 80  # one step's prefill of this many sequences: above the auto crossover (64)
WIDE_PROMPT_TOKENS = 3  # 80 x 3 tokens fit the 256-token step budget
WIDE_MAX_NUM_SEQS = 96  # every wide request scheduled at once


def write_prompts(path: pathlib.Path, seed: int = PROMPT_SEED, preempt: bool = False,
                  wide: bool = False) -> list[dict[str, Any]]:
    """Write a prompts file (JSON lines, token ids below :data:`VOCAB`) and return its records.

    Default: round 1 (one step) has two long prompts prefilled in chunks of the 256-token budget, a middle one, and
    short ones that decode while the long ones still prefill; round 2 is the first long prompt plus 150 new tokens
    (with prefix caching its prefill starts from a cached state) and a fresh prompt. ``preempt``: eight requests of
    200-340 prompt tokens that each decode 1000 tokens: the scheduler admits a request for the blocks its prompt
    needs, so with a small cache the running requests outgrow it while decoding and vLLM preempts (and later
    prefills again) some of them. ``wide``: the default, then a third round of :data:`WIDE_PREFILL_REQUESTS`
    prompts of :data:`WIDE_PROMPT_TOKENS` tokens, all prefilled in one step, each decoding from the state it stored.
    """
    generator = random.Random(seed)

    def draw(length: int) -> list[int]:
        return [generator.randrange(2, VOCAB) for _ in range(length)]

    if preempt:
        records = [{"name": f"grows-{length}", "prompt_token_ids": draw(length), "max_tokens": 1000}
                   for length in range(200, 341, 20)]
    else:
        long_prompt = draw(1100)
        records = [{"name": "r1-long-1100", "prompt_token_ids": long_prompt, "max_tokens": 16},
                   {"name": "r1-long-700", "prompt_token_ids": draw(700), "max_tokens": 16},
                   {"name": "r1-mid-130", "prompt_token_ids": draw(130), "max_tokens": 24}]
        records += [{"name": f"r1-short-{length}", "prompt_token_ids": draw(length), "max_tokens": 32}
                    for length in (5, 17, 33, 60)]
        records += [{"name": CONTINUATION, "prompt_token_ids": long_prompt + draw(150), "max_tokens": 16,
                     "round": 2},
                    {"name": "r2-fresh-300", "prompt_token_ids": draw(300), "max_tokens": 16, "round": 2}]
        if wide:
            records += [{"name": f"r3-wide-{number}", "prompt_token_ids": draw(WIDE_PROMPT_TOKENS), "max_tokens": 4,
                         "round": 3} for number in range(WIDE_PREFILL_REQUESTS)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return records


def engine_params(case: Case, model_dir: pathlib.Path, prompts: pathlib.Path) -> dict[str, Any]:
    """Return the ``--param`` values of a case: the workload's and vLLM's engine arguments."""
    params: dict[str, Any] = {
        "model": str(model_dir), "prompts": str(prompts), "max_tokens": 16, "ignore_eos": True,
        "logprobs": TOP_LOGPROBS, "load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16",
        "max_model_len": 2048, "max_num_seqs": 16, "max_num_batched_tokens": 256, "enable_chunked_prefill": True,
        "enable_prefix_caching": case.prefix_caching, "enforce_eager": case.eager, "seed": 0,
        # a fixed KV budget: no memory profiling (other engines share the GPU), the same block count every process
        "gpu_memory_utilization": 0.07, "kv_cache_memory_bytes": 2 << 30, "disable_log_stats": False,
        "attention_backend": "TRITON_ATTN",
        # FLA's Triton chunk kernels: on SM90 "auto" picks FlashInfer's GDN prefill, which is not carried
        "additional_config": {"gdn_prefill_backend": "triton", "kda_prefill_backend": "triton",
                              "kda_decode_backend": "triton"}}
    if case.at_defaults:
        del params["attention_backend"], params["additional_config"]
    if case.kv_blocks:
        params.update(num_gpu_blocks_override=case.kv_blocks, max_model_len=PREEMPT_MAX_MODEL_LEN)
    if case.wide:
        params["max_num_seqs"] = WIDE_MAX_NUM_SEQS
    if case.tp > 1:
        params.update(tensor_parallel_size=case.tp, distributed_executor_backend=case.executor)
    if case.extensible:  # vLLM 0.34 turns the extensible cache off when a fixed KV budget is given: profile instead
        del params["kv_cache_memory_bytes"]
    elif case.extensible is False:
        params["enable_extensible_kv_cache"] = False
    if case.jit_watch:
        params["jit_monitor_mode"] = "warn"
    return params


# Every engine argument / environment variable a case may set that differs from vLLM's default, with why. "path":
# it changes a code path users run by default (a backend, graph mode, cache mode) -- a case setting one is
# labelled non-default; "workload": the shape of the tiny workload or the harness's need, not a path.
OVERRIDES: dict[str, tuple[str, str]] = {
    "attention_backend": ("path", "FlashAttention 3 (vllm_flash_attn/_vllm_fa3_C, 56 MB) is not carried: TRITON_ATTN"),
    "additional_config": ("path", "Triton FLA prefill/decode forced: FlashInfer (0.34 pins flashinfer-python 0.7.3, "
                          "absent from the registry) and, unless --with-flashkda, FlashKDA are not carried"),
    "enforce_eager": ("path", "eager: no torch.compile, no CUDA graphs (the eager A/B of the seam)"),
    "enable_prefix_caching": ("path", "the no-prefix-caching path of the V1 runner"),
    "kv_cache_memory_bytes": ("path", "a fixed KV budget so cases share the GPU; it turns 0.34's extensible cache off"),
    "num_gpu_blocks_override": ("path", "an 8-block cache that forces preemptions"),
    "enable_extensible_kv_cache": ("path", "the extensible cache off: the plans bound once, no rebind"),
    "tensor_parallel_size": ("workload", "the multi-GPU cases"),
    "distributed_executor_backend": ("workload", "mp or Ray, named by the case"),
    "jit_monitor_mode": ("workload", "warn: the JIT monitor reports compiles while serving (it changes no path)"),
    "load_format": ("workload", "dummy, then seeded weights at a realistic scale (no download on the GPU machine)"),
    "skip_tokenizer_init": ("workload", "token-id prompts: a random model has no tokenizer files"),
    "gpu_memory_utilization": ("workload", "engines share the GPU"),
    "max_model_len": ("workload", "the workload's prompts fit 2048 tokens"),
    "max_num_seqs": ("workload", "16 requests at a time: small batches the tiny model fills"),
    "max_num_batched_tokens": ("workload", "256: the long prompts prefill in chunks"),
    "enable_chunked_prefill": ("workload", "stated (vLLM's default on)"),
    "seed": ("workload", "stated"), "dtype": ("workload", "stated (the config's bfloat16)"),
    "disable_log_stats": ("workload", "stated: the engine's stats give the preemption count"),
    "VLLM_USE_FLASHINFER_SAMPLER": ("workload", "0: FlashInfer is not carried; vLLM's own sampler, which it falls "
                                    "back to without FlashInfer anyway"),
    "VLLM_KIMI_K3_GEMM_AR": ("workload", "0: the fused GEMM + all-reduce imports the CuTe DSL (not carried); one rank "
                             "has nothing to reduce"),
    "VLLM_ENABLE_GEMM_RS": ("workload", "0: as VLLM_KIMI_K3_GEMM_AR"),
    "VLLM_USE_V2_MODEL_RUNNER": ("workload", "the case's runner (0.34 has only V2)"),
}
_ENGINE_DEFAULT = {"enforce_eager": False, "enable_prefix_caching": True, "enable_extensible_kv_cache": True,
                   "enable_chunked_prefill": True}  # values equal to vLLM's own default are not overrides


def case_overrides(case: Case, params: dict[str, Any], env: dict[str, str]) -> list[dict[str, Any]]:
    """Return every engine argument and environment variable the case sets that differs from vLLM's default.

    Each entry: ``{"name", "value", "kind" ("path" or "workload"), "why"}`` (:data:`OVERRIDES`). The workload's own
    keys (model, prompts, sampling) are not engine arguments and are not listed.
    """
    found = []
    for name, value in params.items():
        if name in OVERRIDES and _ENGINE_DEFAULT.get(name, object()) != value:
            found.append({"name": name, "value": value, "kind": OVERRIDES[name][0], "why": OVERRIDES[name][1]})
    for name in sorted(OVERRIDES):
        if name.startswith("VLLM_") and name in env and not (name == "VLLM_USE_V2_MODEL_RUNNER" and env[name] == "1"):
            found.append({"name": name, "value": env[name], "kind": OVERRIDES[name][0], "why": OVERRIDES[name][1]})
    return found


def case_env(case: Case, hook: pathlib.Path, site: pathlib.Path) -> dict[str, str]:
    """The environment of a case's ``regress``: bundle, stand-in hook, caches, runner, seeded weights, mutant."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(ROOT), str(site), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("TRITON_INTERPRET", None)
    env.pop(MUTANT_ENV, None)
    env.update(gpu_harness.compile_cache_env())
    env.update({SEEDED_WEIGHTS_ENV: str(WEIGHT_SEED), "VLLM_USE_V2_MODEL_RUNNER": RUNNERS[case.runner],
                "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                # Kimi K3's fused GEMM + all-reduce/reduce-scatter imports the CuTe DSL (nvidia-cutlass-dsl), which is
                # not carried; with one rank there is nothing to reduce
                "VLLM_KIMI_K3_GEMM_AR": "0", "VLLM_ENABLE_GEMM_RS": "0", **NO_MULTICAST})
    if case.mutant:
        env[MUTANT_ENV] = case.mutant
    if case.gdn_ops:
        env["KDA_PATCHES_GDN_OPS"] = case.gdn_ops
    if case.state_io:
        env["KDA_PATCHES_STATE_IO"] = case.state_io
    if case.pdl:
        env.pop("KDA_PATCHES_PDL", None)
    if case.at_defaults and (site / "flashinfer" / "__init__.py").is_file():
        env.pop("VLLM_USE_FLASHINFER_SAMPLER")  # the override stands only for FlashInfer not carried
    return env


def bench_env(name: str, hook: pathlib.Path, site: pathlib.Path, shape: str | None = None) -> dict[str, str]:
    """A benchmark's environment: a V2-runner case's (:func:`case_env`) of the shape's model, at the defaults for a
    shape of :data:`SHAPES_AT_DEFAULTS`, without seeded weights (a benchmark needs none; the dummy loader's run as
    they are)."""
    at_defaults = shape in SHAPES_AT_DEFAULTS
    env = case_env(Case(name, SHAPE_MODELS.get(shape or "", "qwen3_5"), "v2", True, False, at_defaults=at_defaults),
                   hook, site)
    env.pop(SEEDED_WEIGHTS_ENV)
    return env


def regress_argv(case: Case, params: dict[str, Any], work: pathlib.Path) -> list[str]:
    """The ``kda-patches regress`` command line of a case (baseline twice; a negative control once)."""
    argv = [sys.executable, "-m", "kda_patches", "regress", "--workload", "vllm", "--json", "--work-dir", str(work),
            "--baseline-runs", "1" if case.mutant else "2", "--timeout", "400"]
    if case.aside_on_backend:  # the seam's layers leave every call to upstream, counted
        argv += ["--expect", f"{MODELS[case.model].patch}:calls_upstream"]
    elif not case.stands_aside:
        argv += ["--expect", f"{MODELS[case.model].patch}:calls_routed"]
    for key, value in params.items():
        argv += ["--param", f"{key}={json.dumps(value)}"]
    return argv


def runnable(cases: list[Case], site: pathlib.Path, gpus: int, version: str | None = DEFAULT_RELEASE
             ) -> tuple[list[Case], dict[str, str]]:
    """Split cases into those this machine can run and the others, each with its reason.

    A case runs where its release's bundle is the one unpacked (``version``), its model's libraries are in
    ``site`` and the machine has its ``tp`` GPUs.
    """
    ready, not_run = [], {}
    for case in cases:
        missing = not_carried(case.model, case.at_defaults, site)
        if case.release != version:
            not_run[case.name] = (f"needs vLLM {case.release}'s bundle (vllm_bundle.py carry --vllm-version "
                                  f"{case.release}); vLLM {version} is unpacked")
        elif case.tp > gpus:
            not_run[case.name] = (f"needs {case.tp} GPUs, this machine has {gpus} (the nvidia-h200-x{case.tp} kind, "
                                  "issue 29)")
        elif case.executor == "ray" and not (site / "ray" / "__init__.py").is_file():
            not_run[case.name] = "Ray was not carried (vllm_bundle.py carry --with-ray)"
        elif missing:
            not_run[case.name] = f"not carried: {', '.join(missing)}; {MODELS[case.model].note}"
        else:
            ready.append(case)
    return ready, not_run


def validate_cases(names: list[str] | None) -> list[Case]:
    """Return the cases named (all by default), each checked against its model's runners.

    Raises:
        ValueError: an unknown case name, or a case on a runner its model cannot use.
    """
    by_name = {case.name: case for case in CASES}
    unknown = [name for name in names or [] if name not in by_name]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; known: {sorted(by_name)}")
    chosen = [by_name[name] for name in names] if names else list(CASES)
    for case in chosen:
        runners = RELEASE_RUNNERS.get(case.release, MODELS[case.model].runners)
        if case.runner not in runners:
            raise ValueError(f"case {case.name}: model {case.model} runs on {runners} under vLLM {case.release}, not "
                             f"{case.runner} ({MODELS[case.model].note})")
        if case.stands_aside and not MODELS[case.model].seam:
            raise ValueError(f"case {case.name}: stands aside, but model {case.model} declares no seam to check")
        if case.mutant and case.mutant not in MUTANTS:
            raise ValueError(f"case {case.name}: unknown mutant {case.mutant!r}; known {sorted(MUTANTS)}")
    return chosen


# ---------------------------------------------------------------- judging a case


def routed_and_seen(counters: dict[str, Any], patch: str) -> tuple[int, int]:
    """Return (calls_routed, calls_seen) of ``patch`` from a run's summed counters."""
    own = counters.get(patch, {})
    return int(own.get("calls_routed", 0)), int(own.get("calls_seen", 0))


def layer_prefill_backends(ledgers: list[dict[str, Any]], patch: str) -> list[str]:
    """Return the prefill backend every routed layer's plan fact names, across the patched processes (sorted)."""
    return sorted(str(fact.get("prefill_backend")) for ledger in ledgers
                  for fact in ((ledger.get("facts") or {}).get(patch) or {}).values()
                  if isinstance(fact, dict) and "plan_kind" in fact)


def patched_ledgers(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the ledgers of a regress report's patched run (every process's)."""
    return (report.get("runs", {}).get("patched") or {}).get("ledgers", [])


def seam_stood_aside(ledgers: list[dict[str, Any]], patch: str, seam: str) -> tuple[bool, str]:
    """Return whether the patched processes left ``seam`` alone, visibly: no process applied it, and at least one
    recorded it ``not-applicable`` with the stand-aside reason (the process that imported the layer's module)."""
    records = [target for ledger in ledgers
               if (target := (((ledger.get("patches") or {}).get(patch) or {}).get("targets") or {}).get(seam))]
    if any(record.get("state") == "applied" for record in records):
        return False, f"{patch} applied {seam} in a patched process though it should stand aside"
    if not any(record.get("state") == "not-applicable" and "stands aside" in record.get("reason", "")
               for record in records):
        return False, f"no patched process recorded {seam} as standing aside: {records or 'no record'}"
    return True, ""


def layers_stood_aside(ledgers: list[dict[str, Any]], patch: str, backend: str) -> tuple[bool, str]:
    """Return whether the patched processes' layers of ``patch`` all stood aside on ``backend``, visibly: at least
    one ``stands-aside`` layer fact, each on ``backend`` with a reason, and no layer with a plan."""
    facts = [fact for ledger in ledgers for fact in ((ledger.get("facts") or {}).get(patch) or {}).values()
             if isinstance(fact, dict) and ("plan_kind" in fact or fact.get("decision") == "stands-aside")]
    planned = [fact for fact in facts if "plan_kind" in fact]
    aside = [fact for fact in facts if fact.get("decision") == "stands-aside"]
    if planned or not aside:
        return False, f"{len(planned)} layer(s) with a plan, {len(aside)} standing aside (expected none, some)"
    wrong = sorted({str(fact.get("backend")) for fact in aside if fact.get("backend") != backend
                    or not fact.get("reason")})
    if wrong:
        return False, f"layers standing aside on {wrong} or without a reason, expected {backend}"
    return True, f"{len(aside)} layer facts stand aside on {backend}"


def plans_launched_with_pdl(ledgers: list[dict[str, Any]]) -> tuple[bool, str]:
    """Return whether the patched processes' state-copy plans were compiled with PDL: at least one layer's ledger
    fact, and every one of them, says ``pdl: true``."""
    facts = [(name, fact) for ledger in ledgers
             for name, fact in ((ledger.get("facts") or {}).get(STATE_COPY_SECTION) or {}).items()
             if isinstance(fact, dict) and "pdl" in fact]
    if not facts:
        return False, "no patched process recorded a state-copy plan (no layer fact with pdl)"
    plain = sorted({name for name, fact in facts if fact["pdl"] is not True})
    if plain:
        return False, f"a PDL case, but the plans of {plain} launch plainly"
    return True, f"{len(facts)} layer plan(s) with PDL"


def judge_case(case: Case, report: dict[str, Any], outputs: dict[str, Any]) -> tuple[bool, str]:
    """Return (passed, why) for one case's regress report and the facts of its kept outputs.

    A case passes when its verdict is the expected one (``equal``; ``different`` for a negative control); the
    patched run routed every seam call it saw, at least one (``calls_routed == calls_seen > 0`` for the model's
    patch; a negative control must have routed calls too: a mutant that never ran proves nothing) -- or, for a case
    that stands aside, saw none and recorded the seam as standing aside (:func:`seam_stood_aside`); with prefix
    caching on, the continuation of round two was served from the cache (``cached_prompt_tokens > 0``); a case
    with a small cache (``kv_blocks``) preempted at least once; with vLLM 0.34's extensible cache on, the routed
    patch republished its plans after the rebind (``rebinds > 0``), and with it off, never; a case that watches
    vLLM's JIT monitor (``jit_watch``) passes :func:`judge_jit`; a PDL case's plans were compiled with PDL
    (:func:`plans_launched_with_pdl`); a case at vLLM's defaults found its layers on the backend vLLM picks there
    (:data:`AT_DEFAULTS`); calls a breakable CUDA-graph capture ran (``<patch>:capture``) were all
    routed; a no-copy case (``state_io="indexed"``) indexed every routed call. A scenario the case claims but did
    not produce is a failure, never a pass.
    """
    verdict = report.get("verdict", "error")
    patch = MODELS[case.model].patch
    counters = report.get("patched_counter_totals") or {}
    routed, seen = routed_and_seen(counters, patch)
    if verdict != case.expected:
        return False, f"verdict {verdict}, expected {case.expected}"
    if case.stands_aside:
        seam = MODELS[case.model].seam or ""
        if seen or routed:
            return False, f"{patch} saw {seen} calls (routed {routed}) though it should stand aside on {seam}"
        aside, why = seam_stood_aside(patched_ledgers(report), patch, seam)
        if not aside:
            return False, why
    elif case.aside_on_backend:
        upstream = int((counters.get(patch) or {}).get("calls_upstream", 0))
        aside, aside_note = layers_stood_aside(patched_ledgers(report), patch, case.aside_on_backend)
        if seen or routed or not upstream:
            return False, (f"{patch} should stand aside on every {case.aside_on_backend} layer: seen {seen}, routed "
                           f"{routed}, left to upstream {upstream}")
        if not aside:
            return False, aside_note
    elif seen == 0 or routed == 0:
        return False, f"{patch} routed {routed} of {seen} seen: the state copy never ran"
    elif not case.mutant and routed != seen:
        return False, f"{patch} routed {routed} of {seen} seen (a bypassed call)"
    patched = outputs.get("patched", {})
    hit = patched.get("cached_prompt_tokens", {}).get(CONTINUATION)
    if case.prefix_caching and not hit:
        return False, f"prefix caching on, but {CONTINUATION} found {hit} cached prompt tokens: no prefix-cache hit"
    preemptions = (patched.get("engine_stats") or {}).get("preemptions")
    if case.kv_blocks and not preemptions:
        return False, f"{case.kv_blocks} KV blocks, but the engine reported {preemptions} preemptions"
    rebinds = int((counters.get(patch) or {}).get("rebinds", 0))
    if case.extensible and not (case.stands_aside or case.aside_on_backend) and rebinds == 0:
        return False, f"the extensible KV cache was on, but {patch} republished no plan after the rebind"
    if case.extensible is False and rebinds:
        return False, f"the extensible KV cache was off, but {patch} rebound {rebinds} layer(s)"
    notes = ""  # what the JIT watch and the PDL check found, appended to the verdict
    if case.jit_watch:
        quiet, why = judge_jit(outputs)
        if not quiet:
            return False, why
        notes = f"; {why}"
    if case.pdl:
        launched, why = plans_launched_with_pdl(patched_ledgers(report))
        if not launched:
            return False, why
        notes += f"; {why}"
    if case.aside_on_backend:
        notes += f"; {aside_note}"
    elif case.at_defaults and case.model in AT_DEFAULTS:
        wanted = AT_DEFAULTS[case.model].prefill
        ran = layer_prefill_backends(patched_ledgers(report), patch)
        if set(ran) != {wanted}:
            return False, f"at vLLM's defaults the layers should prefill with {wanted}, the ledgers say {ran}"
        notes += f"; every routed layer prefilled with {wanted}"
    captured = counters.get(f"{patch}:capture") or {}
    if captured:  # breakable CUDA-graph capture's eager runs of dummy batches, routed and counted apart
        if int(captured.get("calls_routed", 0)) != int(captured.get("calls_seen", 0)):
            return False, (f"{patch} at graph capture routed {captured.get('calls_routed')} of "
                           f"{captured.get('calls_seen')}")
        notes += f"; at graph capture routed {captured.get('calls_routed', 0)} == seen {captured.get('calls_seen', 0)}"
    indexed = int((counters.get(patch) or {}).get("calls_indexed", 0))
    if case.state_io == "indexed":  # no copy: every routed call ran the indexed twin
        if indexed != routed:
            return False, f"{patch} indexed {indexed} of {routed} routed calls (KDA_PATCHES_STATE_IO=indexed)"
        notes += f"; indexed {indexed} == routed"
    elif case.wide:  # the default's auto: the wide step ran the twin, the narrower prefills copied
        if not 0 < indexed < routed:
            return False, (f"{patch} indexed {indexed} of {routed} routed calls: the wide round should run the "
                           "twin and the narrower prefills the plan's copy")
        notes += f"; indexed {indexed} of {routed} routed (the wide step), the rest copied"
    if case.stands_aside:
        return True, f"{verdict}; {patch} stands aside on {MODELS[case.model].seam} (0 calls seen){notes}"
    if case.aside_on_backend:
        return True, f"{verdict}; {patch} left {upstream} calls to upstream (0 seen){notes}"
    return True, (f"{verdict}; {patch} routed {routed} == seen {seen}" + (f"; rebinds {rebinds}" if rebinds else "")
                  + notes)


def judge_ranks(case: Case, report: dict[str, Any]) -> tuple[bool, str]:
    """For a case on several GPUs: did every rank route through its own plans on its own GPU?

    Every rank check of the A/B met (a patched ledger from each worker and the engine core), and each worker's own
    ledger shows ``calls_routed == calls_seen > 0`` for the model's patch (a negative control: routed calls) with
    every plan on one device: ``cuda:<rank>`` for ``VllmWorker-<rank>`` of the mp executor; for the Ray executor,
    whose actors each see their own GPU as ``cuda:0`` and carry no rank in their name, ``tp`` actor ledgers with one
    device each. One GPU: nothing to judge.
    """
    if case.tp == 1:
        return True, ""
    patch = MODELS[case.model].patch
    unmet = [f"{check.get('label')}: {check.get('detail')}" for check in report.get("ranks", [])
             if not check.get("met")]
    if unmet or not report.get("ranks"):
        return False, f"ranks not all patched: {'; '.join(unmet) or 'no rank check in the report'}"
    ledgers = patched_ledgers(report)
    if case.executor == "ray":
        workers = [ledger for ledger in ledgers if any(RAY_WORKER_MARK in str(arg) for arg in ledger.get("argv", []))]
        if len(workers) != case.tp:
            return False, f"{len(workers)} Ray actor ledgers, expected {case.tp}"
        expected = [None] * case.tp
    else:
        by_role = {ledger.get("role"): ledger for ledger in ledgers}
        workers = [by_role.get(f"VllmWorker-{rank}") for rank in range(case.tp)]
        expected = [f"cuda:{rank}" for rank in range(case.tp)]
    parts = []
    for rank, (ledger, device) in enumerate(zip(workers, expected, strict=True)):
        if ledger is None:
            return False, f"rank {rank}: no ledger from VllmWorker-{rank}"
        routed, seen = routed_and_seen(ledger.get("counters") or {}, patch)
        if routed == 0 or (not case.mutant and routed != seen):
            return False, f"rank {rank}: {patch} routed {routed} of {seen} seen"
        devices = {fact["signature"][0] for fact in ((ledger.get("facts") or {}).get(STATE_COPY_SECTION) or {}).values()
                   if isinstance(fact, dict) and fact.get("signature")}
        if len(devices) != 1 or (device is not None and devices != {device}):
            return False, f"rank {rank}: plans prepared on {sorted(devices) or 'no device'}, expected " \
                          f"{device or 'one device'}"
        parts.append(f"rank {rank} {routed} == {seen} on {next(iter(devices))}")
    return True, "; ".join(parts)


JIT_MONITOR_ON = "Kernel JIT monitor activated"
JIT_EVENT = re.compile(r"\] ([^\]\n]+?) during inference: (.+?)\. This causes a latency spike")


def jit_compiles(log: str) -> dict[str, Any]:
    """Return what vLLM's JIT monitor (>= 0.34) reported in one process tree's log.

    Returns:
        ``{"monitor_on": bool, "events": [sorted "backend event: kernel (detail)" strings]}``; the monitor logs each
        distinct event once (mode warn).
    """
    events = sorted({f"{what}: {kernel}" for what, kernel in JIT_EVENT.findall(log)})
    return {"monitor_on": JIT_MONITOR_ON in log, "events": events}


def summarize_outputs(work: pathlib.Path) -> dict[str, Any]:
    """Digests and facts of the kept outputs: per side the sha256 of the requests, cached tokens, preemptions, and
    the JIT compiles while serving that its log reports (:func:`jit_compiles`)."""
    import hashlib

    summary: dict[str, Any] = {}
    for side in sorted(p for p in work.iterdir() if (p / "outputs.json").is_file()) if work.is_dir() else []:
        outputs = json.loads((side / "outputs.json").read_text())["outputs"]
        requests = outputs.get("requests", [])
        log = side / "run.log"
        summary[side.name] = {
            "requests_sha256": hashlib.sha256(json.dumps(requests, sort_keys=True).encode()).hexdigest(),
            "tokens": {r["name"]: r["token_ids"] for r in requests},
            "cached_prompt_tokens": {r["name"]: r["cached_prompt_tokens"] for r in requests},
            "engine_stats": outputs.get("engine_stats"), "engine": outputs.get("engine"),
            "jit": jit_compiles(log.read_text(errors="replace") if log.is_file() else "")}
    return summary


def judge_jit(outputs: dict[str, Any]) -> tuple[bool, str]:
    """For a ``jit_watch`` case: the JIT monitor was on in the patched run, and it compiled nothing while serving
    that the baseline did not (what the baseline compiles is vLLM's own warm-up gap, reported, not judged)."""
    patched = (outputs.get("patched") or {}).get("jit") or {}
    baseline = (outputs.get("baseline") or {}).get("jit") or {}
    if not patched.get("monitor_on") or not baseline.get("monitor_on"):
        return False, "vLLM's JIT monitor was not activated in both runs: nothing shows what compiled while serving"
    extra = sorted(set(patched.get("events", [])) - set(baseline.get("events", [])))
    if extra:
        return False, f"the patched run JIT-compiled while serving what the baseline did not: {extra}"
    return True, f"no JIT compile while serving beyond the baseline's {len(baseline.get('events', []))}"


def run_case(case: Case, out: pathlib.Path, model_dirs: dict[str, pathlib.Path],
             prompts: dict[str, pathlib.Path], hook: pathlib.Path, site: pathlib.Path,
             timeout_s: float) -> dict[str, Any]:
    """Run one case's regress to the end and return its record (report, judgment, digests, wall time)."""
    work = pathlib.Path(gpu_harness.TMP) / "kda-engine-work" / case.name
    params = engine_params(case, model_dirs[case.model], prompts[case.prompt_set])
    env = case_env(case, hook, site)
    env[ENV_RECORD_ENV] = str(work / "envs")
    started = time.perf_counter()
    record: dict[str, Any] = {"case": asdict(case), "model_note": MODELS[case.model].note, "params": params,
                              "overrides": case_overrides(case, params, env)}
    try:
        done = subprocess.run(regress_argv(case, params, work), env=env, capture_output=True, text=True,
                              timeout=timeout_s, cwd=ROOT)
        record["exit_code"] = done.returncode
        try:
            record["report"] = json.loads(done.stdout)
        except json.JSONDecodeError:
            record["report"] = {"verdict": "error", "errors": [f"regress printed no JSON: {done.stderr[-3000:]}"]}
    except subprocess.TimeoutExpired:
        record["report"] = {"verdict": "error", "errors": [f"regress ran past {timeout_s:.0f} s"]}
    record["wall_s"] = round(time.perf_counter() - started, 1)
    record["outputs"] = summarize_outputs(work)
    record["passed"], record["why"] = judge_case(case, record["report"], record["outputs"])
    if case.tp > 1:
        ranks_ok, ranks_why = judge_ranks(case, record["report"])
        envs_ok, envs_why = check_process_envs(work / "envs")
        record["passed"] = record["passed"] and ranks_ok and envs_ok
        record["why"] = f"{record['why']}; {ranks_why}; {envs_why}"
    logs, startup = {}, {}
    for side in ("baseline", "baseline2", "patched"):
        log = work / side / "run.log"
        if log.is_file():
            text = log.read_text(errors="replace")
            logs[side] = text[-5000:]
            startup[side] = read_startup_s(text)
    record["log_tails"], record["engine_startup_s"] = logs, startup
    return record


def read_startup_s(log_text: str) -> float | None:
    """Return the engine start-up time the vllm workload printed in a run's log, or None."""
    found = STARTUP_LINE.findall(log_text)
    return float(found[-1]) if found else None




def engine_line(record: dict[str, Any]) -> str:
    """One ``ENGINE`` line of a case's record."""
    case, report = record["case"], record["report"]
    runs = report.get("runs", {})
    walls = "/".join(f"{(runs.get(side) or {}).get('wall_s') or 0:.0f}" for side in ("baseline", "baseline2",
                                                                                    "patched"))
    patched = record["outputs"].get("patched", {})
    hit = patched.get("cached_prompt_tokens", {}).get(CONTINUATION)
    stats = patched.get("engine_stats") or {}
    errors = "; ".join(report.get("errors", []))[:400]
    startup = "/".join(str(record.get("engine_startup_s", {}).get(side)) for side in ("baseline", "baseline2",
                                                                                       "patched"))
    paths = [f"{item['name']}={item['value']}" for item in record.get("overrides", []) if item["kind"] == "path"]
    label = f"[non-default: {', '.join(paths)}]" if paths else "[vLLM's defaults]"
    return (f"ENGINE {case['name']} {label}: {'PASS' if record['passed'] else 'FAIL'} ({record['why']}); prefix hit "
            f"{hit} tokens; preemptions {stats.get('preemptions')}; wall s base/base2/patched {walls}; engine "
            f"start-up s {startup}" + (f"; errors: {errors}" if errors else ""))


BENCH_VOCAB = 10240  # vLLM's random dataset draws ids from the tokenizer's vocabulary
# The random dataset's own length options: vLLM 0.33's `bench throughput` ignores --input-len / --output-len for it
# (run 4 measured its defaults, 1024 + 128, under both shapes' names); serve-ab now fails a run whose printed token
# totals differ from these. The request counts make the timed region several seconds of a ~55 s engine process.
THROUGHPUT_SHAPES = {
    "short": (("--random-input-len", "64", "--random-output-len", "32", "--num-prompts", "8192",
               "--max-num-seqs", "256"),
              "many short prompts: 8192 requests of 64 prompt + 32 output tokens, 256 at a time"),
    "long": (("--random-input-len", "2048", "--random-output-len", "64", "--num-prompts", "512",
              "--max-num-seqs", "128"),
             "state copies a real share of the step: 512 requests of 2048 prompt + 64 output tokens, 128 at a time, "
             "GDN heads of Qwen3.6-27B at TP4 (12 value x 128 x 128)"),
    "long-tp2": (("--random-input-len", "2048", "--random-output-len", "64", "--num-prompts", "512",
                  "--max-num-seqs", "128", "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
                 "the long shape on two GPUs (issue 29): tensor parallel 2, mp executor"),
    # issue 50: Kimi K3 as vLLM 0.34 serves it by default on SM90 (needs --with-flashkda): many short prefills
    "kimi_k3-short-defaults": (("--random-input-len", "64", "--random-output-len", "32", "--num-prompts", "4096",
                                "--max-num-seqs", "256"),
                               "Kimi K3 (every layer KDA, 12 heads x 128) at vLLM 0.34's defaults: no backend argument "
                               "(FlashKDA prefill, native decode), torch.compile + breakable CUDA graphs; 4096 "
                               "requests of 64 prompt + 32 output tokens, 256 at a time"),
    # needs --with-moe --with-flashinfer
    "qwen3_next-short-defaults": (("--random-input-len", "64", "--random-output-len", "32", "--num-prompts", "4096",
                                   "--max-num-seqs", "256"),
                                  "Qwen3-Next (MoE GDN hybrid) at vLLM 0.34's defaults: no backend argument "
                                  "(FlashInfer GDN prefill, which the Qwen seam stands aside on), torch.compile + "
                                  "piecewise CUDA graphs; 4096 requests of 64 prompt + 32 output tokens, 256 at a "
                                  "time"),
}
# the model a shape serves (default qwen3_5), and the shapes that set no backend argument (vLLM picks them)
SHAPE_MODELS = {"kimi_k3-short-defaults": "kimi_k3", "qwen3_next-short-defaults": "qwen3_next"}
SHAPES_AT_DEFAULTS = frozenset({"kimi_k3-short-defaults", "qwen3_next-short-defaults"})


def shape_backend_args(shape: str) -> dict[str, Any]:
    """The backend engine arguments a throughput shape forces (none for a shape at vLLM's defaults)."""
    if shape in SHAPES_AT_DEFAULTS:
        return {}
    return {"attention_backend": "TRITON_ATTN", "additional_config": {"gdn_prefill_backend": "triton"}}


def write_bench_model(root: pathlib.Path, model: str = "qwen3_5") -> pathlib.Path:
    """Write a throughput model: :data:`MODELS` ``model`` with a word-level tokenizer (``vllm bench`` needs one).

    The vocabulary grows to :data:`BENCH_VOCAB`; the layers are the A/B model's.
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from kda_patches.regress.tiny_model import build_tiny_tokenizer

    path = root / f"{model}_bench"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(MODELS[model].config, vocab_size=BENCH_VOCAB)))
    build_tiny_tokenizer(str(path), BENCH_VOCAB)
    return path


def throughput_argv(shape: str, model_dir: pathlib.Path, rounds: int, out: pathlib.Path,
                    time_budget_s: float | None = None) -> list[str]:
    """``kda-patches bench serve-ab`` over vLLM's ``bench throughput`` for one of :data:`THROUGHPUT_SHAPES`.

    ``--resume`` when ``out`` already holds a serve-ab document (an earlier call on the same warm machine stopped
    before the last round), else ``--warmup`` (each side once, unmeasured: a fresh machine's compile caches are cold);
    ``--time-budget`` when given, so a call ends between rounds, not inside one.

    vLLM's defaults otherwise (torch.compile and CUDA graphs on, prefix caching on), dummy weights (the output
    length is fixed: the random dataset ignores EOS), the attention and GDN backends the carried code has
    (:func:`shape_backend_args`; none for a shape at vLLM's defaults); vLLM's
    benchmark module itself (``--entry module``: its CLI imports the API server's packages, which are not carried).
    """
    continuing = ["--resume"] if (out / "serve_ab.json").is_file() else ["--warmup"]
    budget = ["--time-budget", f"{time_budget_s:.0f}"] if time_budget_s is not None else []
    return [sys.executable, "-m", "kda_patches", "bench", "serve-ab", "--rounds", str(rounds), "--out", str(out),
            "--timeout", "300", "--entry", "module", *continuing, *budget, "--", "throughput",
            "--model", str(model_dir),
            "--load-format", "dummy", "--dataset-name", "random", *THROUGHPUT_SHAPES[shape][0],
            "--max-model-len", "4096", "--seed", "0", "--gpu-memory-utilization", "0.6",
            *(item for name, value in shape_backend_args(shape).items()
              for item in (f"--{name.replace('_', '-')}", value if isinstance(value, str) else json.dumps(value)))]


# engine_repeat's arms for finding which patch costs engine time (baseline first and last is implied)
BISECT_ARMS = ("patched", "only-gdn_host_flags:KDA_PATCHES_ONLY=gdn_host_flags",
               "only-gdn_state_copy:KDA_PATCHES_ONLY=gdn_state_copy",
               "only-kv_cache_layout:KDA_PATCHES_ONLY=kv_cache_layout")
# a throughput shape's `vllm bench throughput` options -> engine_repeat's child options
_REPEAT_OPTIONS = {"--random-input-len": "--input-len", "--random-output-len": "--output-len",
                   "--num-prompts": "--num-prompts", "--max-num-seqs": "--max-num-seqs"}
_REPEAT_ENGINE_ARGS = {"--tensor-parallel-size": "tensor_parallel_size",
                       "--distributed-executor-backend": "distributed_executor_backend"}


PEER_SHAPES = "qwen3.6-27b-tp4=12,128,128;kimi-linear-48b-tp1=32,128,128"


def peer_argv(vllm_version: str, output: pathlib.Path, seed: int = 0) -> list[str]:
    """``kda-patches bench peer`` with upstream vLLM's own GDN state-copy ops of the unpacked release beside the
    plan and the plan with programmatic dependent launch (issue 27 deliverable 3): Qwen3.6-27B's GDN heads at TP4
    and Kimi-Linear-48B's KDA heads on one GPU. ``seed`` picks indices, flags, data and the shuffled capture
    order; a second seed tells a capture's placement (which repeats under one seed) from a kernel's cost."""
    return [sys.executable, "-m", "kda_patches", "bench", "peer", "--release", f"vllm=={vllm_version}",
            "--output", str(output), "--device", "cuda", "--shapes", PEER_SHAPES, "--pdl", "--seed", str(seed)]


def bisect_argv(shape: str, model_dir: pathlib.Path, out: pathlib.Path, arms: list[str], repeats: int,
                num_prompts: int | None = None, profile: bool = False, interleave: int | None = None,
                cpus: str | None = None) -> list[str]:
    """``python -m kda_patches.bench.engine_repeat`` for one of :data:`THROUGHPUT_SHAPES`: the shape's requests
    (``num_prompts`` overrides their count) and the engine settings :func:`throughput_argv` gives vLLM's benchmark.
    ``interleave``: that many cycles with every arm's engine alive at once (engine_repeat shares the memory);
    ``cpus``: every arm's processes pinned to these same host cores (interleaved runs).

    Raises:
        ValueError: the shape has an option engine_repeat has no counterpart for.
    """
    options = list(THROUGHPUT_SHAPES[shape][0])
    child = ["--model", str(model_dir), "--repeats", str(repeats), "--max-model-len", "4096", "--seed", "0"]
    for flag, value in zip(options[::2], options[1::2], strict=True):
        if flag in _REPEAT_OPTIONS:
            child += [_REPEAT_OPTIONS[flag], str(num_prompts) if flag == "--num-prompts" and num_prompts else value]
        elif flag in _REPEAT_ENGINE_ARGS:
            setting = json.dumps(int(value) if value.isdigit() else value)
            child += ["--engine-arg", f"{_REPEAT_ENGINE_ARGS[flag]}={setting}"]
        else:
            raise ValueError(f"shape {shape}: option {flag} has no engine_repeat counterpart")
    child += ["--engine-arg", "gpu_memory_utilization=0.6",
              *(item for name, value in shape_backend_args(shape).items()
                for item in ("--engine-arg", f"{name}={json.dumps(value)}"))]
    mode = (["--interleave", str(interleave)] if interleave else []) + (["--cpus", cpus] if cpus else [])
    return [sys.executable, "-m", "kda_patches.bench.engine_repeat", "--out", str(out), *(["--profile"] * profile),
            *mode, *(item for arm in arms for item in ("--arm", arm)), "--", *child]


def shape_gpus(shape: str) -> int:
    """Return how many GPUs a throughput shape uses (its ``--tensor-parallel-size``, else 1)."""
    args = THROUGHPUT_SHAPES[shape][0]
    return int(args[args.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in args else 1


def run_throughput(shape: str, out: pathlib.Path, model_dir: pathlib.Path, hook: pathlib.Path,
                   site: pathlib.Path, rounds: int, gpus: int = 1, time_budget_s: float | None = None
                   ) -> dict[str, Any]:
    """Run one throughput shape's serve-ab; return its summary (ratios per metric), rounds done and exit status.

    A shape that needs more GPUs than ``gpus`` is not run: its record says so (``exit_code`` None). Exit status 3
    is serve-ab stopping for ``time_budget_s`` between rounds: the same command continues it.
    """
    missing = not_carried(SHAPE_MODELS.get(shape, "qwen3_5"), shape in SHAPES_AT_DEFAULTS, site)
    if shape_gpus(shape) > gpus or missing:
        why = (f"not run: needs {shape_gpus(shape)} GPUs, this machine has {gpus}" if not missing else
               f"not run: not carried: {', '.join(missing)}")
        return {"shape": shape, "what": THROUGHPUT_SHAPES[shape][1], "exit_code": None, "metrics": {},
                "problems": [why], "output_tail": ""}
    target = out / f"throughput-{shape}"
    env = bench_env(f"throughput-{shape}", hook, site, shape)
    done = subprocess.run(throughput_argv(shape, model_dir, rounds, target, time_budget_s), env=env,
                          capture_output=True, text=True, cwd=ROOT)
    result_file = target / "serve_ab.json"
    document = json.loads(result_file.read_text()) if result_file.is_file() else {}
    return {"shape": shape, "what": THROUGHPUT_SHAPES[shape][1], "exit_code": done.returncode,
            "rounds_done": document.get("rounds_done"), "rounds": rounds,
            "metrics": {name: {key: entry[key] for key in ("min", "median", "max", "ratios")}
                        for name, entry in (document.get("metrics") or {}).items()},
            "problems": document.get("problems"), "output_tail": (done.stdout + done.stderr)[-3000:]}


def throughput_line(result: dict[str, Any]) -> str:
    """One ``THROUGHPUT`` line: patched/baseline tokens/s and requests/s, min/median/max."""
    parts = [f"{name} {entry['min']:.3f}/{entry['median']:.3f}/{entry['max']:.3f}"
             for name, entry in result["metrics"].items() if name in ("tokens_per_second", "requests_per_second",
                                                                     "output_tokens_per_second")]
    done = f"{result.get('rounds_done')} of {result.get('rounds')} rounds" + (
        " (stopped for time: run the same command again to continue)" if result["exit_code"] == 3 else "")
    return (f"THROUGHPUT {result['shape']}: exit {result['exit_code']}, {done}; patched/baseline min/median/max "
            + ("; ".join(parts) or "none") + (f"; problems {result['problems']}" if result["problems"] else ""))


def report_version(prepared: dict[str, Any] | None, stage: pathlib.Path | None = None) -> str | None:
    """Return the vLLM version a report names: the unpacked bundle's own ``vllm_version``.

    Args:
        prepared: ``gpu_harness.prepare_site``'s result, or None before anything is unpacked (a dry run): then the
            version of the carry staged in ``stage`` (default ``gpu_harness.STAGE_DIR``), None when none is.
    Raises:
        RuntimeError: the unpacked bundle names no version (a bundle older than the manifest's field).
    """
    if prepared is None:
        return gpu_harness.staged_version(stage or gpu_harness.STAGE_DIR)
    version = prepared.get("vllm_version") or prepared["bundle"].get("vllm_version")
    if not version:
        raise RuntimeError(f"the bundle {prepared.get('bundle_file')} names no vllm_version: rebuild it with "
                           "vllm_bundle.py carry")
    return version


def run_parent(args: argparse.Namespace) -> int:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = validate_cases(args.cases)
    model_dirs = {name: write_model_dir(name, out / "models") for name in sorted({c.model for c in cases})}
    prompts = {"default": out / "prompts.jsonl", "preempt": out / "prompts-preempt.jsonl",
               "wide": out / "prompts-wide.jsonl"}
    for name, path in prompts.items():
        write_prompts(path, preempt=name == "preempt", wide=name == "wide")
    site = gpu_harness.SITE_DIR
    models = {name: asdict(spec) for name, spec in MODELS.items()}
    report: dict[str, Any] = {"vllm": report_version(None), "models": models, "not_run": {}, "mutants": MUTANTS,
                              "weight_seed": WEIGHT_SEED, "cases": [asdict(c) for c in cases], "runs": []}
    if args.dry_run:
        report["stood_in"] = gpu_harness.stood_in_record(library=False)
        report["plan"] = {c.name: regress_argv(c, engine_params(c, model_dirs[c.model], prompts[c.prompt_set]),
                                               pathlib.Path("WORK")) for c in cases}
        report["throughput_plan"] = {
            shape: throughput_argv(shape, out / "models" / f"{SHAPE_MODELS.get(shape, 'qwen3_5')}_bench", args.rounds,
                                   out / f"throughput-{shape}") for shape in THROUGHPUT_SHAPES}
        report["peer_plan"] = peer_argv("VERSION", out / "peer.json")
        report["bisect_plan"] = {shape: bisect_argv(shape, out / "models" / "qwen3_5_bench", out / f"bisect-{shape}",
                                                    args.arms, args.repeats, args.num_prompts)
                                 for shape in THROUGHPUT_SHAPES}
        (out / "vllm_engine.json").write_text(json.dumps(report, indent=1))
        print(f"DRYRUN {len(cases)} cases, models {sorted(model_dirs)}; no engine started")
        return 0
    staged = gpu_harness.stage_pieces(pathlib.Path(args.carried), gpu_harness.STAGE_DIR) if args.carried else None
    prepared = gpu_harness.prepare_site(None, site, gpu_harness.STAGE_DIR)
    report["vllm"], report["bundle"] = report_version(prepared), prepared["bundle"]
    library = gpu_harness.library_present(site)
    report["compiled_library"] = "vLLM's real _C_stable_libtorch" if library else "ABSENT: op stand-ins declared"
    report["stood_in"] = gpu_harness.stood_in_record(library, site)
    if not library:
        report["stood_in"].update({f"torch.ops._C.{name}": why for name, why in {**OP_LOOKUP_ONLY,
                                                                                 **OP_STAND_INS}.items()})
    report["staged"] = staged and {key: staged[key] for key in ("have", "missing")}
    hook = gpu_harness.write_stand_in_hook(site.with_name(site.name + "-engine-hook"), "vllm_engine_check",
                                           "install_engine_stand_ins")
    if args.peer:
        env = bench_env("peer", hook, site)
        argv = peer_argv(report["vllm"], out / "peer.json", args.peer_seed)
        print(" ".join(argv), flush=True)
        return subprocess.run(argv, env=env, cwd=ROOT).returncode
    if args.bisect:
        target = out / f"bisect-{args.bisect}"
        env = bench_env(f"bisect-{args.bisect}", hook, site, args.bisect)
        env[STEP_TIMES_ENV] = "1"
        model = write_bench_model(out / "models", SHAPE_MODELS.get(args.bisect, "qwen3_5"))
        argv = bisect_argv(args.bisect, model, target, args.arms, args.repeats, args.num_prompts, args.profile,
                           args.interleave, args.cpus)
        return subprocess.run(argv, env=env, cwd=ROOT).returncode
    if args.throughput:
        report["throughput"] = []
        import torch

        started = time.monotonic()
        for shape in args.throughput:
            left = None if args.time_budget_s is None else args.time_budget_s - (time.monotonic() - started)
            bench_model = write_bench_model(out / "models", SHAPE_MODELS.get(shape, "qwen3_5"))
            result = run_throughput(shape, out, bench_model, hook, site, args.rounds, torch.cuda.device_count(), left)
            report["throughput"].append(result)
            print(throughput_line(result), flush=True)
            (out / "vllm_engine.json").write_text(json.dumps(report, indent=1, default=str))
        if not args.cases:
            return 0 if all(result["exit_code"] in (0, 3, None) for result in report["throughput"]) else 1
    import torch

    cases, report["not_run"] = runnable(cases, site, torch.cuda.device_count(), report["vllm"])
    for name, why in report["not_run"].items():
        print(f"ENGINE {name}: NOT RUN ({why})", flush=True)
    print(f"vLLM {report['vllm']}; compiled library: {report['compiled_library']}; {len(cases)} cases, "
          f"{args.parallel} at a time", flush=True)
    (out / "vllm_engine.json").write_text(json.dumps(report, indent=1, default=str))  # also when none can run
    for wave, workers in schedule_cases(cases, args.parallel):
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(run_case, case, out, model_dirs, prompts, hook, site, args.case_timeout_s)
                       for case in wave]
            for future in futures:
                record = future.result()
                report["runs"].append(record)
                print(engine_line(record), flush=True)
                (out / "vllm_engine.json").write_text(json.dumps(report, indent=1, default=str))
    return 0 if all(record["passed"] for record in report["runs"]) else 1


def schedule_cases(cases: list[Case], parallel: int) -> list[tuple[list[Case], int]]:
    """Return the waves to run, in order, each with its number of cases at a time.

    The cases with a fixed KV budget share one wave, ``parallel`` at a time; every case that profiles the GPU's
    memory (:attr:`Case.profiles_memory`) then runs alone, one after the other.
    """
    shared = [case for case in cases if not case.profiles_memory]
    waves = [(shared, max(1, min(parallel, len(shared))))] if shared else []
    return waves + [([case], 1) for case in cases if case.profiles_memory]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="+", help=f"default: all {len(CASES)}")
    parser.add_argument("--carried", help="a run folder of vllm_bundle.py carry to stage first")
    parser.add_argument("--parallel", type=int, default=4, help="cases at a time (each its own engines)")
    parser.add_argument("--case-timeout-s", type=float, default=500)
    parser.add_argument("--throughput", nargs="+", choices=sorted(THROUGHPUT_SHAPES),
                        help="run serve-ab for these shapes first (alone on the GPU); no case unless --cases")
    parser.add_argument("--rounds", type=int, default=5, help="serve-ab rounds per throughput shape")
    parser.add_argument("--time-budget-s", type=float,
                        help="seconds for all throughput shapes: serve-ab starts no round that would end later; "
                             "the same command in the next call (machine still warm) continues where it stopped")
    parser.add_argument("--peer", action="store_true",
                        help="instead of cases: `bench peer` with the unpacked release's own GDN state-copy ops")
    parser.add_argument("--peer-seed", type=int, default=0, help="--peer's `bench peer --seed`")
    parser.add_argument("--bisect", choices=sorted(THROUGHPUT_SHAPES),
                        help="instead of cases: engine_repeat over this shape's requests, the baseline and --arms "
                             "(one engine per arm, --repeats timed passes each, step times on)")
    parser.add_argument("--arms", nargs="+", default=list(BISECT_ARMS), help="engine_repeat arms for --bisect")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per arm for --bisect")
    parser.add_argument("--num-prompts", type=int, help="--bisect: this many requests instead of the shape's")
    parser.add_argument("--interleave", type=int, metavar="CYCLES",
                        help="--bisect: every arm's engine alive at once, CYCLES cycles of one timed pass per arm "
                             "in shuffled order, ratios paired within a cycle, GPU clocks sampled (the H200 drifts "
                             "by more than the effect: run 6)")
    parser.add_argument("--cpus", help="--bisect --interleave: pin every arm's processes to these same host cores, "
                        "e.g. 2-9 (run 7: the H200 machine's host speed varies by core, its GPU does not)")
    parser.add_argument("--profile", action="store_true",
                        help="--bisect: each arm also runs one pass under vLLM's torch profiler (operator tables)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    try:
        validate_cases(args.cases)
    except ValueError as error:
        parser.error(str(error))
    return run_parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
