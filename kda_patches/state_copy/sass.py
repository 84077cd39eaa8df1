"""Read what NVIDIA's assembler made of a plan's kernels: cross-compile a variant for an SM90 GPU and list its
memory instructions in issue order.

No GPU is needed: Triton's CUDA backend and the ``ptxas`` / ``cuobjdump`` it ships run on any machine. Used by
``tests/state_copy/test_state_copy_sass.py`` (the scatter's packed load stays ahead of its early exit),
``tests/state_copy/pdl_compile_child.py`` (the grid-dependency instructions in the PTX) and
``scripts/gpu/sass_order.py`` (the same listing from the kernels a GPU compiled).
"""

from __future__ import annotations

import pathlib
import subprocess
import tempfile
from typing import Any

from kda_patches.state_copy.kernels import ROWS_INDEX

KEPT = ("LDG", "STG", "EXIT", "BAR")  # loads, stores, exits and barriers: what decides the memory order


def cuobjdump() -> pathlib.Path:
    """Return the ``cuobjdump`` of the installed Triton's CUDA backend.

    Raises:
        FileNotFoundError: this Triton ships no CUDA backend binaries (name the path and the fix).
    """
    import triton

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        raise FileNotFoundError(f"{tool} is missing: install a Triton wheel with its CUDA backend (pip install "
                                "triton) to read SASS")
    return tool


def cross_compile(spec: dict[str, Any], capability: int = 90) -> Any:
    """Compile one variant spec of :meth:`~kda_patches.state_copy.plan.StateCopyPlan.variant_specs` for an
    ``sm_<capability>`` GPU, with the four pointers 16-byte aligned (what a live launch specializes on).

    Args:
        spec: the variant: ``kernel``, ``signature``, ``constexprs``, ``num_warps``, ``launch_pdl``.
        capability: the compute capability, e.g. 90.
    Returns:
        Triton's compiled kernel: ``asm["ptx"]``, ``asm["cubin"]``.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    aligned = {(position,): [["tt.divisibility", 16]] for position in range(ROWS_INDEX)}  # the four pointers
    source = ASTSource(fn=spec["kernel"], signature=spec["signature"], constexprs=spec["constexprs"], attrs=aligned)
    options = {"num_warps": spec["num_warps"], "launch_pdl": spec["launch_pdl"]}
    return compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def memory_order(cubin: bytes) -> list[str]:
    """Return the opcodes (with their predicate, e.g. ``@P0 EXIT``) of ``cubin``'s loads, stores, exits and
    barriers, in the order the code issues them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([str(cuobjdump()), "-sass", handle.name], capture_output=True, text=True,
                              check=True).stdout
    order = []
    for line in text.splitlines():
        if "/*0" not in line or "*/" not in line:
            continue
        words = line.split("*/", 1)[1].split(";")[0].split()
        if not words:
            continue
        predicate = words[0] if words[0].startswith("@") else ""
        opcode = words[1] if predicate and len(words) > 1 else words[0]
        if opcode.split(".")[0] in KEPT:
            order.append(f"{predicate} {opcode}".strip())
    return order


def loads_after_early_exit(order: list[str]) -> list[str]:
    """Return the loads issued after the first predicated exit of ``order`` (:func:`memory_order`): loads that
    wait for whatever decided the exit."""
    early = next((place for place, op in enumerate(order) if op.startswith("@") and op.endswith("EXIT")), None)
    if early is None:
        return []
    return [op for op in order[early + 1:] if op.split()[-1].startswith("LDG")]
