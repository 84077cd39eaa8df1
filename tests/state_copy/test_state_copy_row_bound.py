"""The cache's row count is a runtime argument of the kernels, never part of the compiled code.

vLLM 0.34's extensible KV cache rebinds every layer's views to another ``shape[0]`` after warmup; the plans
keep their compiled variants only because the row bound ``num_rows`` is passed per launch and Triton
never specializes on its value. Two checks that need no GPU:

- Triton's own binder (the compiled JIT, not the interpreter: a fresh process without
  ``TRITON_INTERPRET``) gives every row count the same specialization, i.e. the same compile inputs;
- a compiled variant's launch (the direct C entry, the launcher, and the launcher with a launch hook)
  passes the arguments in the kernel's parameter order, with the row count it was given as ``num_rows``.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kda_patches.state_copy import kernels
from kda_patches.state_copy.plan import FallbackStatePlan, FusedStatePlan
from kda_patches.state_copy.variants import CompiledVariant

ROW_COUNTS = (1, 16, 3001, 4096, 65536)  # 1 and multiples of 16 are what Triton would specialize on

SPECIALIZATIONS = r"""
import json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from kda_patches.state_copy.device import TARGETS
from kda_patches.state_copy.plan import FallbackStatePlan, FusedStatePlan
from kda_patches.ascend_check.plan_variants import cast_policies, meta_cache

rows = json.loads(sys.argv[1])
backend = make_backend(GPUTarget("cuda", 90, 32))
found = {}
for plan_class, cache_dtype in ((FusedStatePlan, torch.bfloat16), (FallbackStatePlan, torch.float16)):
    state = meta_cache((2, 16, 32), cache_dtype)
    policies = cast_policies(cache_dtype, 1, (torch.float32, cache_dtype))
    for spec in plan_class.variant_specs(state, 8, TARGETS["cuda"], policies):
        kernel = spec["kernel"]
        assert isinstance(kernel, JITFunction), type(kernel)  # compiled Triton, not the interpreter
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        pointers = [torch.zeros(16, dtype=dtype) for dtype in spec["pointers"]]
        per_rows = {}
        for count in rows:
            _, specialization, _ = binder(*pointers, count, *spec["constexprs"].values())
            per_rows[count] = [list(map(str, item)) for item in specialization]
        found[spec["name"] + " " + kernel.__name__] = {
            "rows_parameter": kernel.arg_names[4], "per_rows": per_rows}  # ROWS_INDEX, checked by the test
print(json.dumps(found))
"""


def test_no_row_count_changes_the_compiled_specialization() -> None:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SPECIALIZATIONS, json.dumps(ROW_COUNTS)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    names = {name.split(" ")[1] for name in found}
    assert names == {"copy_rows_kernel", "copy_row_bytes_kernel", "scatter_cast_items_kernel"}
    for name, facts in found.items():
        assert facts["rows_parameter"] == kernels.ROWS_ARGUMENT, name
        specializations = [facts["per_rows"][str(count)] for count in ROW_COUNTS]
        assert all(item == specializations[0] for item in specializations), name  # one compile for every count
        assert specializations[0][kernels.ROWS_INDEX] == [kernels.ROWS_TYPE, "None"], name  # runtime i32, no facts


class Recorder:
    """Stands for Triton's C entry / launcher / launch-metadata call: records the arguments."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> None:
        self.seen.append(args)


def stand_in_variant(kernel: Any, constexprs: tuple[Any, ...], direct: bool, hook: Any = None) -> CompiledVariant:
    """A :class:`CompiledVariant` whose compiled pieces are recorders (no GPU: only its argument order is real)."""
    variant = CompiledVariant.__new__(CompiledVariant)
    variant.name, variant.kernel, variant.takes_bytes = "stand-in", kernel, False
    variant._args = constexprs
    variant._device_index = 0
    variant._get_stream = lambda index: 1234
    variant._runtime = SimpleNamespace(launch_enter_hook=hook, launch_exit_hook=None)
    variant._function, variant._metadata = "function", "packed-metadata"
    variant._run = Recorder()
    variant._compiled = SimpleNamespace(launch_metadata=Recorder())
    variant._entry = Recorder() if direct else None
    variant._entry_head = ("function", False, False, None, None, "packed-metadata", None, None, None) if direct else ()
    return variant


def plan_variants(device: torch.device) -> list[tuple[Any, tuple[Any, ...]]]:
    """(kernel, constexprs) of every variant of a fused and a fallback plan (the fallback with a cast scatter).

    The plans are prepared on ``device``: preparing runs every variant once on scratch rows of the state, so on the
    GPU (``--run-gpu``) a host state would hand the compiled kernels host pointers.
    """
    state = torch.zeros((5, 2, 3, 8), dtype=torch.bfloat16, device=device)
    found = []
    for plan_class in (FusedStatePlan, FallbackStatePlan):
        plan = plan_class.prepare(state, 4, final_dtypes=(torch.bfloat16, torch.float32))
        found += [(plan._variant_kernel(key), plan._variant_constexprs(key)) for key in plan._variant_keys()]
    assert {kernel.__name__ for kernel, _ in found} == {"copy_rows_kernel", "copy_row_bytes_kernel",
                                                        "scatter_cast_items_kernel"}
    return found


@pytest.mark.parametrize("path", ["direct", "launcher", "hooked"])
def test_compiled_launch_passes_the_row_count_in_parameter_order(path: str, device: torch.device) -> None:
    cache, packed = torch.zeros((5, 2, 3, 8)), torch.zeros((2, 2, 3, 8))
    indices, flags = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.bool)
    pointers = (cache.data_ptr(), packed.data_ptr(), indices.data_ptr(), flags.data_ptr())
    hook = Recorder() if path == "hooked" else None
    for kernel, constexprs in plan_variants(device):
        variant = stand_in_variant(kernel, constexprs, path == "direct", hook)
        variant.launch((3, 2), cache, packed, indices, flags, 3001)
        if path == "direct":
            (call,) = variant._entry.seen
            assert call[:4] == (3, 2, 1, 1234) and call[4:13] == variant._entry_head
            kernel_arguments = call[13:]
        else:
            (call,) = variant._run.seen
            assert call[:6] == (3, 2, 1, 1234, "function", "packed-metadata")
            kernel_arguments = call[9:]
            if path == "hooked":
                (metadata_call,) = variant._compiled.launch_metadata.seen
                assert metadata_call[2:] == kernel_arguments
        bound = inspect.signature(kernel.fn).bind(*kernel_arguments)  # one value per parameter, none missing
        assert bound.arguments[kernels.ROWS_ARGUMENT] == 3001, kernel.__name__
        assert list(bound.arguments).index(kernels.ROWS_ARGUMENT) == kernels.ROWS_INDEX
        assert tuple(bound.arguments.values())[:kernels.ROWS_INDEX] == pointers
        assert tuple(bound.arguments.values())[kernels.ROWS_INDEX + 1:] == constexprs
