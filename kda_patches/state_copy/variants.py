"""Compiled kernel variants launched directly, the compiler-configuration snapshot, and JIT hooks.

Serving never enters the Triton JIT: :func:`compile_variant` compiles a kernel once (through
``JITFunction.warmup`` on scratch tensors) and returns a :class:`CompiledVariant` whose
:meth:`~CompiledVariant.launch` calls the compiled launcher with the stored function handle,
bypassing the JIT's argument binder and cache lookup. Under ``TRITON_INTERPRET=1`` there is no
compiler; :class:`InterpretedVariant` runs the interpreter's executor on the kernel function it
took at prepare, with the same argument order, so it too never enters ``InterpretedFunction.run``.

Pointer arguments of a compiled launch are raw ``data_ptr()`` integers; the compiled signature
(pointer element types, 16-byte divisibility of each pointer) was fixed at compile time by the
scratch tensors, and the plan checks each call's tensors against it before launch. The cache's row
count follows the four pointers as the kernels' one runtime scalar (``num_rows``, never specialized:
:data:`~kda_patches.state_copy.kernels.ROWS_TYPE`), passed by the plan per launch from the cache's
``shape[0]``; then the constexprs, so a launch's arguments are in the kernel's parameter order.

Where the Triton release's C launch entry has a known argument order (:data:`DIRECT_ENTRY_RELEASES`)
and the kernel needs no global or profile scratch, a launch without launch hooks calls that entry
itself and skips ``CudaLauncher.__call__`` (its two scratch allocations are no-ops then). On the H200 host
that measured a small saving per launch in some runs and none beyond the host's spread in others
(``docs/results/h200-gdn-state-copy``): a small gain, not a reliable one. Launch hooks, any
other release, and scratch-using kernels take the launcher. Either way the entry is proven on scratch
at prepare, and :attr:`CompiledVariant.entry` names the one in use (plan description, ledger).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton

# Triton's signature type of each pointer dtype the plans' kernels take (``triton.compile``'s ``signature``)
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8",
                 torch.int32: "*i32", torch.int64: "*i64", torch.bool: "*i1"}
CONFIG_PREFIXES = ("TRITON_", "ASCEND_", "CANN_", "TORCH_NPU_", "NPU_", "LLVM_")
CONFIG_NAMES = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH")


def snapshot_configuration(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Return the compiler/runtime configuration a compiled plan depends on.

    Read at prepare and at seal only, never per call.

    Args:
        environ: environment to read (default ``os.environ``).
    Returns:
        ``{"torch": version, "triton": version, "environ": {name: value}}`` with every
        TRITON_/ASCEND_/CANN_/TORCH_NPU_/NPU_/LLVM_ variable and LD_LIBRARY_PATH, LD_PRELOAD, PYTHONPATH.
    """
    env = os.environ if environ is None else environ
    selected = {name: value for name, value in env.items()
                if name.startswith(CONFIG_PREFIXES) or name in CONFIG_NAMES}
    return {"torch": torch.__version__, "triton": triton.__version__, "environ": dict(sorted(selected.items()))}


def describe_drift(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """List what changed between two configuration snapshots (empty when nothing did)."""
    changes = [f"{key} {before[key]} -> {after[key]}" for key in ("torch", "triton") if before[key] != after[key]]
    env_before, env_after = before["environ"], after["environ"]
    for name in sorted(set(env_before) | set(env_after)):
        if env_before.get(name) != env_after.get(name):
            changes.append(f"{name}: {env_before.get(name)!r} -> {env_after.get(name)!r}")
    return changes


# Triton releases whose CUDA launcher's C entry takes (gridX, gridY, gridZ, stream, function, cooperative,
# pdl, global_scratch, profile_scratch, kernel_metadata, launch_metadata, enter_hook, exit_hook, *args):
# 3.6 executed on the H200; 3.5.0/3.5.1 by reading their driver.py (the same entry). 3.4 has no
# profile_scratch, and 3.7-3.9 take another order (metadata and hooks first, then the arguments as one tuple):
# those take the launcher.
DIRECT_ENTRY_RELEASES = ("3.5", "3.6")
ENTRY_DIRECT = "direct"
ENTRY_LAUNCHER = "launcher"
ENTRY_INTERPRETER = "interpreter"


def direct_entry(launcher: Any, version: str | None = None) -> Any:
    """Return ``launcher``'s C entry when its argument order is declared and no scratch is needed.

    Args:
        launcher: a compiled kernel's ``run`` (Triton's ``CudaLauncher``).
        version: the Triton version (default: the installed one).
    Returns:
        The C ``launch`` function, or None (the launcher must be called).
    """
    release = ".".join((version or triton.__version__).split(".")[:2])
    if release not in DIRECT_ENTRY_RELEASES or type(launcher).__name__ != "CudaLauncher":
        return None
    needed = ("launch", "global_scratch_size", "profile_scratch_size", "launch_cooperative_grid", "launch_pdl")
    if not all(hasattr(launcher, name) for name in needed):
        return None
    if launcher.global_scratch_size or launcher.profile_scratch_size:
        return None
    return launcher.launch


def pre_run_hook_count(kernel: Any) -> int:
    """Return how many JIT pre-run hooks ``kernel`` (a JIT or interpreted function) carries."""
    return len(getattr(kernel, "pre_run_hooks", ()))


class CompiledVariant:
    """One compiled kernel, launched through its stored launcher without the JIT.

    Attributes:
        name: variant name (``gather/int32`` ...), for messages and the ledger.
        kernel: the ``@triton.jit`` function it was compiled from (for the hook check).
        takes_bytes: whether tensors are addressed as bytes (fallback kernel).
        entry: ``"direct"`` (Triton's C entry, see the module docstring) or ``"launcher"``.
    """

    __slots__ = ("_args", "_compiled", "_device_index", "_entry", "_entry_head", "_function", "_get_stream",
                 "_metadata", "_run", "_runtime", "entry", "kernel", "name", "takes_bytes")

    def __init__(self, name: str, kernel: Any, compiled: Any, constexprs: tuple[Any, ...], device: torch.device,
                 takes_bytes: bool) -> None:
        from triton import knobs
        from triton.runtime import driver

        self.name = name
        self.kernel = kernel
        self.takes_bytes = takes_bytes
        self._compiled = compiled
        self._run = compiled.run  # builds the launcher and loads the module (raises on resource errors)
        self._function = compiled.function
        self._metadata = compiled.packed_metadata
        self._args = constexprs
        self._device_index = device.index if device.index is not None else driver.active.get_current_device()
        self._get_stream = driver.active.get_current_stream
        self._runtime = knobs.runtime
        self._entry = direct_entry(self._run)
        self.entry = ENTRY_LAUNCHER if self._entry is None else ENTRY_DIRECT
        # the C entry's arguments after the stream that never change: function, cooperative, pdl, no scratch,
        # metadata, no launch metadata or hooks (only used when the entry is direct, so the attributes exist)
        self._entry_head = () if self._entry is None else (
            self._function, self._run.launch_cooperative_grid, self._run.launch_pdl, None, None, self._metadata,
            None, None, None)

    def launch(self, grid: tuple[int, int], cache: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor,
               flags: torch.Tensor, rows: int) -> None:
        """Launch on the current stream. Tensors must satisfy the compiled pointer contract.

        Args:
            grid: ``(grid_x, grid_y)``.
            cache, packed, indices, flags: see the kernel's pointer contract.
            rows: the cache's row count ``shape[0]`` (the kernel's ``num_rows``: valid indices are below it).
        """
        stream = self._get_stream(self._device_index)
        enter = self._runtime.launch_enter_hook
        if enter is None or not getattr(enter, "calls", True):
            if self._entry is not None:
                self._entry(grid[0], grid[1], 1, stream, *self._entry_head, cache.data_ptr(), packed.data_ptr(),
                            indices.data_ptr(), flags.data_ptr(), rows, *self._args)
                return
            enter = exit_hook = metadata = None
        else:
            exit_hook = self._runtime.launch_exit_hook
            metadata = self._compiled.launch_metadata((*grid, 1), stream, cache.data_ptr(), packed.data_ptr(),
                                                      indices.data_ptr(), flags.data_ptr(), rows, *self._args)
        self._run(grid[0], grid[1], 1, stream, self._function, self._metadata, metadata, enter, exit_hook,
                  cache.data_ptr(), packed.data_ptr(), indices.data_ptr(), flags.data_ptr(), rows, *self._args)


class InterpretedVariant:
    """One kernel run by the Triton interpreter (CPU tensors, ``TRITON_INTERPRET=1``).

    Like :class:`CompiledVariant`, it keeps what the JIT entry would look up and launches without
    re-entering it: the interpreter's rewritten kernel function (``InterpretedFunction.rewrite()``,
    taken at prepare) run by the interpreter's grid executor. ``InterpretedFunction.run`` and
    ``__getitem__`` are never called after prepare, so a test guard on them sees a plan that re-enters
    Triton's launch path on the CPU, as the guard on ``JITFunction.run`` does on a GPU.
    """

    __slots__ = ("_arg_names", "_args", "_executor", "_function", "kernel", "name", "takes_bytes")
    entry = ENTRY_INTERPRETER

    def __init__(self, name: str, kernel: Any, constexprs: tuple[Any, ...], takes_bytes: bool) -> None:
        from triton.runtime.interpreter import GridExecutor

        self.name = name
        self.kernel = kernel
        self.takes_bytes = takes_bytes
        self._args = constexprs
        self._function = kernel.rewrite() if hasattr(kernel, "rewrite") else kernel.fn  # older interpreters
        self._arg_names = list(kernel.arg_names)
        self._executor = GridExecutor

    def launch(self, grid: tuple[int, int], cache: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor,
               flags: torch.Tensor, rows: int) -> None:
        """Run the interpreter over ``grid`` (same contract as :meth:`CompiledVariant.launch`)."""
        if self.takes_bytes:
            cache, packed = as_bytes(cache), as_bytes(packed)
        # no pre-run hooks: direct launches never run them (the plan refuses a kernel that has any)
        self._executor(self._function, self._arg_names, grid, [])(cache, packed, indices, flags, rows, *self._args)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Return a uint8 view of a tensor whose last dimension is contiguous."""
    return tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)


def compile_variant(name: str, kernel: Any, scratch: tuple[torch.Tensor, ...], constexprs: tuple[Any, ...],
                    num_warps: int, interpreted: bool, takes_bytes: bool,
                    launch_pdl: bool = False) -> CompiledVariant | InterpretedVariant:
    """Compile ``kernel`` for the scratch tensors' signature (or wrap it for the interpreter).

    Args:
        name: variant name.
        kernel: the ``@triton.jit`` kernel.
        scratch: ``(cache, packed, indices, flags)`` disposable tensors with the live call's dtypes and
            16-byte alignment classes; never the live cache. The row count compiled with is the scratch
            cache's ``shape[0]``; it is a runtime argument the kernels never specialize on, so the variant
            serves every row count.
        constexprs: the kernel's constexpr values, in parameter order (after ``num_rows``).
        num_warps: warps per program.
        interpreted: True under ``TRITON_INTERPRET=1``.
        takes_bytes: the kernel addresses cache and packed as bytes.
        launch_pdl: compile with Triton's ``launch_pdl`` option (programmatic dependent launch; the launcher then
            sets the launch attribute on every launch, the direct entry included).
    Returns:
        The launchable variant.
    """
    if interpreted:
        return InterpretedVariant(name, kernel, constexprs, takes_bytes)
    cache, packed, indices, flags = scratch
    rows = cache.shape[0]
    if takes_bytes:
        cache, packed = as_bytes(cache), as_bytes(packed)
    options = {"launch_pdl": True} if launch_pdl else {}
    compiled = kernel.warmup(cache, packed, indices, flags, rows, *constexprs, grid=(1, 1, 1), num_warps=num_warps,
                             **options)
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        raise RuntimeError(f"Triton did not return a compiled kernel for {name} (async or hooked compilation "
                           "is not supported for state-copy plans)")
    return CompiledVariant(name, kernel, compiled, constexprs, cache.device, takes_bytes)
