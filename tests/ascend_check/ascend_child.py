"""Compiles a few Ascend check tasks in this one process and prints JSON (``test_ascend_compile.py`` runs it).

Run with the Ascend environment's interpreter, the repository root on ``PYTHONPATH``::

    python ascend_child.py '[{"task": ["variant", ["a5", 391]], "stand_in_hivmc": true}, ...]'

Each task is ``run._compile_task``'s (``["variant", [chip, index]]`` or ``["probe", [chip, family, items, stream,
rule]]``), compiled in order by the check's own per-process toolchains, or with ``"stand_in_hivmc": false`` by a
toolchain of the chip class without the hivmc stand-in. Prints ``{"compiles": [{"result": CompileResult dict,
"runs": [every program it ran, whether it was --help, how often its output says hivmc is missing]}, ...],
"answers": {check: {"kept": {binary: answer}, "fresh": {binary: a fresh call's answer}}}}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any


def main() -> None:
    tasks = json.loads(sys.argv[1])
    runs: list[dict[str, Any]] = []
    real_run = subprocess.run

    def spy(command: Any, *args: Any, **kwargs: Any) -> Any:
        result = real_run(command, *args, **kwargs)
        output = [text.decode(errors="replace") if isinstance(text, bytes) else (text or "")
                  for text in (result.stdout, result.stderr)]
        runs.append({"program": os.path.basename(str(command[0])), "help": "--help" in command,
                     "hivmc_missing": "".join(output).count("Cannot find hivmc")})
        return result

    subprocess.run = spy  # the toolchain's shim and triton-ascend's utils both call it through the module
    from kda_patches.ascend_check import run

    with tempfile.TemporaryDirectory(prefix="kda-ascend-child-") as root:
        run._start_worker(root)  # as a pool process starts: its toolchains in a folder removed at the end
        compiles = compile_tasks(tasks, runs)
        print(json.dumps({"compiles": compiles, "answers": kept_answers()}))


def compile_tasks(tasks: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compile ``tasks`` in order; return each one's result and the programs it ran."""
    from kda_patches.ascend_check import run
    from kda_patches.ascend_check.toolchain import CHIP_CLASSES, Toolchain

    without: dict[str, Any] = {}
    compiles = []
    for entry in tasks:
        kind, arguments = entry["task"]
        before = len(runs)
        if entry.get("stand_in_hivmc", True):
            result = run._compile_task((kind, tuple(arguments)))
        else:
            chip = arguments[0]
            if chip not in without:
                without[chip] = Toolchain(CHIP_CLASSES[chip], run._toolchain(chip).workdir, stand_in_hivmc=False)
            if kind == "variant":
                case = run._variants(chip)[arguments[1]]
                code = case.kernel, case.signature, case.constexprs
            else:
                code = run.probe_kernel(chip, arguments[1], arguments[2], arguments[3] == "stream", arguments[4])
            result = asdict(without[chip].compile(*code))
        compiles.append({"result": result, "runs": runs[before:]})
    return compiles


def kept_answers() -> dict[str, Any]:
    """Return, per triton-ascend question about bishengir, the answers kept per binary and a fresh call's."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    from kda_patches.ascend_check.toolchain import CHIP_CLASSES, HELP_CHECKS

    # the backend module as triton loaded it (under its own name, not triton.backends.ascend.compiler)
    namespace = type(make_backend(GPUTarget("npu", CHIP_CLASSES["a2a3"].arch, 0))).add_stages.__globals__
    answers: dict[str, Any] = {}
    for name in HELP_CHECKS:
        check = namespace[name]
        kept = dict(getattr(check, "answers", {}))
        fresh = {}
        for path in kept:
            saved = os.environ["PATH"]
            os.environ["PATH"] = f"{os.path.dirname(path)}{os.pathsep}{saved}"
            try:
                fresh[path] = check.__wrapped__()
            finally:
                os.environ["PATH"] = saved
        answers[name] = {"kept": kept, "fresh": fresh}
    return answers


if __name__ == "__main__":
    main()
