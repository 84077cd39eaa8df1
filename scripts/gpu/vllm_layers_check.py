"""vLLM's own GDN-family seam layers on the GPU (0.33, or 0.34 as staged), overlay off vs on: exactness and time.

Issues 9, 19 and 27 (on 0.34: the per-seam default, :func:`seam_default`). Runs vLLM's released layer code
(``KimiK3DeltaAttention._forward``,
``QwenGatedDeltaNetAttention._forward_core``, ``OlmoHybridGatedDeltaNetAttention._forward_core``,
``KimiGatedDeltaNetAttention._forward`` of Kimi Linear; :data:`KINDS`) with its real Triton kernels, brought
along as the bundle of ``scripts/gpu/vllm_bundle.py`` (vLLM's ``.py`` files + the wheels its import chain needs;
no ``vllm._C``).

Per layer, one child process (``KDA_PATCHES=1``, ``KDA_PATCHES_STRICT=1``, ``KDA_PATCHES_ONLY=<its patch>``)
builds the layer the way vLLM does: a real ``ModelConfig`` from a ``config.json`` written here, a
``VllmConfig`` set as current, single-rank distributed init (world size 1, TCP on 127.0.0.1), the layer's own
``get_kv_cache_spec``, vLLM's KV-cache planning (``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups``,
layout resolved by ``resolve_kv_cache_layout``), ``allocate_kv_cache`` and ``bind_kv_cache``; metadata from
vLLM's own builder (``KimiK3KDAMetadataBuilder`` / ``GDNAttentionMetadataBuilder``) on
``CommonAttentionMetadata`` of real batches, and ``set_forward_context``. The overlay's plans are prepared by
its startup hook's public entry (``kda_patches.routing.startup.prepare_and_publish``) on the real bound cache:
no ``GPUModelRunner`` is built (its ``initialize_kv_cache`` wrapper is the same call after vLLM's own steps).

The overlay is toggled through the registry: ``revert_patch`` (the original methods back) for the baseline,
``register_patch`` (the post-import hook re-applies at once) for the patched run. Each case runs both from the
same snapshot of the whole raw KV buffer; outputs and every byte of that buffer must be equal, and the ledger
must show ``calls_routed == calls_seen > 0`` for the patched prefills. A second child per layer with
``KDA_PATCHES=0`` (nothing registered) digests the same cases: its digests must equal the patched ones.
Timing: the layer call (``_forward`` / ``_forward_core``) for 1, 8, 64, 256 sequences of 512 new tokens
continuing 512 cached ones, CUDA events and synchronized wall time, medians over shuffled rounds.

On vLLM >= 0.34 the Qwen and Kimi Linear seams copy states with upstream's own ops and the overlay stands aside
there unless ``KDA_PATCHES_GDN_OPS=overlay``: the children get ``--gdn-ops`` (default ``overlay``, so the patched
side routes and the comparison is the plan against upstream's ops). ``--state-io indexed`` (the children's
``KDA_PATCHES_STATE_IO``, issue 51) makes the routed prefills read and store the cache rows in the chunk kernel: the
comparison is then no copy against upstream's ops, and every routed call must be indexed. Kimi K3's layer needs the
V1 runner's builder path (see ``RUNNER_NOTE``), which 0.34 no longer has: it is left out there by default, with the
reason in the report (:func:`layers_for`); the engine check runs it on 0.34.

Usage: ``python scripts/gpu/vllm_layers_check.py --out DIR [--bundle ZIP] [--dry-run] [--rounds N]``.
``--dry-run`` (CPU machine): same bundle for this interpreter, CPU platform, Triton interpreter, tiny shapes; it
imports, builds, allocates, binds and publishes the plans, and names where the CPU stops (the Kimi builder asserts
CUDA tensors; vLLM's Triton kernels are placeholders on its CPU platform). Run it in a clean interpreter that
mirrors the H200 image (its package list: the device tool's KINDS.md) and has no vLLM, e.g. ``python3 -m venv V &&
V/bin/pip install torch==2.13.0 numpy triton==3.6.0 transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2
safetensors einops cloudpickle psutil regex requests pyyaml packaging tqdm filelock sentencepiece tiktoken pytest
hypothesis pillow protobuf aiohttp typer rich click msgpack prometheus-client py-cpuinfo nvidia-ml-py wrapt``
(then ``pip uninstall pydantic pydantic-core annotated-types typing-inspection``, which one of those pulls in
and the image lacks), after ``vllm_bundle.py build --python-version 3.11``.
Writes ``DIR/vllm_layers.json`` and ``DIR/vllm_layers.log``; prints one verdict line per layer and batch.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import math
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_harness  # noqa: E402  (the shared carry, stand-in and cache machinery)

sys.path.remove(str(pathlib.Path(__file__).resolve().parent))
BUNDLE_DIR = ROOT / ".bundle"
SITE_DIR = gpu_harness.SITE_DIR


class LayerKind:
    """How one of vLLM's GDN-family seam layers is built and called (declarations; one mechanism below).

    Attributes:
        patch: the overlay patch whose seam wraps it.
        prefix: the layer's name in the static forward context.
        config: ``kimi_linear`` or ``qwen3_next``: which ``config.json`` (:func:`write_model_dir`) it is built on.
        module, cls: where vLLM defines the layer class.
        method: the seam method the check calls (``_forward`` / ``_forward_core``).
        inputs: ``kda`` (``mixed_qkv, g1, g2, beta``) or ``gdn`` (``mixed_qkv, b, a``), plus ``core_attn_out``.
        folds: its seam declares its final state's source (``Seam.final``): the cast is folded.
        v1_runner: the child selects vLLM's V1 model runner (see ``RUNNER_NOTE``).
        copy_form: how the released body copies its states, for ``--copy-costs``: ``gather_initial_states``
            (vLLM's fused gather kernel, then ``state[indices] = final``), or None (not timed alone).
    """

    __slots__ = ("cls", "config", "copy_form", "folds", "inputs", "method", "module", "patch", "prefix",
                 "v1_runner")

    def __init__(self, patch: str, prefix: str, config: str, module: str, cls: str, method: str, inputs: str,
                 folds: bool, v1_runner: bool = False, copy_form: str | None = None) -> None:
        self.patch, self.prefix, self.config, self.module, self.cls = patch, prefix, config, module, cls
        self.method, self.inputs, self.folds, self.v1_runner = method, inputs, folds, v1_runner
        self.copy_form = copy_form


_GDN = "vllm.model_executor.layers.mamba.gdn"
# Olmo hybrid is built on the Qwen3.6 TP4 head config: its layer reads the same linear_* fields, and the check
# then needs no OlmoHybrid config class in the image's transformers
KINDS = {
    "kimi_k3": LayerKind("kimi_prefill", "model.layers.1.self_attn", "kimi_linear", "vllm.models.kimi_k3.nvidia.kda",
                         "KimiK3DeltaAttention", "_forward", "kda", folds=False, v1_runner=True,
                         copy_form="gather_initial_states"),
    "qwen_gdn": LayerKind("gdn_state_copy", "model.layers.0.linear_attn", "qwen3_next",
                          f"{_GDN}.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention", "_forward_core", "gdn",
                          folds=True),
    "olmo_gdn": LayerKind("gdn_state_copy", "model.layers.0.linear_attn", "qwen3_next",
                          f"{_GDN}.olmo_gdn_linear_attn", "OlmoHybridGatedDeltaNetAttention", "_forward_core", "gdn",
                          folds=True),
    "kimi_linear_gdn": LayerKind("gdn_state_copy", "model.layers.0.self_attn", "kimi_linear",
                                 f"{_GDN}.kimi_gdn_linear_attn", "KimiGatedDeltaNetAttention", "_forward", "kda",
                                 folds=False, copy_form="gather_initial_states"),
}
LAYERS = tuple(KINDS)
PATCH_OF = {name: kind.patch for name, kind in KINDS.items()}
FOLDS = tuple(name for name, kind in KINDS.items() if kind.folds)
PREFIX_OF = {name: kind.prefix for name, kind in KINDS.items()}
RUNNER_NOTE = "kimi_k3: VLLM_USE_V2_MODEL_RUNNER=0 (builder computes aligned state indices itself)"
V2_ONLY = (0, 34)  # vLLM >= 0.34 builds only the V2 runner; VLLM_USE_V2_MODEL_RUNNER=0 is a start-up error there
V1_GONE = ("needs VLLM_USE_V2_MODEL_RUNNER=0 (its metadata builder computes aligned state indices only on the V1 "
           "runner's path), which vLLM >= 0.34 refuses at start-up; the engine check runs this layer on 0.34")
# the prefill backends a child may build its layer with: ``triton`` forces the Triton prefill (the chunk kernel the
# overlay's seams route); ``default`` sets nothing, so the layer prefills on the backend vLLM picks for the GPU (0.34
# on SM90: FlashInfer for Qwen's GDN, FlashKDA for Kimi K3), as users run it
PREFILL_BACKENDS = {"triton": {"kda_prefill_backend": "triton", "kda_decode_backend": "triton",
                               "gdn_prefill_backend": "triton"},
                    "default": {}}
TIMED_SEQS = (1, 8, 64, 256)
TIMED_LEN, TIMED_CACHED = 512, 512
MAX_NUM_SEQS = 256
# (name, decodes: list of cached lengths, prefills: list of (new tokens, cached tokens))
CASES = (
    ("fresh_prefills", [], [(512, 0), (77, 0), (1, 0), (300, 0)]),
    ("chunked_continuations", [], [(512, 512), (64, 1000), (129, 7), (1, 200)]),
    ("mixed_prefill_decode", [33, 700, 5], [(200, 0), (96, 320)]),
    ("wide_mixed", [9] * 20, [(64, 64 * (i % 3)) for i in range(40)]),
)
QUICK_CASES = (
    ("fresh_prefills", [], [(40, 0), (7, 0)]),
    ("chunked_continuations", [], [(33, 64), (1, 20)]),
    ("mixed_prefill_decode", [12, 5], [(17, 0), (9, 30)]),
)


# ---------------------------------------------------------------- parent: bundle, children, verdicts

def release_of(version: str | None) -> tuple[int, ...]:
    """``"0.34.0+cu130"`` -> ``(0, 34, 0)``; None -> ``()``. The parent runs without the project on its path (only
    the children get it), so it cannot use ``kda_patches.verdicts.parse_version``, and importing the package here
    would activate the overlay in the parent."""
    parts = []
    for piece in (version or "").split("+", 1)[0].split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def layers_for(version: str | None, asked: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """Return the layers to run on vLLM ``version`` and those left out with why.

    Args:
        version: the bundle's vLLM version (None: unknown, every layer runs).
        asked: ``--layers`` as given, or None for the default (every layer that can run on that version).
    Raises:
        SystemExit: a layer asked for by name cannot run on that version (named, with the reason).
    """
    left_out = {name: V1_GONE for name, kind in KINDS.items()
                if kind.v1_runner and release_of(version)[:2] >= V2_ONLY}
    refused = [name for name in asked or [] if name in left_out]
    if refused:
        raise SystemExit(f"--layers {' '.join(refused)}: cannot run on vLLM {version}: {left_out[refused[0]]}; "
                         f"run the others ({', '.join(n for n in LAYERS if n not in left_out)})")
    chosen = list(asked) if asked else [name for name in LAYERS if name not in left_out]
    return chosen, {name: why for name, why in left_out.items() if name not in chosen}


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Return the distribution-free interval of the median of ``values`` (order statistics ``k`` and ``n + 1 - k``,
    the largest ``k`` whose coverage ``1 - 2 P(Binomial(n, 1/2) < k)`` is at least ``confidence``), or None when
    ``values`` are too few for any interval to reach it (fewer than 6 at 95 %)."""
    ordered = sorted(values)
    count = len(ordered)
    below, chosen = 0.0, None
    for k in range(1, count // 2 + 1):
        below += math.comb(count, k - 1) / 2 ** count  # P(B <= k - 1)
        if 1 - 2 * below < confidence:
            break
        chosen = k
    return None if chosen is None else (ordered[chosen - 1], ordered[count - chosen])


def paired_ratios(samples: dict[str, dict[str, list[float]]], key: str = "step") -> list[float]:
    """Return the per-round unpatched / patched ratios of a timed row's ``samples`` for figure ``key`` (``event`` or
    ``step``); empty without both variants' samples."""
    if "baseline" not in samples or "patched" not in samples:
        return []
    return [base / patched for base, patched in zip(samples["baseline"][f"{key}_ms"], samples["patched"][f"{key}_ms"],
                                                    strict=True)]


def paired_steps(rows: list[dict[str, Any]]) -> list[tuple[int, float, tuple[float, float] | None]]:
    """``(seqs, unpatched/patched per engine step, its median's 95 % interval or None)`` of each row timed with both
    variants (:func:`median_interval` where the row kept its rounds)."""
    return [(row["seqs"], row["paired_step_speedup"], median_interval(paired_ratios(row.get("samples") or {})))
            for row in rows if "paired_step_speedup" in row]


def step_figures(paired: list[tuple[int, float, tuple[float, float] | None]]) -> str:
    """``seqs: ratio [interval]`` per timed batch size, comma-separated."""
    return ", ".join(f"{seqs}: {ratio:.3f}x" + (f" [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else "")
                     for seqs, ratio, interval in paired)


def wrapper_cost(layer: str, backend: str | None, rows: list[dict[str, Any]]) -> str:
    """The ``DEFAULT`` line of a layer whose seam stood aside on its backend in every case: no routing decision,
    the wrapper's cost there (unpatched / patched per engine step, as :func:`seam_default` shows it)."""
    return (f"DEFAULT {layer}: stands aside on {backend} (the seam's backend gate); the wrapper's cost there, "
            f"unpatched/patched per engine step {step_figures(paired_steps(rows)) or 'not timed'}")


def seam_default(layer: str, rows: list[dict[str, Any]]) -> str:
    """The per-seam default the layer's timing justifies (issue 27's rule), as one ``DEFAULT`` line.

    Route when the patched layer call is at least as fast as the unpatched one (median of the per-round paired
    ratios of the engine-step figure, unpatched / patched >= 1.00) at every timed batch size; otherwise stand
    aside, naming the batch sizes below 1.00. No timed row with both variants: no verdict. Each figure is followed
    by the 95 % interval of its median (:func:`median_interval`) where the row kept its rounds: it shows whether a
    ratio near 1.00 is a measured difference or noise; the rule reads the median alone.
    """
    paired = paired_steps(rows)
    if not paired:
        return f"DEFAULT {layer}: none (no batch size timed with both variants)"
    figures = step_figures(paired)
    slower = [str(seqs) for seqs, ratio, _ in paired if ratio < 1.0]
    if slower:
        return (f"DEFAULT {layer}: stand aside (patched slower at {', '.join(slower)} sequences; unpatched/patched "
                f"per engine step {figures})")
    return (f"DEFAULT {layer}: route (patched at least as fast at every batch size; unpatched/patched per engine "
            f"step {figures})")


def child_env(site: pathlib.Path, layer: str, enabled: bool, dry_run: bool,
              gdn_ops: str = "overlay", state_io: str = "copy") -> dict[str, str]:
    """Return the environment of one child: bundle + project on the path (+ the stand-in hook on GPU), switches.

    ``gdn_ops`` is the child's ``KDA_PATCHES_GDN_OPS`` (on vLLM >= 0.34: ``overlay`` routes the seams where
    upstream's own ops copy the states; ``upstream`` lets the overlay stand aside there); ``state_io`` its
    ``KDA_PATCHES_STATE_IO`` (``copy``: the plans; ``indexed``: no copy).
    """
    env = dict(os.environ)
    hook = [] if dry_run else [str(write_stand_in_hook(site.with_name(site.name + "-standins")))]
    env["PYTHONPATH"] = os.pathsep.join([*hook, str(ROOT), str(site), *filter(None, [env.get("PYTHONPATH")])])
    env.update(KDA_PATCHES="1" if enabled else "0", KDA_PATCHES_STRICT="1", KDA_PATCHES_ONLY=PATCH_OF[layer],
               KDA_PATCHES_GDN_OPS=gdn_ops, KDA_PATCHES_STATE_IO=state_io, PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false",
               VLLM_LOGGING_LEVEL="WARNING", VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1")
    if KINDS[layer].v1_runner:  # see RUNNER_NOTE
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if dry_run:
        # an empty CUDA_VISIBLE_DEVICES is vLLM's "distributed start-up" case, where it keeps the installed Triton
        # without an active GPU driver: 0.34's CPU platform refuses x86 without Triton, and its warm-up decorators
        # need the real module (the interpreter runs the kernels)
        env.update(VLLM_TARGET_DEVICE="cpu", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    else:
        env.pop("TRITON_INTERPRET", None)
        env.update(gpu_harness.compile_cache_env())
    return env


def child_argv(layer: str, enabled: bool, args: argparse.Namespace, out: pathlib.Path) -> list[str]:
    """The command line of one child (``--child LAYER``) writing its JSON to ``out``: the parent's timing options
    (rounds, settle, burst, copy costs and their graph instances) and, patched children only, the host profile."""
    argv = [sys.executable, __file__, "--child", layer, "--child-out", str(out), "--rounds", str(args.rounds),
            "--settle", str(args.settle), "--burst", str(args.burst), "--graph-instances", str(args.graph_instances),
            "--prefill-backend", args.prefill_backend,
            *(["--copy-costs"] if args.copy_costs else []), "--mode", "on" if enabled else "off"]
    argv += ["--dry-run"] if args.dry_run else []
    argv += ["--host-profile", *map(str, args.host_profile)] if args.host_profile and enabled else []
    return argv


def run_child(site: pathlib.Path, layer: str, enabled: bool, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Run one child (``--child LAYER``) and return its JSON result (or the failure)."""
    out = pathlib.Path(args.out) / f".child-{layer}-{'on' if enabled else 'off'}.json"
    argv = child_argv(layer, enabled, args, out)
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=child_env(site, layer, enabled, args.dry_run, args.gdn_ops, args.state_io),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    deadline = started + args.child_timeout_s
    for line in process.stdout:
        log.write(line)
        log.flush()
        sys.stdout.write(line)
        if time.perf_counter() > deadline and process.poll() is None:
            process.kill()  # its progressive JSON keeps what it finished
            log.write(f"child {layer} killed after {args.child_timeout_s} s\n")
    code = process.wait()
    result = json.loads(out.read_text()) if out.is_file() else {}
    result.update(returncode=code, wall_s=round(time.perf_counter() - started, 1))
    return result


def timing_line(layer: str, row: dict[str, Any]) -> str:
    """The TIMING line of one timed shape with both variants: the step figure first, then the cold call."""

    def paired(key: str) -> str:
        return f" (per-round ratios {row[key]:.3f}x)" if key in row else ""

    step = (f"in a step of {row['burst']} calls {row['baseline_step_ms']:.3f} / {row['patched_step_ms']:.3f} ms per "
            f"call, speedup {row['baseline_step_ms'] / row['patched_step_ms']:.3f}x{paired('paired_step_speedup')}; "
            if "baseline_step_ms" in row else "")
    return (f"TIMING {layer} {row['seqs']}x{TIMED_LEN}: unpatched / patched (events, median of {row['rounds']}) "
            f"{step}one cold call {row['baseline_event_ms']:.3f} / {row['patched_event_ms']:.3f} ms, speedup "
            f"{row['baseline_event_ms'] / row['patched_event_ms']:.3f}x{paired('paired_event_speedup')}; cold wall "
            f"{row['baseline_wall_ms']:.3f} / {row['patched_wall_ms']:.3f} ms")


def indexes_every_call(case: dict[str, Any]) -> bool:
    """Return whether the case's routed prefill calls must all have run the indexed twin: under
    ``KDA_PATCHES_STATE_IO=indexed`` always, under ``auto`` when the call has at least its crossover's prefills
    (``auto_min_sequences``, recorded by the child), else never (``copy``, or ``auto`` below the crossover)."""
    if case.get("state_io") == "indexed":
        return True
    return case.get("state_io") == "auto" and case.get("num_prefills", 0) >= case.get("auto_min_sequences", 0)


def auto_min_sequences() -> int:
    """The crossover of ``KDA_PATCHES_STATE_IO=auto`` in the installed project (read in the child)."""
    from kda_patches.indexed_chunk import AUTO_MIN_SEQUENCES

    return AUTO_MIN_SEQUENCES


def judge(layer: str, on: dict[str, Any], off: dict[str, Any]) -> list[str]:
    """Return the verdict lines of one layer from its patched (``on``) and unpatched (``off``) children.

    A case passes when outputs and every cache byte equal the unpatched call's and the KDA_PATCHES=0 process's, and
    every prefill call was routed (indexed where no copy applies). Only a child built on vLLM's own backend choice
    (``--prefill-backend default``) may instead find the seam standing aside on the layer's backend (its gate: no
    call seen, each counted ``calls_upstream``); that passes with the same equalities and no call bypassed, and the
    layer's ``DEFAULT`` line then reports the wrapper's cost on that backend, not a routing decision.
    """
    lines = []
    asked = on.get("facts", {}).get("prefill_backend_asked", "triton")
    backend = on.get("facts", {}).get("prefill_backend")
    stood_aside = 0  # cases whose seam stood aside on the layer's backend
    if on.get("error") or on.get("returncode"):
        return [f"VERDICT {layer}: FAIL child (overlay on) exit {on.get('returncode')}: {on.get('error', '?')}"]
    patched = on.get("patched_available", False)
    for case in on.get("cases", []):
        name = case["name"]
        if "dry_run_build" in case:
            lines.append(f"DRYRUN {layer} {name} ({case['shape']}): plans {on['facts'].get('plans')}; metadata "
                         f"build {case['dry_run_build']}; layer call {case.get('dry_run_call', 'not reached')}")
            continue
        off_case = next((c for c in off.get("cases", []) if c["name"] == name), None)
        cross = "n/a" if off_case is None else (
            "equal" if off_case["digest_baseline"] == case["digest_patched"] else "DIFFERENT")
        if not patched:
            ok = off_case is None or off_case["digest_baseline"] == case["digest_baseline"]
            lines.append(f"VERDICT {layer} {name} ({case['shape']}): {'UNPATCHED-ONLY' if ok else 'FAIL'} "
                         f"(no {PATCH_OF[layer]} seam in this tree; KDA_PATCHES=0 process digest "
                         f"{'equal' if ok else 'DIFFERENT'})")
            continue
        if asked == "default" and case.get("calls_seen", 0) == 0 and case.get("calls_upstream", 0) > 0:
            ok = (case["outputs_equal"] and case["cache_equal"] and cross != "DIFFERENT"
                  and not case.get("calls_bypassed"))
            stood_aside += 1
            lines.append(f"VERDICT {layer} {name} ({case['shape']}): {'PASS' if ok else 'FAIL'} stands aside on "
                         f"{backend} ({case['calls_upstream']} calls upstream's), outputs "
                         f"{'equal' if case['outputs_equal'] else 'DIFFER'}, cache bytes "
                         f"{'equal' if case['cache_equal'] else 'DIFFER'} ({case['cache_bytes']} B), bypassed "
                         f"{case.get('calls_bypassed', 0)}, KDA_PATCHES=0 process {cross}")
            continue
        # no copy (KDA_PATCHES_STATE_IO=indexed): every routed prefill ran the indexed twin, which stores in the
        # cache dtype itself; a copied one folds its cast where the seam declares its final state's source and the
        # cache is not FP32
        indexed = case.get("calls_indexed", 0)
        indexed_expected = case["calls_routed"] if indexes_every_call(case) else 0
        folds_expected = case["calls_routed"] - indexed if case.get("final_cast") else 0
        ok = (case["outputs_equal"] and case["cache_equal"] and case["calls_seen"] > 0
              and case["calls_routed"] == case["calls_seen"] and cross != "DIFFERENT" and indexed == indexed_expected
              and case.get("casts_folded", 0) == folds_expected and not case.get("casts_materialized"))
        lines.append(f"VERDICT {layer} {name} ({case['shape']}): {'PASS' if ok else 'FAIL'} outputs "
                     f"{'equal' if case['outputs_equal'] else 'DIFFER'}, cache bytes "
                     f"{'equal' if case['cache_equal'] else 'DIFFER'} ({case['cache_bytes']} B), routed "
                     f"{case['calls_routed']}/{case['calls_seen']}, casts folded {case.get('casts_folded', 0)}/"
                     f"{folds_expected}{f', indexed {indexed}/{indexed_expected}' if indexed_expected else ''}, "
                     f"KDA_PATCHES=0 process {cross}")
    for row in on.get("timing", []):
        if patched:
            lines.append(timing_line(layer, row))
        else:
            lines.append(f"TIMING {layer} {row['seqs']}x{TIMED_LEN}: unpatched only {row['baseline_event_ms']:.3f} "
                         f"ms (events), wall {row['baseline_wall_ms']:.3f} ms")
    if patched and on.get("timing"):
        every_case_aside = 0 < stood_aside == len(on.get("cases", []))
        lines.append(wrapper_cost(layer, backend, on["timing"]) if every_case_aside
                     else seam_default(layer, on["timing"]))
    if not on.get("cases"):
        lines.append(f"VERDICT {layer}: FAIL no case ran")
    return lines


def source_hash() -> str:
    """sha256 over this script and every ``kda_patches/**.py`` file of the tree that ran (path + content)."""
    hasher = hashlib.sha256()
    for path in sorted([pathlib.Path(__file__).resolve(), *(ROOT / "kda_patches").rglob("*.py")]):
        hasher.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return hasher.hexdigest()


def run_parent(args: argparse.Namespace) -> int:
    """Unpack the bundle, run both children per layer, print and write the verdicts."""
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    default = BUNDLE_DIR / f"vllm-0.33.0-cp{sys.version_info[0]}{sys.version_info[1]}.zip"
    bundle = pathlib.Path(args.bundle) if args.bundle else (default if default.is_file() else None)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": {
        "python": platform.python_version(), "machine": platform.machine()}, "dry_run": args.dry_run, "layers": {}}
    with open(out / "vllm_layers.log", "w") as log:
        started = time.perf_counter()
        prepared = gpu_harness.prepare_site(bundle, pathlib.Path(args.site))
        report["bundle"] = prepared["bundle"]
        report["bundle"]["unpack_s"] = round(time.perf_counter() - started, 1)
        report["compiled_library"] = prepared["compiled_library"]
        report["source_sha256"] = source_hash()
        report["vllm_version"] = prepared.get("vllm_version")
        args.layers, report["left_out"] = layers_for(report["vllm_version"], args.layers)
        report["gdn_ops"], report["state_io"] = args.gdn_ops, args.state_io
        for name, why in report["left_out"].items():
            for stream in (log, sys.stdout):
                print(f"LEFT OUT {name} on vLLM {report['vllm_version']}: {why}", file=stream, flush=True)
        print(f"bundle {prepared['bundle_file']} unpacked in {report['bundle']['unpack_s']} s; vLLM's compiled library "
              f"{'staged' if prepared['compiled_library'] else 'absent (its import stood in)'}", file=log, flush=True)
        results: dict[str, dict[str, Any]] = {}
        # every overlay-on child first (the main result), then the KDA_PATCHES=0 cross-checks
        for enabled in (True, False) if not args.skip_off else (True,):
            for layer in args.layers:
                results.setdefault(layer, {})["overlay_on" if enabled else "overlay_off"] = run_child(
                    pathlib.Path(args.site), layer, enabled, args, log)
                report["layers"] = results
                (out / "vllm_layers.json").write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
        verdicts: list[str] = []
        for layer in args.layers:
            verdicts += judge(layer, results[layer]["overlay_on"], results[layer].get("overlay_off", {}))
        report["verdicts"] = verdicts
        for line in verdicts:
            print(line, file=log)
            print(line)
    (out / "vllm_layers.json").write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    for child in out.glob(".child-*.json"):
        child.unlink()
    return 0 if verdicts and not any(" FAIL" in line for line in verdicts) else 1


# ---------------------------------------------------------------- child: one layer, vLLM's own code


def install_stand_ins() -> None:
    """The harness's stand-ins (called by the generated sitecustomize in every GPU process)."""
    gpu_harness.install_stand_ins()


def write_stand_in_hook(folder: pathlib.Path) -> pathlib.Path:
    """Write ``folder/sitecustomize.py`` that installs the stand-ins in every process with ``folder`` on its path."""
    return gpu_harness.write_stand_in_hook(folder, "gpu_harness", "install_stand_ins")


def stood_in_record() -> dict[str, str]:
    """Return every stand-in and why (for the results): depends on whether the real library was carried."""
    return gpu_harness.stood_in_record(gpu_harness.library_present(SITE_DIR), SITE_DIR)


def write_model_dir(layer: str, root: pathlib.Path) -> pathlib.Path:
    """Write a ``config.json`` with the issue's head counts (Kimi K3 12x128; Qwen3.6-27B TP4 GDN 12v/4k x128)."""
    if KINDS[layer].config == "kimi_linear":
        config = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": 2048,
                  "num_hidden_layers": 2, "num_attention_heads": 16, "vocab_size": 1024, "torch_dtype": "bfloat16",
                  "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                  "linear_attn_config": {"head_dim": 128, "num_heads": 12, "short_conv_kernel_size": 4,
                                         "use_full_rank_gate": True, "kda_layers": [2], "full_attn_layers": [1],
                                         "gate_lower_bound": -5.0}}
    else:
        config = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 1024,
                  "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
                  "linear_num_key_heads": 4, "linear_num_value_heads": 12, "linear_key_head_dim": 128,
                  "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 1024,
                  "moe_intermediate_size": 256, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1024,
                  "full_attention_interval": 2, "torch_dtype": "bfloat16", "max_position_embeddings": 4096,
                  "layer_types": ["linear_attention", "full_attention"]}
    path = root / layer
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


class LayerBench:
    """One vLLM layer with its bound cache, metadata builder and the overlay's registry handle."""

    def __init__(self, layer_kind: str, device: Any, dry_run: bool, facts: dict[str, Any],
                 prefill_backend: str = "triton") -> None:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.kind, self.device, self.dry_run, self.torch = layer_kind, device, dry_run, torch
        self.prefix = PREFIX_OF[layer_kind]
        started = time.perf_counter()
        model_dir = write_model_dir(layer_kind, pathlib.Path(tempfile.mkdtemp(prefix="kda-vllm-model-")))
        max_tokens = 64 * 256 if dry_run else MAX_NUM_SEQS * TIMED_LEN
        model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
                            enforce_eager=True)
        self.config = VllmConfig(
            model_config=model, cache_config=CacheConfig(block_size=2048),
            scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=max_tokens,
                                             max_model_len=2048, is_encoder_decoder=False),
            additional_config=dict(PREFILL_BACKENDS[prefill_backend]))
        facts["prefill_backend_asked"] = prefill_backend
        facts["config_s"] = round(time.perf_counter() - started, 1)
        self.context = set_current_vllm_config(self.config)
        self.context.__enter__()
        backend = "gloo" if device.type == "cpu" else "nccl"
        port = random.Random(os.getpid()).randint(20000, 60000)
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend=backend)
        initialize_model_parallel(1, 1)
        facts["distributed_backend"] = backend
        hf = model.hf_text_config
        kind = KINDS[layer_kind]
        with set_default_torch_dtype(torch.bfloat16), torch.device(device):
            layer_class = getattr(importlib.import_module(kind.module), kind.cls)
            self.layer = layer_class(hf, self.config, prefix=self.prefix)
        self.init_weights()
        facts["layer_class"] = f"{type(self.layer).__module__}.{type(self.layer).__qualname__}"
        facts["prefill_backend"] = getattr(self.layer, "kda_prefill_backend", None) or getattr(
            self.layer, "gdn_prefill_backend", None)
        self.allocate(facts)

    def init_weights(self) -> None:
        """Fill the layer's parameters with a seeded random draw (vLLM leaves them ``torch.empty``)."""
        torch = self.torch
        generator = torch.Generator(device="cpu").manual_seed(1234)
        for name, param in sorted(self.layer.named_parameters()):
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * 0.05
            if name.endswith("A_log"):
                values = torch.log(torch.rand(param.shape, generator=generator) * 15 + 1)
            elif name.endswith("dt_bias"):
                values = torch.rand(param.shape, generator=generator) * 0.5
            elif "norm" in name:
                values = 1 + values
            param.data.copy_(values.to(param.dtype))

    def allocate(self, facts: dict[str, Any]) -> None:
        """vLLM's planning, allocation and binding of this layer's KV cache; keep the raw buffer."""
        torch = self.torch
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            record_kv_cache_layout,
            resolve_kv_cache_layout,
        )
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
        from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache

        spec = self.layer.get_kv_cache_spec(self.config)
        supported = [layout.name for layout in get_supported_kv_cache_layouts([self.layer.get_attn_backend()])]
        layout = resolve_kv_cache_layout(self.config, [supported], [spec])
        record_kv_cache_layout(self.config.cache_config, layout.name)
        self.num_blocks = MAX_NUM_SEQS + 8
        self.config.cache_config.num_gpu_blocks_override = self.num_blocks
        groups = get_kv_cache_groups(self.config, {self.prefix: spec})
        kv_config = get_kv_cache_config_from_groups(self.config, groups, 1 << 40)
        kernel_block_sizes = [group.kv_cache_spec.block_size for group in kv_config.kv_cache_groups]
        raw = allocate_kv_cache(kv_config, self.device, layout, kernel_block_sizes)
        self.runner_kv_caches: list[Any] = []
        # 0.33 shares ReplaySSM trackers across the groups it is given; 0.34's bind_kv_cache has no such parameter
        groups_kwarg = ({"kv_cache_groups": kv_config.kv_cache_groups}
                        if "kv_cache_groups" in inspect.signature(bind_kv_cache).parameters else {})
        bind_kv_cache(raw, self.config.compilation_config.static_forward_context, self.runner_kv_caches,
                      **groups_kwarg)
        self.spec, self.kv_config = spec, kv_config
        view = raw[self.prefix]
        self.raw = torch.empty(0, dtype=torch.int8, device=self.device).set_(view.untyped_storage())
        conv, state = self.layer.kv_cache[0], self.layer.kv_cache[1]
        facts.update(kv_layout=layout.name, num_blocks=kv_config.num_blocks, raw_bytes=self.raw.numel(),
                     state_shape=list(state.shape), state_stride=list(state.stride()), state_dtype=str(state.dtype),
                     conv_shape=list(conv.shape), conv_dtype=str(conv.dtype), spec=type(spec).__name__)
        generator = torch.Generator(device=self.device).manual_seed(99)  # poison every byte: page gaps too
        self.raw.copy_(torch.randint(-128, 128, (self.raw.numel(),), generator=generator, dtype=torch.int8,
                                     device=self.device))
        state.copy_((torch.randn(state.shape, generator=generator, device=self.device) * 0.1).to(state.dtype))
        conv.copy_((torch.randn(conv.shape, generator=generator, device=self.device) * 0.1).to(conv.dtype))

    def builder(self) -> Any:
        """Return vLLM's own metadata builder of this layer's backend."""
        cls = self.layer.get_attn_backend().get_builder_cls()
        return cls(self.spec, [self.prefix], self.config, self.device)

    def common_metadata(self, decodes: list[int], prefills: list[tuple[int, int]], rows: list[int]) -> Any:
        """``CommonAttentionMetadata`` of a batch: decodes (cached length) first, then (new, cached) prefills."""
        torch = self.torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        query = [1] * len(decodes) + [new for new, _ in prefills]
        seq = [cached + 1 for cached in decodes] + [new + cached for new, cached in prefills]
        prefilling = [False] * len(decodes) + [True] * len(prefills)
        starts = [0]
        for length in query:
            starts.append(starts[-1] + length)
        start_cpu, seq_cpu = torch.tensor(starts, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32)
        table = torch.tensor(rows, dtype=torch.int32).view(-1, 1)
        return CommonAttentionMetadata(
            query_start_loc=start_cpu.to(self.device), query_start_loc_cpu=start_cpu,
            seq_lens=seq_cpu.to(self.device), num_reqs=len(query), num_actual_tokens=starts[-1],
            max_query_len=max(query), max_seq_len=max(seq), block_table_tensor=table.to(self.device),
            slot_mapping=torch.arange(starts[-1], dtype=torch.int64, device=self.device),
            seq_lens_cpu_upper_bound=seq_cpu.clone(), is_prefilling=torch.tensor(prefilling))

    def inputs(self, tokens: int, seed: int) -> dict[str, Any]:
        """Seeded random inputs of the layer call (the projections' outputs) for ``tokens`` tokens."""
        torch = self.torch
        generator = torch.Generator(device=self.device).manual_seed(seed)

        def draw(*shape: int, scale: float = 1.0) -> Any:
            return (torch.randn(shape, generator=generator, device=self.device) * scale).to(torch.bfloat16)

        layer = self.layer
        if KINDS[self.kind].inputs == "kda":
            heads, dim = layer.local_num_heads, layer.head_dim
            return {"mixed_qkv": draw(tokens, 3 * heads * dim), "g1": draw(1, tokens, heads, dim),
                    "g2": draw(tokens, heads, dim), "beta": draw(1, tokens, heads),
                    "core_attn_out": torch.zeros(1, tokens, heads, dim, dtype=torch.bfloat16, device=self.device)}
        qkv = 2 * layer.key_dim + layer.value_dim
        heads = layer.num_v_heads
        return {"mixed_qkv": draw(tokens, qkv), "b": draw(tokens, heads), "a": draw(tokens, heads),
                "core_attn_out": torch.zeros(tokens, heads, layer.head_v_dim, dtype=torch.bfloat16,
                                             device=self.device)}

    @staticmethod
    def fresh(inputs: dict[str, Any]) -> dict[str, Any]:
        """Return clones of the call's inputs (the layer may write into them; the output buffer surely)."""
        return {name: tensor.clone() for name, tensor in inputs.items()}

    def call(self, metadata: Any, inputs: dict[str, Any], fresh: dict[str, Any] | None = None) -> Any:
        """Run the seam method once under vLLM's forward context on ``fresh`` (default: clones of ``inputs``)."""
        from vllm.forward_context import set_forward_context

        fresh = fresh if fresh is not None else self.fresh(inputs)
        with set_forward_context({self.prefix: metadata}, self.config, num_tokens=fresh["mixed_qkv"].shape[0]):
            getattr(self.layer, KINDS[self.kind].method)(**fresh)
        return fresh["core_attn_out"]


class Overlay:
    """The layer's patch through the registry: ``off()`` reverts it, ``on()`` registers it again (hooks re-apply)."""

    def __init__(self, name: str) -> None:
        from kda_patches import registry

        self.registry = registry
        self.patch = registry.all_patches().get(name)
        self.name = name

    def available(self) -> bool:
        """Return whether this tree has the patch and it is applied to the layer's seam right now."""
        return self.patch is not None and any(self.registry.is_applied(self.patch, target)
                                              for target in self.patch.targets)

    def off(self) -> None:
        """Revert every target of the patch (the original methods are back)."""
        if self.patch is not None:
            self.registry.revert_patch(self.patch)

    def on(self) -> None:
        """Register the patch again (strict); already-imported targets are wrapped at once."""
        self.registry.register_patch(self.patch, strict=True)
        if not self.available():
            raise RuntimeError(f"{self.name}: register_patch did not re-apply the seam")

    def counters(self) -> dict[str, int]:
        """Return this patch's ledger counters."""
        from kda_patches.ledger import get_ledger

        return dict(get_ledger().counters(self.name))


def digest(*tensors: Any) -> str:
    """sha256 over the raw bytes of tensors (bitwise: NaN payloads count)."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().contiguous().view(-1).view(__import__("torch").uint8).cpu().numpy().tobytes())
    return hasher.hexdigest()


def publish_plans(bench: LayerBench) -> dict[str, Any]:
    """Prepare, seal and publish the overlay's plans through its startup hook's public entry (real bound cache)."""
    from kda_patches.routing import startup

    runner_view = type("RunnerView", (), {"vllm_config": bench.config})()
    plans = startup.prepare_and_publish(runner_view, PATCH_OF[bench.kind])
    return {name: getattr(plan, "kind", type(plan).__name__) for name, plan in plans.items()}


def run_case(bench: LayerBench, overlay: Overlay | None, name: str, decodes: list[int],
             prefills: list[tuple[int, int]], seed: int) -> dict[str, Any]:
    """Run one batch baseline then patched (same snapshot of the whole raw buffer); compare bitwise."""
    torch = bench.torch
    rng = random.Random(seed)
    rows = rng.sample(range(1, bench.num_blocks), len(decodes) + len(prefills))
    common = bench.common_metadata(decodes, prefills, rows)
    tokens = common.num_actual_tokens
    inputs = bench.inputs(tokens, seed)
    snapshot = bench.raw.clone()
    shape = f"{len(decodes)} decodes + {len(prefills)} prefills, {tokens} tokens"
    record: dict[str, Any] = {"name": name, "shape": shape, "cache_bytes": bench.raw.numel()}
    if bench.dry_run:  # CPU platform: CUDA-only builder asserts and Triton placeholders stop here; say where
        built: list[Any] = []
        for step in ("build", "call"):
            try:
                if step == "build":
                    built.append(bench.builder().build(0, common))
                else:
                    bench.call(built[0], inputs)
                record[f"dry_run_{step}"] = "ran"
            except Exception as error:
                record[f"dry_run_{step}"] = f"{type(error).__name__}: {str(error)[:200]}"
                break
        record["digest_baseline"] = record["digest_patched"] = "dry-run"
        bench.raw.copy_(snapshot)
        return record
    metadata = bench.builder().build(0, common)
    record.update(num_prefills=int(metadata.num_prefills), num_decodes=int(metadata.num_decodes))
    if overlay is not None:
        overlay.off()
    out_base = bench.call(metadata, inputs)
    raw_base = bench.raw.clone()
    record["digest_baseline"] = digest(out_base, raw_base)
    if overlay is None or overlay.patch is None:
        record["digest_patched"] = record["digest_baseline"]
        bench.raw.copy_(snapshot)  # every case starts from the same cache bytes
        return record
    bench.raw.copy_(snapshot)
    overlay.on()
    before = overlay.counters()
    metadata = bench.builder().build(0, common)
    out_patched = bench.call(metadata, inputs)
    after = overlay.counters()
    record.update(
        outputs_equal=bool(torch.equal(out_base.view(torch.int16), out_patched.view(torch.int16))),
        cache_equal=bool(torch.equal(raw_base, bench.raw)), digest_patched=digest(out_patched, bench.raw),
        calls_seen=after.get("calls_seen", 0) - before.get("calls_seen", 0),
        calls_routed=after.get("calls_routed", 0) - before.get("calls_routed", 0),
        calls_bypassed=after.get("calls_bypassed", 0) - before.get("calls_bypassed", 0),
        calls_upstream=after.get("calls_upstream", 0) - before.get("calls_upstream", 0),
        casts_folded=after.get("casts_folded", 0) - before.get("casts_folded", 0),
        casts_materialized=after.get("casts_materialized", 0) - before.get("casts_materialized", 0),
        calls_indexed=after.get("calls_indexed", 0) - before.get("calls_indexed", 0),
        state_io=os.environ.get("KDA_PATCHES_STATE_IO", "copy"), auto_min_sequences=auto_min_sequences(),
        final_cast=bench.kind in FOLDS and bench.layer.kv_cache[1].dtype != torch.float32)
    bench.raw.copy_(snapshot)
    return record


def prefill_batch(bench: LayerBench, overlay: Overlay | None, seqs: int, new: int, cached: int, seed: int
                  ) -> tuple[Any, dict[str, Any], Any, list[str]]:
    """``seqs`` prefills of ``new`` tokens after ``cached`` ones on random rows: (common metadata, inputs,
    a snapshot of the raw cache, the variants to time: baseline, and patched when the overlay has the seam)."""
    rows = random.Random(seqs).sample(range(1, bench.num_blocks), seqs)
    common = bench.common_metadata([], [(new, cached)] * seqs, rows)
    inputs = bench.inputs(common.num_actual_tokens, seed + seqs)
    variants = ["baseline"] + (["patched"] if overlay is not None and overlay.patch is not None else [])
    return common, inputs, bench.raw.clone(), variants


def restart_call(bench: LayerBench, common: Any, inputs: dict[str, Any], snapshot: Any) -> tuple[Any, Any]:
    """Put the cache bytes back to ``snapshot``; return fresh ``(metadata, outputs)`` for one layer call."""
    bench.raw.copy_(snapshot)
    return bench.builder().build(0, common), bench.fresh(inputs)


def switch_variant(bench: LayerBench, overlay: Overlay | None, variant: str, settle: int, common: Any,
                   inputs: dict[str, Any], snapshot: Any) -> None:
    """Switch the overlay to ``variant``, then run ``settle`` untimed calls of it (the first calls after a
    switch pay for re-wrapped methods and cold lookups, which a serving process never does per call)."""
    if overlay is not None and overlay.patch is not None:
        overlay.on() if variant == "patched" else overlay.off()
    for _ in range(settle):
        metadata, fresh = restart_call(bench, common, inputs, snapshot)
        bench.call(metadata, inputs, fresh)


def time_shape(bench: LayerBench, overlay: Overlay | None, seqs: int, rounds: int, new: int,
               cached: int, settle: int = 0, burst: int = 8) -> dict[str, Any]:
    """Median CUDA-event and wall time of the layer call, unpatched vs patched, order shuffled per round;
    ``settle`` untimed calls of the variant after each switch.

    Two timings per variant and round, from the same snapshot:

    - ``step``: ``burst`` calls back to back on one metadata object, the way one engine step calls its layers
      (each layer enqueues while the previous one runs), events around all of them, divided by ``burst``;
    - ``cold``: one call from a synchronized, idle device: the host's whole enqueue latency of one call, which
      on a host-bound small batch swings by +-30 % between calls of the same code (H200 runs 12-13).
    """
    torch = bench.torch
    common, inputs, snapshot, variants = prefill_batch(bench, overlay, seqs, new, cached, 7)
    samples: dict[str, dict[str, list[float]]] = {v: {"event_ms": [], "wall_ms": [], "step_ms": []}
                                                   for v in variants}
    rng = random.Random(1000 + seqs)
    cuda = bench.device.type == "cuda"

    def timed(metadata: Any, calls: list[dict[str, Any]]) -> tuple[float, float]:
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            wall = time.perf_counter()
            start.record()
        else:
            wall = time.perf_counter()
        for fresh in calls:
            bench.call(metadata, inputs, fresh)
        if cuda:
            end.record()
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - wall) * 1e3
        return (start.elapsed_time(end) if cuda else wall_ms), wall_ms

    for round_index in range(rounds + 1):  # round 0 warms both variants up (compiles), not recorded
        order = variants[:]
        rng.shuffle(order)
        for variant in order:
            switch_variant(bench, overlay, variant, settle, common, inputs, snapshot)
            metadata, fresh = restart_call(bench, common, inputs, snapshot)
            event_ms, wall_ms = timed(metadata, [fresh])
            metadata, fresh = restart_call(bench, common, inputs, snapshot)
            step_ms, _ = timed(metadata, [fresh] + [bench.fresh(inputs) for _ in range(burst - 1)])
            if round_index:
                samples[variant]["wall_ms"].append(wall_ms)
                samples[variant]["event_ms"].append(event_ms)
                samples[variant]["step_ms"].append(step_ms / burst)
    bench.raw.copy_(snapshot)
    row: dict[str, Any] = {"seqs": seqs, "new_tokens": new, "cached_tokens": cached, "rounds": rounds,
                           "settle_calls": settle, "burst": burst, "samples": samples}
    for variant in variants:
        for key in ("event", "wall", "step"):
            row[f"{variant}_{key}_ms"] = statistics.median(samples[variant][f"{key}_ms"])
    if "patched" in samples:  # both variants ran in every round: the median of the rounds' own ratios
        for key in ("event", "step"):
            row[f"paired_{key}_speedup"] = statistics.median(paired_ratios(samples, key))
    return row


def copy_calls(fork_gather: Any, state: Any, indices: Any, flags: Any, final: Any,
               plans: dict[str, Any]) -> dict[tuple[str, ...], Any]:
    """The timed copy calls of :func:`time_copy_costs`: ``(op, implementation) -> call(step)``."""

    def fork_scatter(step: int) -> None:
        state[indices] = final.to(state.dtype)

    calls: dict[tuple[str, ...], Any] = {("gather", "fork"): lambda step: fork_gather(state, indices, flags),
                                         ("scatter", "fork"): fork_scatter}
    for name, plan in plans.items():
        calls[("gather", name)] = lambda step, plan=plan: plan.gather_eager(state, indices, flags)
        calls[("scatter", name)] = lambda step, plan=plan: plan.scatter_eager(state, final, indices)
    return calls


def time_copy_costs(bench: LayerBench, trials: int, graph_instances: int = 1) -> dict[str, Any]:
    """The seam's copies alone on the layer's bound cache: the released body's ops against the overlay's plan.

    For each timed batch size the metadata comes from vLLM's own builder (the index and flag tensors the seam
    receives). Implementations: ``fork`` (the body's own ops, :attr:`LayerKind.copy_form`), ``plan`` (a fused
    plan prepared as the startup hook prepares it), and two plan configurations to explain a gap: ``plan_w8``
    (8 warps, as vLLM's gather launches) and ``plan_plain`` (no ``evict_first`` on the scatter's cache writes).
    Every plan's result is first compared with the fork's, byte for byte. Timing: the bench's seed-000 modes
    (eager event, wall, host enqueue, graph replay), shuffled rounds; each copy captured ``graph_instances`` times
    anew (:func:`~kda_patches.bench.timing.replay_graphs`), so no one capture's offset decides a row.
    """
    torch = bench.torch
    from kda_patches.bench.timing import measure_rounds, median
    from kda_patches.state_copy.plan import FusedStatePlan

    form = KINDS[bench.kind].copy_form
    if form != "gather_initial_states":
        return {"skipped": f"copy form {form!r} is not timed alone"}
    from vllm.model_executor.layers.mamba.ops.gather_initial_states import gather_initial_states

    class PlainScatterPlan(FusedStatePlan):
        def _scatter_hint(self, target: Any) -> bool:
            return False

    state = bench.layer.kv_cache[1]
    snapshot = bench.raw.clone()
    plans = {"plan": FusedStatePlan.prepare(state, MAX_NUM_SEQS).seal(),
             "plan_w8": FusedStatePlan.prepare(state, MAX_NUM_SEQS, num_warps=8).seal(),
             "plan_plain": PlainScatterPlan.prepare(state, MAX_NUM_SEQS).seal()}
    report: dict[str, Any] = {"form": form, "plans": {name: plan.describe() for name, plan in plans.items()},
                              "rows": {}}
    for seqs in TIMED_SEQS:
        common, _, _, _ = prefill_batch(bench, None, seqs, TIMED_LEN, TIMED_CACHED, 7)
        metadata = bench.builder().build(0, common)
        indices, flags = metadata.non_spec_state_indices_tensor, metadata.has_initial_state
        final = torch.randn((seqs, *state.shape[1:]), device=state.device).to(state.dtype)
        expected = gather_initial_states(state, indices, flags)
        checks = {}
        for name, plan in plans.items():
            bench.raw.copy_(snapshot)  # the previous plan's scatter check left its rows in the cache
            checks[f"gather {name}"] = bool(torch.equal(plan.gather_eager(state, indices, flags).view(torch.uint8),
                                                        expected.view(torch.uint8)))
            bench.raw.copy_(snapshot)
            state[indices] = final.to(state.dtype)
            wanted = bench.raw.clone()
            bench.raw.copy_(snapshot)
            plan.scatter_eager(state, final, indices)
            checks[f"scatter {name}"] = bool(torch.equal(bench.raw, wanted))
        bench.raw.copy_(snapshot)

        calls = copy_calls(gather_initial_states, state, indices, flags, final, plans)
        samples = measure_rounds(calls, trials, 20, bench.device, random.Random(500 + seqs), graph_instances)
        bench.raw.copy_(snapshot)
        report["rows"][str(seqs)] = {
            "index_dtype": str(indices.dtype), "checks": checks,
            "median_us": {"/".join(key): round(median(values), 2) for key, values in samples.items()},
            "samples_us": {"/".join(key): values for key, values in samples.items()}}
        shown = {key: value for key, value in report["rows"][str(seqs)]["median_us"].items()
                 if key.endswith(("/event", "/graph", "/enqueue"))}
        print(f"[{bench.kind}] copy costs {seqs} rows: all equal {all(checks.values())}; {json.dumps(shown)}",
              flush=True)
    return report


def profile_host(bench: LayerBench, overlay: Overlay | None, seqs: int, calls: int, settle: int = 1) -> dict[str, Any]:
    """Host side of the layer call, unpatched vs patched: enqueue time (no sync inside) and a cProfile digest.

    For the small batches where the layer is host-bound. ``enqueue_us``: median wall time of the call alone
    (the GPU is synchronized before, not inside) over ``3 * calls`` calls per variant, the variants interleaved
    call by call in a shuffled order (the host's speed drifts; blocks of one variant would measure the drift).
    ``profile``: the 120 functions with the most cumulative time over ``calls`` profiled calls per variant
    (calls, own and cumulative µs per layer call), to show where they differ (cProfile inflates Python-heavy
    code, so compare it with ``enqueue_us``, not in absolute terms).
    """
    import cProfile
    import pstats

    torch = bench.torch
    common, inputs, snapshot, variants = prefill_batch(bench, overlay, seqs, TIMED_LEN, TIMED_CACHED, 11)
    rng = random.Random(7 + seqs)

    def one_call(variant: str, profiler: Any = None) -> float:
        if len(variants) > 1:
            switch_variant(bench, overlay, variant, settle, common, inputs, snapshot)
        metadata, fresh = restart_call(bench, common, inputs, snapshot)
        torch.cuda.synchronize()
        if profiler is not None:
            profiler.enable()
        started = time.perf_counter()
        bench.call(metadata, inputs, fresh)
        elapsed = time.perf_counter() - started
        if profiler is not None:
            profiler.disable()
        torch.cuda.synchronize()
        return elapsed * 1e6

    samples: dict[str, list[float]] = {variant: [] for variant in variants}
    split: dict[str, list[float]] = {"route_call_us": [], "fork_body_us": []}
    from kda_patches.routing import calls as routing_calls

    original_route_call, original_run_routed = routing_calls.route_call, routing_calls.run_routed

    def timed_route_call(*args: Any, **kwargs: Any) -> Any:  # the wrapper's whole call
        started = time.perf_counter()
        try:
            return original_route_call(*args, **kwargs)
        finally:
            split["route_call_us"].append((time.perf_counter() - started) * 1e6)

    def timed_run_routed(wrapped: Any, args: tuple, kwargs: dict, route: Any) -> Any:  # the fork's body inside it
        def body(*inner_args: Any, **inner_kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return wrapped(*inner_args, **inner_kwargs)
            finally:
                split["fork_body_us"].append((time.perf_counter() - started) * 1e6)
        return original_run_routed(body, args, kwargs, route)

    from kda_patches.routing import wrappers as routing_wrappers

    original_direct = routing_wrappers._route_direct or routing_wrappers._load_direct()
    split["route_direct_us"] = []

    def timed_direct(*args: Any, **kwargs: Any) -> Any:  # a rewritten seam's whole call (twin included)
        started = time.perf_counter()
        try:
            return original_direct(*args, **kwargs)
        finally:
            split["route_direct_us"].append((time.perf_counter() - started) * 1e6)

    routing_calls.route_call, routing_calls.run_routed = timed_route_call, timed_run_routed
    routing_wrappers._route_direct = timed_direct
    try:
        for step in range(3 * calls + 2):
            order = variants[:]
            rng.shuffle(order)
            for variant in order:
                elapsed = one_call(variant)
                if step >= 2:  # two warm-up pairs
                    samples[variant].append(elapsed)
    finally:
        routing_calls.route_call, routing_calls.run_routed = original_route_call, original_run_routed
        routing_wrappers._route_direct = original_direct
    result: dict[str, Any] = {"seqs": seqs, "calls": calls,
                              "route_call_us": statistics.median(split["route_call_us"] or [0.0]),
                              "fork_body_us": statistics.median(split["fork_body_us"] or [0.0]),
                              "route_direct_us": statistics.median(split["route_direct_us"] or [0.0])}
    for variant in variants:
        profiler = cProfile.Profile()
        for _ in range(calls):
            one_call(variant, profiler)
        stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, _)
        ranked = sorted(((f"{path.rsplit('site-packages/', 1)[-1]}:{line}({name})", count, own, cumulative)
                         for (path, line, name), (_, count, own, cumulative, _) in stats.items()),
                        key=lambda row: -row[3])[:120]
        result[variant] = {"enqueue_us": statistics.median(samples[variant]), "enqueue_samples_us": samples[variant],
                           "profile": [{"function": name, "calls_per_layer_call": count / calls,
                                        "own_us": own / calls * 1e6, "cumulative_us": cumulative / calls * 1e6}
                                       for name, count, own, cumulative in ranked]}
    bench.raw.copy_(snapshot)
    return result


def run_child_main(args: argparse.Namespace) -> int:
    """Child body: activate the overlay first, then build the layer from vLLM's own code and run everything."""
    result: dict[str, Any] = {"layer": args.child, "mode": args.mode, "facts": {}, "cases": [], "timing": []}
    facts = result["facts"]
    out = pathlib.Path(args.child_out)

    def save() -> None:  # after every step: a child killed for time still leaves what it measured
        out.write_text(json.dumps(result, default=str))
    try:

        facts["kda_patches_env"] = {k: v for k, v in os.environ.items() if k.startswith("KDA_PATCHES")}
        from kda_patches.bench.autotune import limit_autotune

        limit_autotune()  # before vLLM imports its kernels; baseline and patched keep the same config
        if not args.dry_run:
            facts["stood_in"] = stood_in_record()
            facts["stand_in_finder_installed"] = any(type(f).__name__ == "StandInFinder" for f in sys.meta_path)
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
        facts["runner_env"] = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        facts.update(torch=torch.__version__, device=str(device), device_name=torch.cuda.get_device_name()
                     if device.type == "cuda" else "cpu")
        started = time.perf_counter()
        bench = LayerBench(args.child, device, args.dry_run, facts, args.prefill_backend)
        facts["build_s"] = round(time.perf_counter() - started, 1)
        overlay = Overlay(PATCH_OF[args.child]) if args.mode == "on" else None
        result["patched_available"] = bool(overlay is not None and overlay.available())
        from kda_patches.ledger import get_ledger

        facts["ledger_after_build"] = get_ledger().snapshot().get("patches", {})
        if result["patched_available"]:
            facts["plans"] = publish_plans(bench)
        print(f"[{args.child} {args.mode}] built: {json.dumps(facts, default=str)}", flush=True)
        cases = QUICK_CASES if args.dry_run else CASES
        for index, (name, decodes, prefills) in enumerate(cases):
            case = run_case(bench, overlay if result["patched_available"] else None, name, decodes, prefills,
                            seed=100 + index)
            result["cases"].append(case)
            save()
            shown = {key: value for key, value in case.items() if "digest" not in key}
            print(f"[{args.child} {args.mode}] {name}: {json.dumps(shown)}", flush=True)
        if args.mode == "on" and not args.dry_run:
            shapes = ((1, 16, 16), (2, 16, 16)) if args.dry_run else tuple((s, TIMED_LEN, TIMED_CACHED)
                                                                          for s in TIMED_SEQS)
            for seqs, new, cached in shapes:
                row = time_shape(bench, overlay if result["patched_available"] else None, seqs,
                                 1 if args.dry_run else args.rounds, new, cached, args.settle, args.burst)
                result["timing"].append(row)
                save()
                print(f"[{args.child}] timing {seqs}x{new}: " + json.dumps(
                    {k: v for k, v in row.items() if k != "samples"}), flush=True)
            if args.copy_costs and result["patched_available"]:
                result["copy_costs"] = time_copy_costs(bench, args.rounds, args.graph_instances)
                save()
            for seqs in args.host_profile:
                profile = profile_host(bench, overlay if result["patched_available"] else None, seqs, 20, args.settle)
                result.setdefault("host_profile", []).append(profile)
                save()
                print(f"[{args.child}] host enqueue {seqs}x{TIMED_LEN}: " + ", ".join(
                    f"{variant} {profile[variant]['enqueue_us']:.1f} us" for variant in ("baseline", "patched")
                    if variant in profile) + f"; patched: route_call {profile['route_call_us']:.1f} us, of which the "
                    f"fork's body {profile['fork_body_us']:.1f} us; route_direct {profile['route_direct_us']:.1f} us "
                    "(medians; a seam runs one of the two mechanisms)", flush=True)
        result["ledger"] = get_ledger().snapshot()
    except BaseException as error:  # the parent reports it; the traceback goes to the log
        traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {error}"
    save()
    return 0 if "error" not in result else 1


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out/gpu"), help="folder for the JSON and log")
    parser.add_argument("--bundle", help="bundle zip (default .bundle/vllm-0.33.0-cpXY.zip for this interpreter, "
                                         "else the one gpu_harness.py staged)")
    parser.add_argument("--site", default=str(SITE_DIR), help="where the bundle is unpacked and installed")
    parser.add_argument("--dry-run", action="store_true", help="CPU machine: CPU platform, Triton interpreter")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per shape (after one warm-up round)")
    parser.add_argument("--settle", type=int, default=1, metavar="N",
                        help="untimed calls of a variant after each overlay switch, before its timed call")
    parser.add_argument("--burst", type=int, default=8, metavar="K",
                        help="calls per timed step (back to back on one metadata object, as one engine step)")
    parser.add_argument("--copy-costs", action="store_true",
                        help="also time the seam's copies alone, the fork's ops against the overlay's plan")
    parser.add_argument("--graph-instances", type=int, default=5, metavar="N",
                        help="--copy-costs: capture each copy N times anew, each capture replayed in rounds/N "
                             "rounds (N must divide --rounds)")
    parser.add_argument("--layers", nargs="+", choices=LAYERS,
                        help="default: every layer that can run on the bundle's vLLM (layers_for)")
    parser.add_argument("--gdn-ops", choices=("overlay", "upstream"), default="overlay",
                        help="KDA_PATCHES_GDN_OPS of the children (vLLM >= 0.34: overlay routes the seams where "
                             "upstream's own ops copy the states, so patched vs unpatched is plan vs upstream)")
    parser.add_argument("--state-io", choices=("copy", "indexed", "auto"), default="copy",
                        help="KDA_PATCHES_STATE_IO of the children (indexed: no copy, every routed call must be "
                             "indexed; auto: those of at least its crossover's prefills)")
    parser.add_argument("--prefill-backend", choices=tuple(PREFILL_BACKENDS), default="triton",
                        help="triton: force the Triton prefill the seams route; default: vLLM's own choice for the "
                             "GPU (where a seam stands aside on it, patched vs unpatched times the wrapper alone)")
    parser.add_argument("--skip-off", action="store_true", help="no KDA_PATCHES=0 process")
    parser.add_argument("--host-profile", type=int, nargs="*", default=[], metavar="SEQS",
                        help="also profile the layer call's host side at these batch sizes (x512 tokens)")
    parser.add_argument("--child-timeout-s", type=float, default=300.0, help="kill a child after this long")
    parser.add_argument("--child", choices=LAYERS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # kda_patches.bench.stats.check_graph_instances' rule: importing the package here would activate the overlay
    if args.copy_costs and (args.graph_instances < 1 or args.rounds % args.graph_instances):
        parser.error(f"--graph-instances {args.graph_instances} must be at least 1 and divide --rounds "
                     f"({args.rounds}): pick --rounds as a multiple of it")
    return run_child_main(args) if args.child else run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
