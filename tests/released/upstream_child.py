"""Child process: vLLM's Qwen / Olmo GDN ``_forward_core`` and Kimi K3 / Kimi Linear ``_forward``, one source's cases.

``python upstream_child.py SPEC OUT`` (:mod:`batch_child`): group argument ``SOURCE`` -- ``installed`` (vLLM 0.32,
the real modules) or a vLLM release such as ``0.33.0``, whose layer files then run under their real module names
on the installed vLLM (its other imports are the installed modules; names the installed vLLM lacks are inert),
with ``vllm.__version__`` reporting the release so the overlay picks that release's targets. Cases are
``KIND:CACHE_DTYPE:CONV_LAYOUT``: ``KIND`` one of :data:`KINDS` (``qwen``, ``olmo``, ``k3``, ``linear``),
``CONV_LAYOUT`` ``SD`` / ``DS`` (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``, set per case:
:func:`upstream_standins.set_conv_layout`). One process per side runs every case of its source (issue 28).

Setup: the overlay is activated first (``import kda_patches``; the parent sets ``KDA_PATCHES=0|1``, STRICT in
both), the release's layer files of the cases' kinds are installed (:class:`release_loader.ReleaseStack`), the
device kernels are stood in at the names the layer modules import (:mod:`gdn_standins` for Qwen / Olmo,
:mod:`upstream_standins` for the Kimi layers: only those of the kinds that run), the worker's runner module (the
stand-in ``GPUModelRunner``) is imported, then the layer modules (the overlay's hooks wrap their seams). Each
case builds two layers of its own (from its seed; names unique in the process), binds their poisoned pages
through a runner of its own (the overlay's startup hook prepares the plans) and runs the shared batch plan
through the layer's own seam inside a real ``ForwardContext`` (:mod:`upstream_gdn_layers`,
:mod:`upstream_kimi_layers`).

``:indexed`` cases (``KIND:CACHE_DTYPE:CONV_LAYOUT:indexed``, a release only; Qwen, Kimi Linear, Kimi K3): the
layer's chunk call reaches the release's own chunk rule -- the vendored FLA ``chunk_gated_delta_rule`` (Qwen's
``chunk_gated_delta_rule`` attribute, its Triton branch) or Kimi K3's ``chunk_kda_with_fused_gate`` (the Kimi
layers import it per call from its package, set per case) -- executed from the release
(:data:`upstream034_standins.FLA_MODULES` / ``KDA_MODULES``; their ``vllm.triton_utils`` the real ``triton``, as on
a device), its Triton kernels run by the interpreter, so
``KDA_PATCHES_STATE_IO=indexed`` has the release's own chunk-state kernel to derive its twin from. Each of those files
gets :mod:`fla_interpreter`'s fixes as it is executed, before the overlay's post-import hook sees it (the twin is
derived from the module as it then is); FP32 -> BF16 stores round as compiled Triton does
(:func:`upstream034_standins.interpreter_rounds_bf16_downcasts`). The other cases of such a process keep the
stand-in chunk rules.

Saved per case: ``outputs``, ``snapshots``, ``layer_file``, ``class``, ``wrapped`` (the seam's type on the class),
``conv`` (the causal convolution the module binds), ``standins`` (the written list of its kind), for the Kimi
layers ``gather_wrapped``, for ``:indexed`` cases ``chunk_rule`` (the module of the chunk rule that ran); per
process ``bound``.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
from typing import Any

import batch_child
import gdn_standins
import torch
import upstream_standins
from batch_plan import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, LAYERS, MAX_NUM_SEQS, run_forward_core_batches
from runner_standin import PageSpec

# kind -> (module, class, seam method, layer-name suffix, the written stand-in list)
KINDS = {
    "qwen": (*gdn_standins.LAYERS["qwen"][:2], "_forward_core", "linear_attn", gdn_standins.LAYERS["qwen"][2]),
    "olmo": (*gdn_standins.LAYERS["olmo"][:2], "_forward_core", "linear_attn", gdn_standins.LAYERS["olmo"][2]),
    "k3": (*upstream_standins.LAYERS["k3"][:2], "_forward", "self_attn", upstream_standins.STANDINS),
    "linear": (*upstream_standins.LAYERS["linear"][:2], "_forward", "self_attn", upstream_standins.STANDINS),
}
GDN_KINDS = ("qwen", "olmo")
RELEASE_FIELDS = {"flashinfer_checkpoint_plan": None}  # 0.33+'s GDN metadata field 0.32's class lacks


@dataclasses.dataclass
class State:
    """What the cases of one process share."""

    stack: Any
    runner_module: Any
    modules: dict[str, Any]
    extra_fields: dict[str, Any]
    chunk_rules: bool = False  # the release's chunk rules are loaded (':indexed' cases): each case picks its own


def kind_of(case: str) -> str:
    """``"qwen:float32:SD"`` -> ``"qwen"``."""
    return case.split(":")[0]


def is_indexed(case: str) -> bool:
    """``"qwen:float32:SD:indexed"`` -> True (the release's own chunk rule runs; see the module docstring)."""
    return case.split(":")[3:] == ["indexed"]


def fix_release_chunk_rules(stack: Any, modules: tuple[str, ...]) -> None:
    """Apply :mod:`fla_interpreter`'s fixes to each of ``modules`` the stack executes, right after its body ran
    (before the overlay's post-import hook, which runs after the loader: the twin sees the fixed module)."""
    from fla_interpreter import fix_for_interpreter

    execute = stack.exec_module

    def exec_module(module: Any) -> None:
        execute(module)
        if module.__name__ in modules:
            fix_for_interpreter(module)  # each autotuner keeps its first config

    stack.exec_module = exec_module


def setup(args: list[str], cases: list[str]) -> State:
    from ascend_standins import REAL, triton_utils
    from release_loader import ReleaseStack
    from runner_standin import make_runner_module

    import kda_patches  # noqa: F401  (activates the overlay before anything of vLLM is imported)

    (source,) = args
    kinds = sorted({kind_of(case) for case in cases})
    indexed = sorted({kind_of(case) for case in cases if is_indexed(case)})
    assert source != "installed" or not indexed, "':indexed' cases run a release's files (the chunk rules executed)"
    vllm = importlib.import_module("vllm")  # after the overlay's activation above (not reordered by isort)
    release: tuple[str, ...] = ()
    root = pathlib.Path(vllm.__file__).parent.parent
    extra_fields = {}
    if source != "installed":
        from kda_patches.releases.fetch import release_dir

        root, release = release_dir("vllm", source), tuple(KINDS[kind][0] for kind in kinds)
        vllm.__version__ = source  # the overlay reads the stack's version here (the layers are the release's)
        extra_fields = dict(RELEASE_FIELDS)
    runner = make_runner_module(root / "vllm/v1/worker/gpu_model_runner.py", upstream_standins.RUNNER_MODULE,
                                "GPUModelRunner")
    chunk_rules: tuple[str, ...] = ()
    if indexed:
        import upstream034_standins as standins034

        standins034.interpreter_rounds_bf16_downcasts()
        chunk_rules = (*standins034.FLA_MODULES, *(standins034.KDA_MODULES if set(indexed) - {"qwen"} else ()))
    stack = ReleaseStack(root, "", vllm.__version__, (*release, *chunk_rules), real=("vllm", "transformers", *REAL),
                         absent_inert=True, modules={upstream_standins.RUNNER_MODULE: runner},
                         standins={"vllm.triton_utils": triton_utils()} if indexed else None).install()
    if indexed:  # the KDA package's __init__ only imports its files
        fix_release_chunk_rules(stack, tuple(set(chunk_rules) - {standins034.KDA_OPS}))
    # after the stack: importing the kernels' packages may import the layer modules
    if any(kind in GDN_KINDS for kind in kinds):
        gdn_standins.install_upstream()
    if any(kind not in GDN_KINDS for kind in kinds):
        upstream_standins.install()
    runner_module = importlib.import_module(upstream_standins.RUNNER_MODULE)  # the worker's runner first
    modules = {kind: importlib.import_module(KINDS[kind][0]) for kind in kinds}
    if "olmo" in modules:  # its gating is a Triton kernel vLLM's CPU build disables; not an overlay target
        modules["olmo"].fused_olmo_hybrid_gdn_gating = gdn_standins.fused_olmo_hybrid_gdn_gating
    return State(stack, runner_module, modules, extra_fields, chunk_rules=bool(indexed))


def chunk_rule_of(layer: Any, kind: str, indexed: bool) -> str:
    """Put the case's chunk rule in place: the release's own for ``:indexed`` cases, else the stand-in; return the
    module of the one that will run (Qwen: the layer's attribute; the Kimi layers: their package's name, which
    ``_forward`` imports per call)."""
    import sys

    import upstream034_standins as standins034

    if kind in GDN_KINDS:
        if indexed:
            object.__setattr__(layer, "chunk_gated_delta_rule",
                               standins034.released_chunk_rule(sys.modules[f"{standins034.FLA_OPS}.chunk"]))
        return sys.modules[f"{standins034.FLA_OPS}.chunk"].__name__ if indexed else gdn_standins.__name__
    package = importlib.import_module(standins034.KDA_OPS)
    rule = importlib.import_module(f"{standins034.KDA_OPS}.chunk").chunk_kda_with_fused_gate if indexed \
        else upstream_standins.chunk_kda_with_fused_gate
    package.chunk_kda_with_fused_gate = rule
    return rule.__module__


def run_case(state: State, case: str, seed: int) -> dict[str, Any]:
    from upstream_gdn_layers import build_layer as build_gdn_layer
    from upstream_gdn_layers import metadata_of
    from upstream_kimi_layers import build_layer as build_kimi_layer
    from upstream_kimi_layers import run_forward_batches

    kind, cache_dtype, conv_layout = case.split(":")[:3]
    indexed = is_indexed(case)
    upstream_standins.set_conv_layout(conv_layout)
    _, class_name, method, suffix, standins = KINDS[kind]
    module = state.modules[kind]
    cls = getattr(module, class_name)
    build = build_gdn_layer if kind in GDN_KINDS else build_kimi_layer
    generator = torch.Generator().manual_seed(seed)
    first = LAYERS * batch_child.current_slot  # the case's slot in its batch: the same layer names on every side
    names = [f"model.layers.{first + i}.{suffix}" for i in range(LAYERS)]
    layers = {name: build(cls, name, generator) for name in names}
    chunk_rule = None
    if state.chunk_rules:
        chunk_rule = {chunk_rule_of(layer, kind, indexed) for layer in layers.values()}.pop()
    if kind == "qwen":  # the real layer's __init__ sets it (0.31+): its Triton branch, the one the chunk rule takes
        for layer in layers.values():
            object.__setattr__(layer, "gdn_prefill_backend", "triton")
    runner = state.runner_module.GPUModelRunner(layers, MAX_NUM_SEQS, seed)
    spec = PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype), CONV_WIDTH, conv_layout=conv_layout)
    runner.initialize_kv_cache(dict.fromkeys(layers, spec), False, None)
    if kind in GDN_KINDS:
        outputs, snapshots = run_forward_core_batches(layers, runner.raw_caches,
                                                      lambda batch: metadata_of(batch, state.extra_fields), generator)
    else:
        outputs, snapshots = run_forward_batches(layers, runner.raw_caches, generator)
    result = {"outputs": outputs, "snapshots": snapshots, "layer_file": getattr(cls, method).__code__.co_filename,
              "class": cls.__qualname__, "wrapped": type(vars(cls)[method]).__name__,
              "conv": module.causal_conv1d_fn.__name__, "standins": standins, "init_error": None,
              "chunk_rule": chunk_rule}
    if kind not in GDN_KINDS:
        result["gather_wrapped"] = type(module.gather_initial_states).__name__
    return result


def describe(state: State) -> dict[str, Any]:
    return {"bound": state.stack.bound}


if __name__ == "__main__":
    batch_child.serve(setup, run_case, describe)
