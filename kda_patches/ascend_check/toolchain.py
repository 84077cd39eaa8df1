"""Compile one Triton kernel for an Ascend chip class with the registry's toolchain, as far as it goes here.

Runs inside the Ascend check environment (``.venv-ascend``: triton-ascend, whose package is ``triton``,
plus ``ascendnpu-ir``'s bishengir and a CPU torch). The pipeline is triton-ascend's own backend stages,
in process: ``ttir`` → ``ttadapter`` (its bundled ``triton-adapter-opt``) → ``npubin`` (bishengir-compile,
the A5 build for the 950 class). bishengir is run with ``--save-temps=DIR``; after it lowers the kernel
to the final HIVM IR (``module.hivm.opt.mlir``) it needs CANN's ``hivmc``, which no registry package
provides. Reaching that file is the last stage this machine can check (:data:`STAGE_HIVM`).

Only three things are stood in, all outside the kernel's compilation:

- triton-ascend's A2/A3 binary stage builds a CANN helper (``NPUUtils``) only to read the chip name for
  ``--target``; it is answered with the chip class's arch instead;
- bishengir's command gets ``--save-temps=DIR`` appended, so the final IR can be read (this bishengir
  has no option that prints the unified-buffer size it allocated; an overflow is an error message);
- A5 only: CANN's ``hivmc-a5``, the stage after the final HIVM IR, is a program that exits 0 without
  writing a binary (:data:`HIVMC_STAND_IN`). When ``bishengir-compile-a5`` does not find it, it runs its
  whole pipeline again four more times, writing the same HIVM IR each time (four fifths of an A5
  compile's time here); with the stand-in it stops after the first, as it does on a machine with CANN.
  The A2/A3 ``bishengir-compile`` runs its pipeline once either way and keeps no stand-in (it asks
  ``hivmc --version`` first, and a stand-in's answer could change what it emits).

Every other option is the backend's own (the chip class picks triton-ascend's ``compile_on_910_95``
defaults for A5, as its ``NPUOptions`` would on a 950 machine). What the backend asks about bishengir
itself (``--help``: is it the newer API, is it register-based) is asked once per process and binary:
the answer is the binary's, and each compile asked it up to twice (:func:`answered_once`).
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import types
from dataclasses import dataclass, field
from typing import Any

STAGE_FRONTEND = "frontend"  # Triton's code generator (ast -> ttir module)
STAGE_TTIR = "ttir"
STAGE_TTADAPTER = "ttadapter"
STAGE_HIVM = "hivm"  # bishengir wrote module.hivm.opt.mlir: the final HIVM IR
STAGE_ORDER = (STAGE_FRONTEND, STAGE_TTIR, STAGE_TTADAPTER, STAGE_HIVM)
HIVM_FILE = "module.hivm.opt.mlir"
_UB_OVERFLOW = re.compile(r"requires (\d+) bits while (\d+) bits available")
_UB_RETRY = "Ub overflow detected"
_MISSING_HIVMC = "hivmc"


@dataclass(frozen=True)
class ChipClass:
    """One Ascend chip class the check compiles for.

    Attributes:
        name: ``"a2a3"`` or ``"a5"`` (the device policy's target names are ``ascend-<name>``).
        arch: the ``--target`` bishengir gets (a chip of that class).
        compiler: the bishengir binary of that class in ``ascendnpuir/bin``.
        options: triton-ascend ``NPUOptions`` fields that differ on that class.
        hivmc: the name under which that bishengir runs CANN's ``hivmc`` when it is given the
            :data:`HIVMC_STAND_IN` (None: it gets none).
    """

    name: str
    arch: str
    compiler: str
    options: dict[str, Any] = field(default_factory=dict)
    hivmc: str | None = None


CHIP_CLASSES: dict[str, ChipClass] = {
    "a2a3": ChipClass("a2a3", "Ascend910B3", "bishengir-compile"),
    # triton-ascend 3.2 hard-codes is_compile_on_910_95 = False; on a 950 these are NPUOptions' defaults
    "a5": ChipClass("a5", "Ascend950PR_9599", "bishengir-compile-a5",
                    {"compile_on_910_95": True, "multibuffer": False, "enable_auto_bind_sub_block": False,
                     "enable_select_analysis": True}, hivmc="hivmc-a5"),
}
# What stands in for CANN's hivmc-a5: it writes no binary and exits 0, so that bishengir-compile-a5 stops
# after the final HIVM IR instead of running its pipeline four more times looking for the real one.
HIVMC_STAND_IN = "#!/bin/sh\n# kda-patches ascend check: CANN's hivmc is not installed; no binary written\nexit 0\n"


@dataclass
class CompileResult:
    """How far one kernel got.

    Attributes:
        stage: the last stage reached (:data:`STAGE_ORDER`); ``hivm`` means the final HIVM IR was written.
        message: the compiler's error lines where it stopped before ``hivm`` (empty otherwise).
        ub_retry: bishengir found the unified buffer too small and retried without multi-buffering
            (or code motion): the kernel does not fit the chip's buffer as the backend configured it.
        ub_required_bits, ub_available_bits: the overflow bishengir reported, when it failed on it.
        hivm_sha: hash of the final HIVM IR (to compare two variants' code), None before ``hivm``.
    """

    stage: str
    message: str = ""
    ub_retry: bool = False
    ub_required_bits: int | None = None
    ub_available_bits: int | None = None
    hivm_sha: str | None = None

    @property
    def fits(self) -> bool:
        """Whether the final HIVM IR was written with the backend's own buffer options (no overflow retry)."""
        return self.stage == STAGE_HIVM and not self.ub_retry

    @property
    def reached_hivm(self) -> bool:
        """Whether the final HIVM IR was written."""
        return self.stage == STAGE_HIVM


def compiler_dir() -> pathlib.Path:
    """Return ``ascendnpuir/bin`` of the installed ``ascendnpu-ir`` (ImportError when it is not installed)."""
    import ascendnpuir

    return pathlib.Path(ascendnpuir.__file__).resolve().parent / "bin"


_LOCATION = re.compile(r'loc\("[^"]*?([^/"]+)":(\d+):(\d+)\)')
_GENERIC = ("Failed to run BiShengHIR pipeline", "Failed to run BiShengIR pipeline")


def _error_lines(text: str) -> str:
    """Return the compiler's error lines, most specific first, without temporary paths (stable across runs)."""
    keep = [_LOCATION.sub(r"loc(\1:\2:\3)", line.strip()) for line in text.splitlines()
            if ("error" in line.lower() or "overflow" in line.lower()) and _MISSING_HIVMC not in line]
    generic = [line for line in keep if any(phrase in line for phrase in _GENERIC)]
    errors = [line for line in keep if "error" in line.lower() and line not in generic]
    notes = [line for line in keep if line not in errors and line not in generic]
    return "\n".join(dict.fromkeys(errors + notes + generic))[:2000]


class Toolchain:
    """triton-ascend's backend for one chip class, with bishengir's final IR kept.

    Args:
        chip: the chip class.
        workdir: a folder for the compiler's temporary files (created; the caller removes it).
        stand_in_hivmc: put :data:`HIVMC_STAND_IN` on bishengir's PATH as ``chip.hivmc`` (where the chip class
            names one); False only to compare with bishengir's own behaviour without it (the tests).
    """

    def __init__(self, chip: ChipClass, workdir: pathlib.Path, stand_in_hivmc: bool = True) -> None:
        self.chip = chip
        self.workdir = workdir
        # bishengir must be found as "bishengir-compile" (triton-ascend checks the name) on PATH
        self._bin = workdir / f"bin-{chip.name}{'' if stand_in_hivmc else '-no-hivmc'}"
        self._bin.mkdir(parents=True, exist_ok=True)
        link = self._bin / "bishengir-compile"
        if not link.exists():
            link.symlink_to(compiler_dir() / chip.compiler)
        if stand_in_hivmc and chip.hivmc:
            hivmc = self._bin / chip.hivmc
            hivmc.write_text(HIVMC_STAND_IN, encoding="utf-8")
            hivmc.chmod(0o755)
        # the backend reads ASCEND_HOME_PATH before its stages (never a file under it for these stages)
        os.environ.setdefault("ASCEND_HOME_PATH", str(workdir / "no-cann"))
        os.environ["TRITON_CACHE_DIR"] = str(workdir / "triton-cache")

    def compile(self, kernel: Any, signature: dict[str, str], constexprs: dict[str, Any]) -> CompileResult:
        """Compile ``kernel`` (a ``@triton.jit`` function) for this chip class.

        Args:
            kernel: the JIT function.
            signature: every parameter -> Triton type (``"*fp32"``, ``"i32"``, ``"constexpr"``).
            constexprs: the constexpr parameters' values.
        Returns:
            The :class:`CompileResult`.
        """
        path = os.environ.get("PATH", "")
        os.environ["PATH"] = f"{self._bin}{os.pathsep}{path}"  # this class's bishengir, for this compile only
        try:
            return self._compile(kernel, signature, constexprs)
        finally:
            os.environ["PATH"] = path

    def _compile(self, kernel: Any, signature: dict[str, str], constexprs: dict[str, Any]) -> CompileResult:
        import hashlib

        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend

        target = GPUTarget("npu", self.chip.arch, 0)
        backend = make_backend(target)
        saved = pathlib.Path(tempfile.mkdtemp(prefix="hivm-", dir=self.workdir))
        captured: dict[str, str] = {}
        self._stand_in(backend, saved, captured)
        options = backend.parse_options(dict(self.chip.options))
        stages: dict[str, Any] = {}
        backend.add_stages(stages, options)
        metadata = {"hash": "kda-ascend-check", "target": target, **options.__dict__}
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        try:
            module = ASTSource(kernel, signature, constexprs).make_ir(
                options, backend.get_codegen_implementation(), backend.get_module_map(), context)
        except Exception as exc:
            return CompileResult(STAGE_FRONTEND, _error_lines(str(exc)) or repr(exc)[:2000])
        reached = STAGE_FRONTEND
        try:
            for ext, run_stage in stages.items():
                try:
                    module = run_stage(module, metadata)
                except Exception as exc:
                    text = getattr(exc, "stderr", None)
                    text = text.decode(errors="replace") if isinstance(text, bytes) else (text or repr(exc))
                    hivm = saved / HIVM_FILE
                    output = captured.get("out", "")
                    overflow = _UB_OVERFLOW.search(output)
                    facts = {"ub_retry": _UB_RETRY in output,
                             "ub_required_bits": int(overflow.group(1)) if overflow else None,
                             "ub_available_bits": int(overflow.group(2)) if overflow else None}
                    if ext == "npubin" and hivm.is_file():
                        digest = hashlib.sha256(hivm.read_bytes()).hexdigest()[:16]
                        return CompileResult(STAGE_HIVM, "", hivm_sha=digest, **facts)
                    return CompileResult(reached, _error_lines(text) or text[-2000:], **facts)
                reached = {"ttir": STAGE_TTIR, "ttadapter": STAGE_TTADAPTER}.get(ext, reached)
            # a binary: only possible with CANN's hivmc on PATH
            return CompileResult(STAGE_HIVM, "")
        finally:
            shutil.rmtree(saved, ignore_errors=True)

    def _stand_in(self, backend: Any, saved: pathlib.Path, captured: dict[str, str]) -> None:
        chip = self.chip
        namespace = type(backend).add_stages.__globals__  # the backend module as triton loaded it

        class ArchOnly:
            """Answers the chip name, which is all the A2/A3 binary stage asks the CANN helper for."""

            def get_arch(self) -> str:
                return chip.arch

        real_run = subprocess.run

        def run(command: list[str], *args: Any, **kwargs: Any) -> Any:
            if os.path.basename(str(command[0])) == "bishengir-compile" and str(command[1]).endswith(".mlir"):
                command = [*command, f"--save-temps={saved}"]
                result = real_run(command, *args, **{**kwargs, "check": False})
                captured["out"] = (result.stdout or b"").decode(errors="replace") + \
                    (result.stderr or b"").decode(errors="replace")
                if result.returncode and kwargs.get("check"):
                    raise subprocess.CalledProcessError(result.returncode, command, result.stdout, result.stderr)
                return result
            return real_run(command, *args, **kwargs)

        shim = types.ModuleType("subprocess")
        shim.__dict__.update({name: getattr(subprocess, name) for name in dir(subprocess) if not name.startswith("__")})
        shim.run = run
        namespace["NPUUtils"] = ArchOnly
        namespace["subprocess"] = shim
        for name in HELP_CHECKS:
            namespace[name] = answered_once(namespace[name])


# triton-ascend's questions about bishengir (each runs ``bishengir-compile --help``), asked by its binary stages
HELP_CHECKS = ("_check_bishengir_api_change", "_check_bishengir_is_regbased", "_check_bishengir_able_save_ir")


def answered_once(check: Any) -> Any:
    """Return ``check`` (a triton-ascend question about the bishengir on PATH) answering once per binary.

    The first call for each bishengir that ``_get_npucompiler_path`` finds (each chip class's link) runs the
    real check; later calls in this process return that answer. Idempotent: a check already wrapped is
    returned as it is. The wrapper's ``answers`` maps each binary's path to its answer.
    """
    if hasattr(check, "answers"):
        return check
    answers: dict[str, Any] = {}
    binary = check.__globals__["_get_npucompiler_path"]

    @functools.wraps(check)
    def once() -> Any:
        path = binary()
        if path not in answers:
            answers[path] = check()
        return answers[path]

    once.answers = answers  # type: ignore[attr-defined]
    return once
