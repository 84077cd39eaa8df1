"""The fork's released Kimi state-copy plans, ported to the device at hand, for ``kda-patches bench peer``.

vllm-ascend 0.30 ships its own Kimi plans (``vllm_ascend/ops/kda_state_copy_plan.py``): ``KDAStateCopyPlan``
(a fused Triton kernel, chosen on 950/A5) and ``StridedKDAFallbackPlan`` (a byte copy through
``batch_memcpy_kernel``, chosen everywhere else). The file names its device namespace, so it is loaded with
exactly the replacements :data:`PORT` declares (each must occur, or the load fails naming it) and nothing else:

- ``torch.npu.`` -> ``torch.cuda.`` (device context, synchronize, current device);
- ``state.device.type != "npu"`` -> ``!= "cuda"`` (the plans' device checks);
- the fallback's compiled launch gets its ``BLOCK_SIZE`` constexpr (8192, the value it was compiled with):
  CUDA Triton's launcher takes the constexprs, the Ascend launcher binds them itself.

In ``kda_state_copy_kernel.py`` only the Python layout check's ``state.device.type != "npu"`` becomes
``"cuda"`` (:data:`KERNEL_PORT`); the ``@triton.jit`` kernels of both kernel files are untouched (same lines, so
Triton reads the release's own kernel source), and ``batch_memcpy.py`` runs unchanged. The plan file's other
imports are answered for the import only: ``vllm.forward_context`` and ``vllm.utils.torch_utils`` (used only
by its ``torch.compile`` custom ops, which eager benchmark calls never reach: ``direct_register_custom_op``
records and registers nothing), ``vllm_ascend.utils.is_950`` (not called on this path). Each plan is
prepared and sealed by its own ``prepare`` / ``seal`` on the first call for a cache layout (the benchmark's
correctness check, before timing), as the fork's ``initialize_kda_state_copy`` does at worker startup.
"""

from __future__ import annotations

import types
from typing import Any

PLAN_FILE = "vllm_ascend/ops/kda_state_copy_plan.py"
KERNEL_FILES = {"vllm_ascend.ops.triton.kda_state_copy_kernel": "vllm_ascend/ops/triton/kda_state_copy_kernel.py",
                "vllm_ascend.ops.triton.batch_memcpy": "vllm_ascend/ops/triton/batch_memcpy.py"}
KERNEL_PORT = {"vllm_ascend.ops.triton.kda_state_copy_kernel": (
    ('if state.device.type != "npu":', 'if state.device.type != "cuda":', "the layout check's device type"),)}
PLAN_CLASSES = ("KDAStateCopyPlan", "StridedKDAFallbackPlan")
FOREIGN_KERNELS = ("_kda_state_copy_kernel", "batch_memcpy_kernel")
PORT = (
    ("torch.npu.", "torch.cuda.", "the device namespace"),
    ('state.device.type != "npu"', 'state.device.type != "cuda"', "the plans' device checks"),
    ("self._compiled[(count, 1, 1)](src, dst, sizes)", "self._compiled[(count, 1, 1)](src, dst, sizes, 8192)",
     "CUDA Triton's compiled launcher takes the BLOCK_SIZE constexpr the Ascend launcher binds itself"),
)


class ForkPlanImpl:
    """``(gather, scatter)`` of one fork plan class: prepared and sealed per cache layout on first use."""

    def __init__(self, plan_class: Any, signature: Any) -> None:
        self.plan_class = plan_class
        self.signature = signature
        self.plans: dict[Any, Any] = {}

    def plan_for(self, state: Any) -> Any:
        key = self.signature(state)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plan_class.prepare(state, int(state.shape[0]))
            plan.seal()
            plan._layer_name = "bench-peer"  # the fork's initialize binds this name when it publishes a plan
            self.plans[key] = plan
        return plan

    def gather(self, state: Any, indices: Any, flags: Any) -> Any:
        return self.plan_for(state).gather(state, indices, flags)

    def scatter(self, state: Any, last: Any, indices: Any) -> None:
        self.plan_for(state).scatter(state, last, indices)


def _stand_ins() -> dict[str, Any]:
    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bench peer: the fork's custom-op path (torch.compile) is not measured")

    registered: list[str] = []

    def direct_register_custom_op(op_name: str, *args: Any, **kwargs: Any) -> None:
        registered.append(op_name)

    forward_context = types.ModuleType("vllm.forward_context")
    forward_context.get_forward_context = unavailable
    torch_utils = types.ModuleType("vllm.utils.torch_utils")
    torch_utils.direct_register_custom_op = direct_register_custom_op
    torch_utils.registered = registered
    ascend_utils = types.ModuleType("vllm_ascend.utils")
    ascend_utils.is_950 = unavailable
    return {"vllm.forward_context": forward_context, "vllm.utils.torch_utils": torch_utils,
            "vllm_ascend.utils": ascend_utils}


def fork_kimi_impls(root: Any, label: str) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
    """Return ``({"<label> <plan class>": (gather, scatter)}, applied port lines)`` from one release folder.

    Args:
        root: the release folder (:func:`kda_patches.releases.fetch.release_dir`).
        label: the release's label (``vllm-ascend-0.30.0rc2``).
    Raises:
        FileNotFoundError: the release has no ``kda_state_copy_plan.py`` (before 0.30).
        kda_patches.releases.load.PortMismatch: the file changed where the port replaces text.
    """
    import sys

    from kda_patches.releases.load import load_ported_module, load_released_module

    modules = _stand_ins()
    for package in ("vllm", "vllm.utils", "vllm_ascend", "vllm_ascend.ops", "vllm_ascend.ops.triton"):
        if package not in sys.modules:  # a namespace for the dotted names; an installed package stays itself
            modules[package] = types.ModuleType(package)
    applied = []
    for name, relative in KERNEL_FILES.items():
        if name in KERNEL_PORT:
            modules[name], lines = load_ported_module(root, relative, KERNEL_PORT[name], {})
            applied += [f"{relative}: {line}" for line in lines]
        else:
            modules[name] = load_released_module(root, relative)
    plan_module, lines = load_ported_module(root, PLAN_FILE, PORT, modules)
    applied += [f"{PLAN_FILE}: {line}" for line in lines]
    impls = {}
    for name in PLAN_CLASSES:
        impl = ForkPlanImpl(getattr(plan_module, name), plan_module.cache_signature)
        impls[f"{label} {name}"] = (impl.gather, impl.scatter)
    return impls, applied
