"""vLLM 0.33's whole engine on the GPU (issue 18), probe stage: how far ``LLM.generate`` gets, overlay off and on.

The GPU machine has torch 2.11 and no vLLM; the bundle of ``scripts/gpu/vllm_bundle.py`` brings vLLM 0.33's
``.py`` files without its compiled extensions (built for torch 2.14). This script starts the real engine on a tiny
dummy-weight Qwen3.5 GDN hybrid (written here) in fresh processes -- per model runner (V1:
``VLLM_USE_V2_MODEL_RUNNER=0``; V2) with ``KDA_PATCHES=0``, then ``KDA_PATCHES=1`` + ``KDA_PATCHES_STRICT=1`` --
and reports per process the stage it reached, the token ids it generated and the overlay's ledger counters, or
the first failure with its traceback.

What is stood in, and how (every stand-in is listed in the JSON with where it was looked up):

- the two modules of ``vllm_layers_check.STOOD_IN`` (the compiled op library's import and FA's package), and
  its capability queries (answer False);
- the ``torch.ops._C`` ops of :data:`OP_LOOKUP_ONLY` (looked up where the engine builds a layer, never called on
  the paths run here: *calling* one raises ``StoodInOpCalled`` naming it) and :data:`OP_STAND_INS` (with the op's
  semantics). Every other missing op still raises AttributeError -- ``hasattr`` probes keep their answer, which
  vLLM uses to choose compiled paths -- and :class:`OpRecorder` records each miss with its call site, so a probe
  run names what is looked up next.

Usage: ``python scripts/gpu/vllm_engine_check.py --out DIR [--bundle ZIP] [--runners v1 v2] [--modes off on]
[--dry-run]``.
``--dry-run`` writes the model directory and the stand-in list and starts nothing (no vLLM needed: CPU tests).
Writes ``DIR/vllm_engine.json``; prints one ``ENGINE`` line per runner and mode.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback
from typing import Any

SCRIPT_DIR = pathlib.Path(__file__).resolve().parent
ROOT = SCRIPT_DIR.parents[1]
sys.path.insert(0, str(SCRIPT_DIR))
import vllm_layers_check  # noqa: E402  (the bundle and its module stand-ins are shared)

sys.path.remove(str(SCRIPT_DIR))

RUNNERS = {"v1": "0", "v2": "1"}  # VLLM_USE_V2_MODEL_RUNNER
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23] * 20, [31] * 300]  # fresh prefills, one chunked
OP_LOOKUP_ONLY = {
    "silu_and_mul": "SiluAndMul.__init__ (layers/activation.py) stores it on CUDA; with custom_ops none its native "
    "forward runs",
}
OP_STAND_INS = {
    "get_cuda_view_from_cpu_tensor": "the V2 runner's UVA buffers: a CUDA tensor over the same pinned host memory "
    "(CUDA unified addressing maps a pinned host pointer to the same device address), built through "
    "__cuda_array_interface__; the real op does the same through cudaHostGetDevicePointer",
}


class StoodInOpCalled(RuntimeError):
    """vLLM called a compiled op that is only stood in for its lookup."""


class LookedUpOp:
    """What ``torch.ops._C.<name>`` returns for an op the bundle lacks: recorded; raises when called."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise StoodInOpCalled(f"torch.ops._C.{self.name} was called, and it is only stood in for its lookup (vLLM's "
                              "compiled extensions are not in the bundle): this call site needs a real stand-in")


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
    """Records every miss of a ``torch.ops._C`` lookup; answers the declared stand-ins (module docstring)."""

    def __init__(self) -> None:
        self.looked_up: dict[str, str] = {}
        self.original: Any = None

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
        if name in OP_STAND_INS:
            return STAND_IN_FUNCTIONS[name]
        return LookedUpOp(name) if name in OP_LOOKUP_ONLY else None


RECORDER = OpRecorder()


def install_engine_stand_ins() -> None:
    """The module stand-ins of ``vllm_layers_check`` plus the op recorder (the generated sitecustomize calls it)."""
    vllm_layers_check.install_stand_ins()
    RECORDER.install()


def write_stand_in_hook(folder: pathlib.Path) -> pathlib.Path:
    """Write ``folder/sitecustomize.py`` installing :func:`install_engine_stand_ins` in every process."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "# written by kda_patches scripts/gpu/vllm_engine_check.py: stand-ins for vLLM's compiled extensions\n"
        f"import sys\nsys.path.insert(0, {str(SCRIPT_DIR)!r})\nimport vllm_engine_check\n"
        f"sys.path.remove({str(SCRIPT_DIR)!r})\nvllm_engine_check.install_engine_stand_ins()\n")
    return folder


def write_model_dir(root: pathlib.Path) -> pathlib.Path:
    """Write a tiny dense Qwen3.5 GDN hybrid's ``config.json`` (4 layers, linear/full attention alternating)."""
    config = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 1024,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
              "linear_num_key_heads": 4, "linear_num_value_heads": 12, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 2048,
              "vocab_size": 1024, "torch_dtype": "bfloat16", "max_position_embeddings": 4096,
              "full_attention_interval": 2, "rms_norm_eps": 1e-6,
              "layer_types": ["linear_attention", "full_attention"] * 2}
    path = root / "qwen3_5_tiny"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def child_env(site: pathlib.Path, hook: pathlib.Path, runner: str, enabled: bool, status_dir: pathlib.Path
              ) -> dict[str, str]:
    """The environment of one engine process: bundle, stand-in hook, runner choice, overlay switches."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(ROOT), str(site), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("TRITON_INTERPRET", None)
    env.update(KDA_PATCHES="1" if enabled else "0", KDA_PATCHES_STRICT="1", KDA_PATCHES_STATUS_DIR=str(status_dir),
               VLLM_USE_V2_MODEL_RUNNER=RUNNERS[runner], VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_USE_FLASHINFER_SAMPLER="0", PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1",
               VLLM_DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_engine(model: str, result: dict[str, Any]) -> None:
    """Child body: the overlay (when switched on) before vLLM, then ``LLM`` and ``generate`` on :data:`PROMPTS`."""
    import kda_patches  # noqa: F401  (activates the overlay, as the sitecustomize/.pth entry does)

    result["stage"] = "import vllm"
    from vllm import LLM, SamplingParams

    result["stage"] = "LLM()"
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              attention_backend="TRITON_ATTN", compilation_config={"custom_ops": ["none"]}, max_model_len=1024,
              max_num_seqs=8, max_num_batched_tokens=256, gpu_memory_utilization=0.3, seed=0,
              # FLA's Triton chunk, as in vllm_layers_check: on SM90 "auto" picks FlashInfer's GDN prefill, which
              # the bundle lacks (probe run 2 stopped there, importing flashinfer.gdn_prefill)
              additional_config={"gdn_prefill_backend": "triton", "kda_prefill_backend": "triton",
                                 "kda_decode_backend": "triton"})
    result["stage"] = "generate"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    result["tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
    result["stage"] = "done"


def run_child_main(args: argparse.Namespace) -> int:
    """One engine process: run, record the stage reached, the failure, the lookups; write the JSON."""
    result: dict[str, Any] = {"runner": args.runner, "mode": args.mode, "stage": "start"}
    try:
        run_engine(args.model, result)
    except BaseException as error:  # recorded, not swallowed: the parent's verdict reports it
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        result["traceback"] = traceback.format_exc()[-6000:]
    installed = sys.modules.get("vllm_engine_check")  # the sitecustomize's instance; this one runs as __main__
    result["ops_looked_up"] = dict((installed.RECORDER if installed else RECORDER).looked_up)
    pathlib.Path(args.child_out).write_text(json.dumps(result, default=str))
    return 0


def read_counters(status_dir: pathlib.Path) -> dict[str, Any]:
    """Sum the counters of every ledger the engine's processes wrote."""
    from kda_patches.ledger import read_ledger_dir, sum_counters

    return sum_counters(read_ledger_dir(str(status_dir))) if status_dir.is_dir() else {}


def run_parent(args: argparse.Namespace) -> int:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = write_model_dir(out)
    report: dict[str, Any] = {"model": json.loads((model / "config.json").read_text()), "prompts": PROMPTS,
                              "stood_in": {**vllm_layers_check.stood_in_record(), **{
                                  f"torch.ops._C.{name}": why for name, why in {**OP_LOOKUP_ONLY,
                                                                                **OP_STAND_INS}.items()}},
                              "runs": []}
    if args.dry_run:
        (out / "vllm_engine.json").write_text(json.dumps(report, indent=1))
        print(f"DRYRUN model {model}; {len(report['stood_in'])} stand-ins declared; no engine started")
        return 0
    site = vllm_layers_check.SITE_DIR
    report["bundle"] = vllm_layers_check.unpack_bundle(pathlib.Path(args.bundle), site)
    hook = write_stand_in_hook(site.with_name(site.name + "-engine-standins"))
    for runner in args.runners:
        for mode in args.modes:
            enabled = mode == "on"
            status_dir = out / f"ledgers-{runner}-{mode}"
            child_out = out / f".child-{runner}-{mode}.json"
            argv = [sys.executable, __file__, "--child", "--runner", runner, "--mode", mode, "--model", str(model),
                    "--child-out", str(child_out), "--out", str(out)]
            started = time.perf_counter()
            try:
                done = subprocess.run(argv, env=child_env(site, hook, runner, enabled, status_dir), capture_output=True,
                                      text=True, timeout=args.child_timeout_s)
                code, tail = done.returncode, (done.stdout + done.stderr)[-4000:]
            except subprocess.TimeoutExpired as expired:
                code, tail = "timeout", str(expired.stdout or "")[-4000:]
            run = json.loads(child_out.read_text()) if child_out.is_file() else {"stage": "no result"}
            run.update(returncode=code, wall_s=round(time.perf_counter() - started, 1), output_tail=tail,
                       counters=read_counters(status_dir))
            report["runs"].append(run)
            print(f"ENGINE qwen3_5_tiny {runner} KDA_PATCHES={int(enabled)}: reached {run['stage']}"
                  + (f"; {run['error'][:300]}" if run.get("error") else f"; tokens {run.get('tokens')}")
                  + f"; gdn_state_copy {run['counters'].get('gdn_state_copy', {})}", flush=True)
            (out / "vllm_engine.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--bundle", default=str(vllm_layers_check.BUNDLE_DIR / "vllm-0.33.0-cp312.zip"))
    parser.add_argument("--runners", nargs="+", choices=sorted(RUNNERS), default=["v1", "v2"])
    parser.add_argument("--modes", nargs="+", choices=["off", "on"], default=["off", "on"],
                        help="KDA_PATCHES=0 (off) and/or =1 (on), in this order")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--child-timeout-s", type=float, default=240)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--runner", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return run_child_main(args) if args.child else run_parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
