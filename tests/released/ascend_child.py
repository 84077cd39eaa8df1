"""Child process: one vllm-ascend release's GDN ``_forward_core`` and Kimi ``_run_prefill``, every case in one process.

``python ascend_child.py SPEC OUT`` (:mod:`batch_child`): group arguments ``RELEASE VARIANT``. ``VARIANT`` is the
GDN layer's prefill path, a property of the device the process models, so it is one per process: ``fused`` (the
CANN fused chunk ``torch_npu.npu_chunk_gated_delta_rule`` is present: the fork's probe succeeds, gather/scatter on
the cache layout), ``triton`` (absent: the fork's ``.transpose(-1, -2).contiguous()`` gather/scatter around its
Triton chunk; 0.26 has only this one) or ``fla`` (0.30: the FLA NPU branch, ``gather_ssm_states`` ->
``DeviceOperator.fla_gdn_prefill`` -> ``scatter_ssm_states_``, the fork's Triton state-index kernels under the
interpreter). Cases are ``gdn:CACHE_DTYPE`` and ``kimi:CACHE_DTYPE``.

Setup: the overlay is activated (``import kda_patches``; the parent sets ``KDA_PATCHES=0|1``, STRICT, and any
switch such as ``KDA_PATCHES_GDN_PLAN``), the release's files are installed under their real names
(:class:`release_loader.ReleaseStack`: ``clear_ssm_states`` and, for the kinds that run, ``gdn.py`` (+ 0.30's
``state_index.py``) and ``kimi_kda.py`` (+ ``kda.py`` and 0.30's own plan modules where the release has them));
the device calls are stood in (:mod:`ascend_gdn_standins` / :mod:`ascend_gdn030_standins` for GDN,
:mod:`ascend_standins` for Kimi: the union of both tables, GDN's entries winning where both declare a module --
the Kimi kernels of ``torch.ops._C_ascend`` and fla_npu's ``chunk_kda_fwd`` are kept beside GDN's); the stand-in
runner module (the release's ``initialize_kv_cache`` parameters; on 0.30 it then calls the fork's own
``initialize_kda_state_copy``, as the release's runner does, which skips every non-Kimi layer) is imported
first, then the layer modules (the overlay's hooks wrap them).

Each case builds two layers of its own from its seed (names unique in the process), binds their poisoned pages
through a runner of its own (the overlay's startup hook prepares the plans) and runs its batches: GDN the shared
batch plan (:mod:`ascend_gdn_layers`, :mod:`ascend_gdn030_layers`), Kimi :data:`ascend_kimi_layers.BATCHES`
(after a startup that raised -- the 0.30 fork's plan refuses CPU caches -- no batch runs; ``init_error`` says why).

Saved per case: ``outputs``, ``snapshots``, ``standins``, ``class``, ``init_error``, ``wrapped`` (the seam's type on
the class); GDN ``fused`` (what the fork's probe answered) and, for ``fla``, ``branch`` (prefill calls per branch)
and ``kernel_launches`` (the fork's state-index kernels) during the case; Kimi ``fork_initialize`` (the type of
the fork's ``initialize_kda_state_copy``) and ``fork_plan``. Per process: ``bound``.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any

import ascend_gdn030_standins as gdn030_standins
import ascend_gdn_standins as gdn_standins
import ascend_standins
import batch_child
import torch
from ascend_gdn030_layers import fla_metadata_of
from ascend_gdn_layers import bind_layers, metadata_of
from ascend_kimi_layers import BATCHES, BLOCKS, HEAD_DIM, HEADS, LAYERS, MAX_NUM_SEQS, batch_inputs, build_layer
from batch_plan import run_forward_core_batches
from runner_standin import PageSpec

VARIANTS = ("fused", "triton", "fla")
# Kimi's optional release files: kda.py (0.28+), the fork's own plan and its kernels (0.30)
KIMI_OPTIONAL = (ascend_standins.KDA_MODULE, ascend_standins.PLAN_MODULE, "vllm_ascend.ops.triton.batch_memcpy",
                 "vllm_ascend.ops.triton.kda_state_copy_kernel")


@dataclasses.dataclass
class State:
    """What the cases of one process share."""

    release: str
    variant: str
    stack: Any
    runner_class: type
    modules: dict[str, Any]
    launches: dict[str, int]
    cases_run: int = 0


def setup(args: list[str], cases: list[str]) -> State:
    from release_loader import ReleaseStack, classes_defining
    from runner_standin import make_runner_module

    import kda_patches  # noqa: F401  (activates the overlay before the release's files are imported)
    from kda_patches.releases.fetch import release_dir

    release, variant = args
    if variant not in VARIANTS:
        raise SystemExit(f"variant {variant!r}: one of {VARIANTS}")
    kinds = {case.split(":")[0] for case in cases}
    root = release_dir("vllm-ascend", release)
    modules = [ascend_standins.CLEAR_MODULE]
    real = ascend_standins.REAL
    table: dict[str, dict[str, Any]] = {}
    if "kimi" in kinds:
        ascend_standins.install_c_ascend()
        modules.append(ascend_standins.KIMI_MODULE)
        table = ascend_standins.standin_modules(release)
    # the fork's own plan modules where the release has them: its runner calls the plan after binding (0.30)
    modules += [name for name in KIMI_OPTIONAL if (root / (name.replace(".", "/") + ".py")).exists()]
    if "gdn" in kinds:
        if variant == "fla":
            gdn030_standins.interpreter_accepts_integer_masks()
            gdn_table = gdn030_standins.gdn030_standin_modules(release)
            modules += [gdn_standins.GDN_MODULE, gdn030_standins.STATE_INDEX_MODULE]
        else:
            gdn_standins.install_c_ascend_gdn()
            gdn_table = gdn_standins.gdn_standin_modules(release, variant == "fused")
            modules.append(gdn_standins.GDN_MODULE)
        real = real + gdn_standins.REAL_MODULES
        # built after Kimi's table: its torch_npu (and torch.npu) is the one that stays installed
        table = {module: {**table.get(module, {}), **gdn_table.get(module, {})} for module in {*table, *gdn_table}}
    runner = make_runner_module(root / "vllm_ascend/worker/model_runner_v1.py", ascend_standins.RUNNER_MODULE,
                                "NPUModelRunner", ascend_standins.PLAN_MODULE)
    stack = ReleaseStack(root, "vllm-ascend", release, modules, real=real, inert=ascend_standins.INERT,
                         standins=table, modules={ascend_standins.RUNNER_MODULE: runner}).install()
    # The worker imports its runner before the model's layer modules (the order a real worker has).
    runner_module = importlib.import_module(ascend_standins.RUNNER_MODULE)
    loaded: dict[str, Any] = {}
    launches: dict[str, int] = {}
    if "gdn" in kinds:
        loaded["gdn"] = importlib.import_module(gdn_standins.GDN_MODULE)
        if variant == "fla":
            launches = gdn030_standins.count_kernel_launches(sys.modules[gdn030_standins.STATE_INDEX_MODULE])
    if "kimi" in kinds:
        kimi = importlib.import_module(ascend_standins.KIMI_MODULE)
        (class_name,) = classes_defining(root / "vllm_ascend/ops/kimi_kda.py", "_run_prefill")
        loaded["kimi"] = getattr(kimi, class_name)
    return State(release, variant, stack, runner_module.NPUModelRunner, loaded, launches)


def run_gdn(state: State, cache_dtype: str, seed: int, first: int) -> dict[str, Any]:
    """One GDN case: the release's ``_forward_core`` over the shared batch plan."""
    cls = state.modules["gdn"].AscendGatedDeltaNetAttention
    metadata_class = gdn_standins.GDNAttentionMetadata
    branch, launches = dict(gdn030_standins.BRANCH_CALLS), dict(state.launches)
    layers, runner, generator = bind_layers(cls, state.runner_class, seed, cache_dtype, first)
    if state.variant == "fla":
        prepare_chunk_indices = sys.modules[ascend_standins.CLEAR_MODULE].prepare_chunk_indices
        metadata = lambda batch: fla_metadata_of(batch, metadata_class, prepare_chunk_indices)  # noqa: E731
    else:
        metadata = lambda batch: metadata_of(batch, metadata_class)  # noqa: E731
    outputs, snapshots = run_forward_core_batches(layers, runner.raw_caches, metadata, generator)
    result = {"outputs": outputs, "snapshots": snapshots, "class": cls.__qualname__, "init_error": None,
              "standins": gdn030_standins.STANDINS if state.variant == "fla" else gdn_standins.STANDINS,
              "wrapped": type(vars(cls)["_forward_core"]).__name__,
              "fused": bool(cls._probe_fused_chunk()) if hasattr(cls, "_probe_fused_chunk") else False}
    if state.variant == "fla":
        result["branch"] = {name: count - branch[name] for name, count in gdn030_standins.BRANCH_CALLS.items()}
        result["kernel_launches"] = {name: count - launches[name] for name, count in state.launches.items()}
    return result


def run_kimi(state: State, cache_dtype: str, seed: int, first: int) -> dict[str, Any]:
    """One Kimi case: the release's ``_run_prefill`` over :data:`ascend_kimi_layers.BATCHES` (after its startup)."""
    cls = state.modules["kimi"]
    generator = torch.Generator().manual_seed(seed)
    names = [f"model.layers.{first + i}.self_attn" for i in range(LAYERS)]
    layers = {name: build_layer(cls, name, generator) for name in names}
    runner = state.runner_class(layers, MAX_NUM_SEQS, seed)
    error = None
    try:
        runner.initialize_kv_cache({name: PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype))
                                    for name in layers})
    except Exception as caught:  # the parent decides whether this release may fail here
        error = f"{type(caught).__name__}: {caught}"
    outputs, snapshots = [], []
    if error is None:
        snapshots.append({name: raw.clone() for name, raw in runner.raw_caches.items()})
        for batch in BATCHES:
            tensors, indices, flags, metadata = batch_inputs(batch, generator)
            for layer in layers.values():
                outputs.append(layer._run_prefill(*tensors, layer.kv_cache[1], indices, flags, metadata))
            snapshots.append({name: raw.clone() for name, raw in runner.raw_caches.items()})
    fork_initialize = getattr(sys.modules.get(ascend_standins.PLAN_MODULE), "initialize_kda_state_copy", None)
    return {"outputs": outputs, "snapshots": snapshots, "standins": ascend_standins.STANDINS[state.release],
            "class": cls.__name__, "init_error": error, "wrapped": type(vars(cls)["_run_prefill"]).__name__,
            "fork_initialize": type(fork_initialize).__name__,
            "fork_plan": [type(getattr(layer, "_ascend_kda_state_copy", None)).__name__ for layer in layers.values()]}


def run_case(state: State, case: str, seed: int) -> dict[str, Any]:
    kind, cache_dtype = case.split(":")
    first, state.cases_run = LAYERS * state.cases_run, state.cases_run + 1
    return (run_gdn if kind == "gdn" else run_kimi)(state, cache_dtype, seed, first)


def describe(state: State) -> dict[str, Any]:
    return {"bound": state.stack.bound}


if __name__ == "__main__":
    batch_child.serve(setup, run_case, describe)
