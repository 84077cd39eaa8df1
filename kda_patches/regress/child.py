"""Entry point of one A/B run: ``python -m kda_patches.regress.child --target M:F --out FILE``.

It runs in a fresh interpreter whose environment the runner prepared (``KDA_PATCHES=0`` for the
baseline; ``KDA_PATCHES=1``, ``KDA_PATCHES_STRICT=1`` and a status dir for the patched run).
Importing this module imports ``kda_patches``, which activates the overlay in this process;
vLLM's plugin entry point does the same in every process vLLM starts. The workload's outputs are
encoded (tensors tagged) and written atomically to ``--out`` with the workload's own run time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time
from typing import Any

import kda_patches  # noqa: F401  (activates the overlay here, before the workload imports anything)
from kda_patches.regress.compare import encode_outputs
from kda_patches.regress.workloads import load_callable


def build_call_kwargs(function: Any, params: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    """Return ``params`` plus each ``context`` entry the function accepts and ``params`` lacks.

    Args:
        function: the workload callable.
        params: explicit parameters (always passed).
        context: runner-provided values such as ``cache_dir`` (passed only when accepted).
    Returns:
        The keyword arguments to call the workload with.
    """
    kwargs = dict(params)
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return kwargs
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for key, value in context.items():
        if key not in kwargs and value is not None and (takes_any or key in parameters):
            kwargs[key] = value
    return kwargs


def run_child(target: str, params: dict[str, Any], context: dict[str, Any], out_path: str) -> None:
    """Run the workload and write ``{"outputs", "workload_s", "pid"}`` to ``out_path`` atomically."""
    function = load_callable(target)
    started = time.perf_counter()
    outputs = function(**build_call_kwargs(function, params, context))
    elapsed = time.perf_counter() - started
    record = {"outputs": encode_outputs(outputs), "workload_s": elapsed, "pid": os.getpid()}
    partial = out_path + ".partial"
    with open(partial, "w") as handle:
        json.dump(record, handle)
    os.replace(partial, out_path)


def main(argv: list[str] | None = None) -> int:
    """Parse the child's arguments and run the workload. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m kda_patches.regress.child")
    parser.add_argument("--target", required=True, help="module:function of the workload")
    parser.add_argument("--params", default="{}", help="JSON object of keyword parameters")
    parser.add_argument("--context", default="{}", help="JSON object of optional runner values")
    parser.add_argument("--out", required=True, help="where to write the encoded outputs")
    args = parser.parse_args(argv)
    run_child(args.target, json.loads(args.params), json.loads(args.context), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
