"""Child process: vLLM 0.34.0's four seam layers, every case in one process, on the CPU.

``python upstream034_child.py SPEC OUT`` (:mod:`batch_child`): group argument ``ROOT``, the release's folder in the
release cache (the parent fetches it: importing :mod:`kda_patches.releases.fetch` here would activate the overlay
too early); cases ``LAYER:CACHE_DTYPE:CONV_LAYOUT`` with ``LAYER`` one of :data:`upstream034_standins.LAYERS`
(``qwen``, ``linear``, ``k3``, ``olmo``). One process runs all its cases, so the 0.34 coverage costs one process
per side (issue 28: each fresh process costs 20-40 s here) instead of one pair per case; the parent runs the same
cases with ``KDA_PATCHES=0`` and with the overlay on in each choice.

The frame is :mod:`upstream_child`'s: the overlay activated, the release's files executed under their real module
names on the installed vLLM 0.32 (``vllm.__version__`` reports 0.34.0, so the overlay picks 0.34's targets) --
the four layer files, upstream's own state ops ``gather_initial_states`` / ``scatter_states`` with the warmup
dispatcher ``scatter_states`` launches through (their Triton kernels run by the interpreter) and Kimi K3's
packed-convolution module. Only device kernels are stood in (:mod:`upstream034_standins` declares what differs
from 0.33). The V2 runner (0.34 has no other) is the stand-in with 0.34's 5-parameter ``initialize_kv_cache``:
each case's runner binds poisoned pages for its two layers, and the overlay's startup hook prepares their plans.
Here the overlay is activated late, after 0.34's runner-group members (see :func:`setup`).

Each case draws its layers and inputs from its own generator (its own fresh seed), so a case's results do not
depend on the others. A process with ``:indexed`` cases executes the release's FLA (and, for Kimi cases, KDA)
chunk-rule files; where it runs other cases too (one baseline process serving the 0.34 layer A/B and the no-copy
A/B, :func:`released_batches.upstream034`), Olmo's and the Kimi layers' chunk rules are set per case -- the
release's for ``:indexed`` cases, the stand-ins elsewhere, as in a process without ``:indexed`` cases. vLLM caches
the conv-state layout per process (``get_conv_state_layout``): each case sets its own
(:func:`upstream_standins.set_conv_layout`, the cache cleared).

Saved (``torch.save``): ``cases`` -> per case ``outputs``, ``snapshots``, ``counters`` (the case's ledger counter
increments per section), ``launches`` (upstream's two kernels launched during the case), ``facts`` (its layers'
plan facts per section), ``class``, ``layer_file``, ``wrapped`` (the seam's type on the class), ``conv``,
``eager_break`` (the seam on the class is 0.34's eager_break_during_capture wrapper); and
``ledger`` (the final snapshot), ``status`` (what ``kda-patches status`` prints for it), ``bound``, ``standins``.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import sys
import types
from typing import Any

import batch_child
import torch

RELEASE = "0.34.0"


@dataclasses.dataclass
class State:
    """What the cases of one process share."""

    stack: Any
    runner_module: Any
    modules: dict[str, Any]
    kernel_tables: list[dict[str, int]]
    # a process with ':indexed' and other cases (a baseline serving both): (owner, name, stand-in, release's rule)
    # per chunk rule that the release's own replaced process-wide, set per case (see run_case)
    chunk_rules: tuple[tuple[Any, str, Any, Any], ...] = ()

    def launched(self) -> dict[str, int]:
        """Return upstream's two kernels' launches so far."""
        return {name: count for table in self.kernel_tables for name, count in table.items()}


MODES = ("breakable", "flashinfer", "flashkda", "indexed")


def parse_case(case: str) -> tuple[str, str, str, str | None]:
    """``"qwen:float32:SD"`` -> ``("qwen", "float32", "SD", None)``; a mode suffix names the mode: ``:breakable``
    (each layer call captured under the released breakable CUDA graph, then replayed), ``:flashinfer`` (a GDN
    layer on the FlashInfer prefill backend), ``:flashkda`` (Kimi K3 on FlashKDA, 0.34's SM90+ default) or
    ``:indexed`` (Qwen's chunk call reaching the release's own FLA chunk rule, run by the interpreter)."""
    kind, dtype, layout, *mode = case.split(":")
    if len(mode) > 1 or (mode and mode[0] not in MODES):
        raise ValueError(f"case {case!r}: the modes are {MODES}")
    return kind, dtype, layout, mode[0] if mode else None


def setup(args: list[str], cases: list[str]) -> State:
    import upstream034_standins as standins
    import vllm
    from ascend_gdn030_standins import count_kernel_launches, interpreter_accepts_integer_masks
    from release_loader import ReleaseStack
    from runner_standin import make_runner_module

    (root,) = args
    assert "kda_patches" not in sys.modules, "the overlay was activated before the release's runner group was imported"
    vllm.__version__ = RELEASE  # the overlay reads the stack's version here (the executed files are the release's)
    root = pathlib.Path(root)
    interpreter_accepts_integer_masks()  # gather_initial_states' `mask & flag.to(tl.int1)` (as for vllm-ascend 0.30)
    standins.interpreter_rounds_bf16_downcasts()  # scatter_states' FP32 -> BF16 store, as compiled Triton rounds it
    runner = make_runner_module(root / standins.RUNNER_FILE, standins.RUNNER_MODULE, "GPUModelRunner")
    early = sorted(set(standins.RELEASE_MODULES) & set(sys.modules))
    assert not early, f"installed modules already imported under release names (would shadow the release): {early}"
    indexed = any(parse_case(case)[3] == "indexed" for case in cases)
    kda_indexed = any(parse_case(case)[3] == "indexed" and parse_case(case)[0] in ("linear", "k3") for case in cases)
    release_modules = (*standins.RELEASE_MODULES, *(standins.FLA_MODULES if indexed else ()),
                       *(standins.KDA_MODULES if kda_indexed else ()))
    stack = ReleaseStack(root, "", RELEASE, release_modules, real=standins.REAL, absent_inert=True,
                         standins=standins.standin_modules(), lifted=standins.LIFTED,
                         modules={standins.RUNNER_MODULE: runner,
                                  standins.EXTENSIBLE_MODULE: standins.extensible_module(root)}).install()
    # 0.34's runner-group members first, then the overlay (activated late, as vLLM's plugin entry point does): a
    # group's verdict reads members not imported yet from the installed tree's source, which is 0.32's here (a V2
    # runner without `extensible`, no extensible_kv_cache module); imported, they are read live -- the release's
    runner_module = importlib.import_module(standins.RUNNER_MODULE)
    importlib.import_module(standins.EXTENSIBLE_MODULE)
    if indexed:  # fixed before the overlay wraps them: the indexed twin is derived from the module as it then is
        from fla_interpreter import fix_for_interpreter

        for module in (*standins.FLA_MODULES, *(standins.KDA_MODULES[1:] if kda_indexed else ())):
            fix_for_interpreter(importlib.import_module(module))  # each autotuner keeps its first config (BV=32)
    import kda_patches  # noqa: F401  (activated here, late: see above)

    standins.install()  # after the stack: the kernels' packages import release modules (Kimi's package: its layers)
    if indexed:  # Olmo imports FLA's chunk rule from the package: the release's own in ':indexed' processes
        importlib.import_module(standins.FLA_OPS).chunk_gated_delta_rule = importlib.import_module(
            f"{standins.FLA_OPS}.chunk").chunk_gated_delta_rule
    if kda_indexed:  # the release's own KDA chunk rule where ':indexed' cases need it (the stand-in elsewhere)
        kda = importlib.import_module(standins.KDA_OPS)
        kda.chunk_kda_with_fused_gate = importlib.import_module(f"{standins.KDA_OPS}.chunk").chunk_kda_with_fused_gate
    standins.install_breakable_standins(importlib.import_module(standins.BREAKABLE_MODULE))
    standins.register_flashkda_op()
    modules = {kind: importlib.import_module(module) for kind, (module, _, _) in standins.LAYERS.items()}
    standins.install_layer_standins(modules)
    tables = [count_kernel_launches(importlib.import_module(module), (kernel,)) for module, kernel in standins.KERNELS]
    chunk_rules = []
    if indexed and not all(parse_case(case)[3] == "indexed" for case in cases):  # each case picks its own rule
        import gdn_standins
        import upstream_standins

        if "olmo" in modules:  # bound by name at the layer module's import: the release's here
            chunk_rules.append((modules["olmo"], "chunk_gated_delta_rule", gdn_standins.chunk_gated_delta_rule,
                                modules["olmo"].chunk_gated_delta_rule))
        if kda_indexed:  # imported from the package per call
            chunk_rules.append((kda, "chunk_kda_with_fused_gate", upstream_standins.chunk_kda_with_fused_gate,
                                kda.chunk_kda_with_fused_gate))
    return State(stack, runner_module, modules, tables, tuple(chunk_rules))


def run_case(state: State, case: str, seed: int) -> dict[str, Any]:
    import upstream034_standins as standins
    from batch_plan import BLOCKS, CONV_WIDTH, HEAD_DIM, HEADS, MAX_NUM_SEQS
    from runner_standin import PageSpec

    import kda_patches

    kind, cache_dtype, conv_layout, mode = parse_case(case)
    standins.set_conv_layout(conv_layout)
    for owner, name, standin, release in state.chunk_rules:  # a mixed process: as in a process of this case's kind
        setattr(owner, name, release if mode == "indexed" else standin)
    _, class_name, method = standins.LAYERS[kind]
    cls = getattr(state.modules[kind], class_name)
    generator = torch.Generator().manual_seed(seed)
    first = 2 * batch_child.current_slot  # the case's slot in its batch: the same layer names on every side
    names = [f"model.layers.{first + i}.{standins.SUFFIX[kind]}" for i in range(2)]
    backend = mode if mode in ("flashinfer", "flashkda") else "triton"
    layers = {name: standins.build_layer(kind, cls, name, generator, backend, getattr(torch, cache_dtype))
              for name in names}
    if mode == "indexed":
        rule = standins.released_chunk_rule(sys.modules[f"{standins.FLA_OPS}.chunk"])
        for layer in layers.values():
            object.__setattr__(layer, "chunk_gated_delta_rule", rule)
    case_runner = state.runner_module.GPUModelRunner(layers, MAX_NUM_SEQS, seed)
    config = {name: PageSpec(BLOCKS, HEADS, HEAD_DIM, getattr(torch, cache_dtype),
                             CONV_WIDTH, conv_layout=conv_layout) for name in layers}
    launches_before = state.launched()
    case_runner.initialize_kv_cache(config, False, None, False)
    invoke = standins.capture_and_replay(sys.modules[standins.BREAKABLE_MODULE]) if mode == "breakable" else None
    outputs, snapshots = standins.run_batches(kind, layers, case_runner.raw_caches, generator, invoke)
    after, launches_after = kda_patches.get_ledger().snapshot(), state.launched()
    return {
        "outputs": outputs, "snapshots": snapshots,
        "launches": {name: launches_after[name] - launches_before[name] for name in launches_after},
        "facts": {section: {name: after.get("facts", {}).get(section, {}).get(name) for name in layers}
                  for section in ("gdn_state_copy", "kimi_prefill")},
        "class": cls.__qualname__, "layer_file": getattr(cls, method).__code__.co_filename,
        "wrapped": type(vars(cls)[method]).__name__, "conv": state.modules[kind].causal_conv1d_fn.__name__,
        "eager_break": seam_code(vars(cls)[method]).co_qualname.startswith("eager_break_during_capture.")}


def seam_code(seam: Any) -> Any:
    """The code object of the seam function on the class (under the overlay's wrapper, if any)."""
    return (seam if isinstance(seam, types.FunctionType) else seam.__wrapped__).__code__


def describe(state: State) -> dict[str, Any]:
    import upstream034_standins as standins

    import kda_patches
    from kda_patches.cli import format_ledger

    return {"bound": state.stack.bound, "standins": standins.STANDINS,
            "status": format_ledger(kda_patches.get_ledger().snapshot())}


if __name__ == "__main__":
    batch_child.serve(setup, run_case, describe)
