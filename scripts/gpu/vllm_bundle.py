"""Build the carry bundle that brings a vLLM release's own Python code to the GPU machine (issue 9).

The H200 machine has torch 2.11 + triton 3.6 but no vLLM and no network, and one call carries at most 64 MiB
(the CUDA wheel is ~330 MB). The paths the overlay patches -- ``KimiK3DeltaAttention._forward`` and
``QwenGatedDeltaNetAttention._forward_core`` with their Triton kernels -- are pure Python + Triton, so this
bundle carries exactly:

- ``site/vllm/**.py``: every ``.py`` file of the registry's ``vllm==<version>`` wheel (taken through
  :func:`kda_patches.releases.fetch.release_dir`, the project's release cache), plus a minimal
  ``vllm-<version>.dist-info/METADATA`` written here (name and version only: vLLM's platform detection and the
  overlay's version ranges read ``importlib.metadata.version("vllm")``; without it CUDA is never detected);
- ``wheels/*.whl``: CPython wheels of the third-party packages vLLM's import chain of those layers needs and
  the GPU image lacks (:attr:`ReleaseCarry.wheels`, found by importing the layer modules in a clean interpreter
  that has only the GPU image's packages, see ``vllm_layers_check.py --dry-run``); every pinned version is checked
  against the release's own ``Requires-Dist`` (:func:`unmet_pins`) before anything is built;
- ``manifest.json``: versions, sha256 of every wheel, file counts.

What differs between releases is declared in :data:`RELEASES` (version, wheels, compiled libraries); the
mechanism is shared. ``--vllm-version`` picks one (default :data:`DEFAULT_VERSION`); every artifact's name carries
the version, and ``gpu_harness`` refuses to join or unpack pieces of two versions.

Usage (here, on the CPU machine; the result is gitignored and never committed)::

    python scripts/gpu/vllm_bundle.py build                       # -> .bundle/vllm-0.33.0-cp312.zip (H200)
    python scripts/gpu/vllm_bundle.py build --python-version 3.11 # same bundle for this machine's dry run
    python scripts/gpu/vllm_bundle.py carry                       # -> .bundle/carry/run1, run2, ...
    python scripts/gpu/vllm_bundle.py carry --vllm-version 0.34.0 --with-moe
    python scripts/gpu/vllm_bundle.py carry --vllm-version 0.34.0 --with-flashkda --with-flashinfer

The GPU side (``gpu_harness.unpack_bundle``) unpacks the zip and installs the wheels with
``pip install --no-index --no-deps --target``. The zip holds no compiled vLLM extension; ``carry`` adds vLLM's
real compiled op library (:attr:`ReleaseCarry.libraries` of the same wheel, xz-compressed; 0.33.0: 92.6 -> 63.7 MB)
and cuts library and bundle into pieces that fill consecutive device calls beside the working tree
(``gpu_harness.write_carry``): carry ``.bundle/carry/run1``, then ``run2``, ... in back-to-back calls, each
command starting with ``python3 scripts/gpu/gpu_harness.py stage .bundle/carry/runN``.

``--with-flashinfer`` (vLLM 0.34: Qwen's GDN prefill picks FlashInfer on every SM90 device) adds the release's
:attr:`ReleaseCarry.flashinfer`: FlashInfer and the CuTe DSL compiler its SM90 GDN prefill kernel is written in,
as one xz-compressed wheel set ``vllm-<version>-flashinfer-wheels-cpXY.tar.xz`` (:func:`build_compressed_wheel_set`:
the registry's wheels repacked uncompressed, every member checked against the wheel's own RECORD, so xz sees the
raw bytes: 0.34.0's 198 MB of wheels, 975 MB installed, travel as 95 MB, two more calls; built in about 7 minutes
on two cores). Every requirement the carried wheels name is accounted for -- carried, in the bundle, in the GPU
image, or left out with the reason (:func:`wheel_set_problems`). On the GPU machine ``gpu_harness`` installs the set
into the site and processes the CuTe DSL's ``.pth`` in every engine process (``gpu_harness.activate_carried_pth``).
"""

from __future__ import annotations

import argparse
import base64
import csv
import email.parser
import hashlib
import io
import json
import lzma
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_harness  # noqa: E402  (carrying: pieces, checksums)

sys.path.remove(str(pathlib.Path(__file__).resolve().parent))
DEFAULT_DEST = ROOT / ".bundle"

# (requirement, why: the first import in vLLM's chain that needs it). Each one missing from the H200 image's package
# list (device KINDS.md, read 2026-11-17); each pinned version inside the release's own Requires-Dist for that
# package (unmet_pins checks it before anything is built). --no-deps: every package the chain imports is listed
# by hand (a dry run finds a missing one).
CHAIN_WHEELS: tuple[tuple[str, str], ...] = (
    ("pydantic==2.14.4", "vllm.config.attention (pydantic dataclasses of every config)"),
    ("pydantic-core==2.50.5", "pydantic"),
    ("annotated-types==0.8.0", "pydantic"),
    ("typing-inspection==0.4.5", "pydantic"),
    ("cbor2==6.3.0", "vllm.utils.hashing (vllm.config)"),
    ("pyzmq==27.3.0", "vllm.utils.network_utils / vllm.distributed (import zmq)"),
    ("msgspec==0.23.0", "vllm.v1 engine/outputs types"),
    ("cachetools==8.0.2", "vllm.utils / tokenizer caches"),
    ("pybase64==1.5.1", "vllm.multimodal / entrypoints utils"),
    ("oss-harmony==0.0.11", "vllm.entrypoints.mcp.tool_server (vllm.config.reasoning -> vllm.reasoning)"),
    ("openai==3.57.0", "vllm.entrypoints.openai protocol (vllm.reasoning)"),
    ("httpx2==2.16.2", "openai"),
    ("sniffio==1.3.1", "openai"),
    ("xgrammar==0.2.8", "vllm.parser.abstract_parser (vllm.reasoning)"),
    ("apache-tvm-ffi==0.1.11", "xgrammar"),
    ("llguidance==1.7.6", "vllm.v1.structured_output / parser"),
    ("fastapi==0.136.3", "vllm.entrypoints (vllm.reasoning)"),
    ("starlette==1.10.0", "fastapi"),
    ("partial-json-parser==0.2.1.1.post7", "vllm.entrypoints tool parsers"),
    ("compressed-tensors==0.17.0", "vllm.model_executor.layers.quantization (linear layers)"),
    ("loguru==0.7.3", "compressed-tensors"),
    ("wrapt==2.5.2", "kda_patches itself (the overlay's one dependency; the image's wrapt may be older than 2)"),
)
# vLLM's compiled libraries that can be carried (key -> member of the wheel): the op library every engine needs,
# and the MoE op library (topk_softmax, moe_align_block_size, ...) only the MoE models need (Qwen3-Next)
STABLE_LIBRARIES: Mapping[str, str] = {"core": "vllm/_C_stable_libtorch.abi3.so",
                                       "moe": "vllm/_moe_C_stable_libtorch.abi3.so"}
# vLLM 0.34 also ships FlashKDA (Kimi K3's SM90+ prefill default, `kda_prefill_backend=auto`): 7.5 MB, 1.5 MB as xz;
# stable ABI too -- every torch symbol it needs is one the core library needs (read with nm, 2026-12-07)
# ... and FlashAttention 3 (vLLM's attention default on SM90: without it the attention selector stops on "FlashAttention
# version not detected", H100 run 21): 56 MB, 19.7 MB as xz; stable ABI (only aoti_torch_* symbols of torch, nm
# 2026-12-07), in the wheel's vllm/vllm_flash_attn/ (its artifact names that folder: gpu_harness.library_file_of)
STABLE_LIBRARIES_034: Mapping[str, str] = {**STABLE_LIBRARIES, "flashkda": "vllm/_flashkda_C.abi3.so",
                                           "fa3": "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"}


@dataclass(frozen=True)
class WheelSetCarry:
    """Wheels carried xz-compressed beside one release and installed into its site (``carry --with-flashinfer``).

    Every requirement a carried wheel names (its METADATA's ``Requires-Dist``, extras aside) must be carried here, be
    a wheel of the release's bundle, or be declared in ``provided`` or ``left_out``: :func:`wheel_set_problems`.

    Attributes:
        name: the set's name in its artifact ``vllm-<version>-<name>-wheels-cpXY.tar.xz``.
        wheels: (requirement, why) of every wheel carried.
        release_pin_exceptions: distribution -> why its carried pin differs from the release's own Requires-Dist
            (anything else the release does not allow is refused).
        provided: distribution a carried wheel requires -> where it comes from instead (the GPU image).
        left_out: distribution a carried wheel requires -> why it is not carried.
        evidence: how this declaration was established (what was run or read).
    """

    name: str
    wheels: tuple[tuple[str, str], ...]
    release_pin_exceptions: Mapping[str, str]
    provided: Mapping[str, str]
    left_out: Mapping[str, str]
    evidence: str


# What FlashInfer and the CuTe DSL require that the GPU image has (device KINDS.md package list, read 2026-11-17)
IN_IMAGE = "in the GPU image (device KINDS.md package list)"
FLASHINFER_034 = WheelSetCarry(
    name="flashinfer",
    wheels=(
        ("flashinfer-python==0.7.4", "vLLM 0.34 Qwen GDN prefill on SM90: `_resolve_gdn_prefill_backend` returns "
         "flashinfer for `auto`; `fi_chunk_gated_delta_rule` imports flashinfer.gdn_prefill"),
        ("nvidia-cutlass-dsl==4.8.0", "flashinfer.gdn_kernels.delta_rule_dsl: on SM90 chunk_gated_delta_rule runs "
         "delta_rule_sm90 / delta_rule_cp_sm90, CuTe DSL kernels compiled in-process at first call (import cutlass); "
         "also FlashInfer's SM90 norms (rmsnorm_cute) and vLLM 0.34's MiniMax M3 warm-up module"),
        ("nvidia-cutlass-dsl-libs-base==4.8.0", "nvidia-cutlass-dsl (the `cutlass` and `iket` packages)"),
        ("nvidia-cutlass-dsl-libs-core==4.8.0", "nvidia-cutlass-dsl-libs-base"),
        ("nvidia-cutlass-dsl-libs-cu13==4.8.0", "nvidia-cutlass-dsl[cu13], vLLM 0.34's own requirement: the CUDA 13 "
         "compiler (_cutlass_ir.cu13, libcute_dsl_runtime), chosen where the driver is CUDA 13"),
        ("quack-kernels==0.6.5", "vLLM 0.34's own requirement: kernel_warmup imports the MiniMax M3 warm-up module on "
         "every CUDA GPU, whose op package imports quack.compile_utils once `cutlass` is importable (H100 run 21: "
         "with the CuTe DSL carried and quack not, every 0.34 engine stopped at warm-up)"),
    ),
    release_pin_exceptions={"flashinfer-python": "vLLM 0.34.0 pins flashinfer-python==0.7.3, which the registry "
                            "lacks; 0.7.4 defines every name vLLM 0.34.0 imports from flashinfer (each "
                            "`from flashinfer... import` of its .py files resolved, read 2026-12-07)"},
    provided={"click": IN_IMAGE, "einops": IN_IMAGE, "ninja": IN_IMAGE, "numpy": IN_IMAGE, "nvidia-ml-py": IN_IMAGE,
              "packaging": IN_IMAGE, "requests": IN_IMAGE, "tabulate": IN_IMAGE, "torch": IN_IMAGE,
              "tqdm": IN_IMAGE, "typing-extensions": IN_IMAGE, "protobuf": IN_IMAGE, "cuda-bindings": IN_IMAGE,
              "cuda-python": "the GPU image's cuda-bindings: FlashInfer and the CuTe DSL import cuda.bindings, "
              "never the cuda-python meta-distribution"},
    left_out={
        "nvidia-cutlass-dsl-libs-cu12": "the CUDA 12 compiler flavor (92 MB): cutlass._mlir._mlir_libs loads the "
        "newest installed flavor the driver supports, cu13 on the CUDA 13 driver",
        "nvidia-cudnn-frontend": "`import cudnn` is guarded (flashinfer.gemm.gemm_base, flashinfer.cudnn); vLLM "
        "calls the GDN prefill with backend='flashinfer', never cuDNN",
        "cuda-tile": "imported only by FlashInfer's cuTile attention kernels (attention/kernels/cutile), not on import",
        "nccl4py": "flashinfer.comm only (multi-GPU communication), not imported by flashinfer.gdn_prefill",
        "nccl-extensions": "flashinfer.comm only, as nccl4py",
        "torch-c-dlpack-ext": "quack-kernels' code never imports it; apache-tvm-ffi (in the bundle) loads it only "
        "optionally, to speed up DLPack conversion (tvm_ffi._optional_torch_c_dlpack), and it is compiled against "
        "one torch release",
    },
    evidence="read, not yet run on a GPU (2026-12-07): with only these wheels beside a torch, `import "
             "flashinfer.gdn_prefill` succeeded and chunk_gated_delta_rule_sm90 / cp_delta_rule_dsl_sm90 were "
             "defined (no cudnn, cuda.tile or nccl module imported); the SM90 path compiles with the CuTe DSL's "
             "bundled compiler (no nvcc, no download); FlashInfer's other kernels JIT-compile from the wheel's "
             "data/ with nvcc + ninja (vLLM's has_flashinfer requires both)",
)


@dataclass(frozen=True)
class ReleaseCarry:
    """What carrying one vLLM release takes -- only what differs between releases; one mechanism uses it.

    Attributes:
        version: the registry's ``vllm`` version; every artifact's name carries it.
        wheels: (requirement, why) of the third-party wheels its import chain needs and the H200 image lacks.
        libraries: compiled libraries that can be carried, key (``core`` always, ``moe``) -> member of its wheel.
        evidence: how this declaration was established (what was run or read).
        flashinfer: FlashInfer and what it needs (``carry --with-flashinfer``); None where not declared.
    """

    version: str
    wheels: tuple[tuple[str, str], ...]
    libraries: Mapping[str, str]
    evidence: str
    flashinfer: WheelSetCarry | None = None


RELEASES: dict[str, ReleaseCarry] = {release.version: release for release in (
    ReleaseCarry("0.33.0", CHAIN_WHEELS, STABLE_LIBRARIES,
                 "run: the wheels found by the layer check's dry run; H200 engine runs 1-4 (both libraries loaded)"),
    ReleaseCarry("0.34.0", CHAIN_WHEELS, STABLE_LIBRARIES_034,
                 "read, not yet run on the H200 (2026-12-03): its wheel's Requires-Dist for every carried package is "
                 "0.33.0's line; module-level imports followed from the engine's modules reach no third-party "
                 "package 0.33.0's did not (xgrammar and partial-json-parser no longer reached that way; kept); both "
                 "libraries in its wheel under the same names (88.7 and 32.4 MB), needing no torch symbol 0.33.0's "
                 "did not", FLASHINFER_034),
)}
DEFAULT_VERSION = "0.33.0"
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux1_x86_64",
             "manylinux_2_5_x86_64")
MAX_BUNDLE_BYTES = 48 << 20  # the call carries 64 MiB in all, the working tree included
CALL_MARGIN = 2 << 20  # slack for files written between planning and the call


def release_of(version: str) -> ReleaseCarry:
    """Return the declaration of ``version``.

    Raises:
        KeyError: no declaration (names the declared versions).
    """
    if version not in RELEASES:
        raise KeyError(f"vLLM {version} is not declared in vllm_bundle.RELEASES (declared: {', '.join(RELEASES)})")
    return RELEASES[version]


def library_artifact(member: str, version: str) -> str:
    """Return the carried artifact's name of a wheel member: ``vllm-<version>-<file>.xz``, ``<file>`` its path under
    ``vllm/`` with each folder marked by :data:`gpu_harness.LIBRARY_FOLDER_MARK` (gpu_harness reads both)."""
    inside = pathlib.PurePosixPath(member).relative_to("vllm")
    return f"vllm-{version}-{gpu_harness.LIBRARY_FOLDER_MARK.join(inside.parts)}.xz"


def bundle_name(python_version: str, version: str) -> str:
    """Return the bundle's file name for a vLLM version and a CPython version such as ``3.12``."""
    return f"vllm-{version}-cp{python_version.replace('.', '')}.zip"


def pip_target(python_version: str) -> list[str]:
    """Return pip's options that pick binary wheels for CPython ``python_version`` on manylinux x86-64."""
    return ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *[flag for platform in PLATFORMS for flag in ("--platform", platform)]]


def _canonical(name: str) -> str:
    """Return a distribution name in its comparable form (PEP 503: ``Pydantic_Core`` -> ``pydantic-core``)."""
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def _packaging():
    """Return ``(Requirement, Version)`` from ``packaging`` (pip's own copy where the package is not installed)."""
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # pragma: no cover - pip always carries one
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    return Requirement, Version


def _marker_environment(python_version: str) -> dict[str, str]:
    """Return the marker environment of CPython ``python_version`` on x86-64 Linux, no extra requested."""
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _applying(requires_dist: list[str], python_version: str) -> list:
    """Return the requirements of ``requires_dist`` whose markers hold for ``python_version`` (extras' do not)."""
    requirement_class, _ = _packaging()
    environment = _marker_environment(python_version)
    requirements = [requirement_class(line) for line in requires_dist]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(environment)]


def unmet_pins(wheels: tuple[tuple[str, str], ...], requires_dist: list[str], python_version: str,
               who: str = "vLLM") -> list[str]:
    """Return every carried wheel whose pinned version the release's own ``Requires-Dist`` does not allow.

    Args:
        wheels: ``(name==version, why)`` pairs of a declaration.
        requires_dist: the ``Requires-Dist`` values of vLLM's wheel METADATA (markers evaluated for CPython
            ``python_version`` on x86-64 Linux; extras' requirements are not the release's).
        python_version: the CPython the bundle is for.
        who: whose requirements these are, in each line (a carried wheel's, for a wheel set).
    Returns:
        One line per conflict (requirement, vLLM's specifier); empty when every pin is allowed. Packages vLLM
        does not name (a dependency's dependency, the overlay's wrapt) are not checked.
    """
    _, version_class = _packaging()
    wanted: dict[str, list] = {}
    for requirement in _applying(requires_dist, python_version):
        wanted.setdefault(_canonical(requirement.name), []).append(requirement.specifier)
    unmet = []
    for pinned, _ in wheels:
        name, _, version = pinned.partition("==")
        for specifier in wanted.get(_canonical(name), []):
            if not specifier.contains(version_class(version), prereleases=True):
                unmet.append(f"{pinned}: {who} requires {name}{specifier}")
    return unmet


def requires_dist(version: str, python_version: str, dest: pathlib.Path) -> list[str]:
    """Return ``Requires-Dist`` of the registry's ``vllm==version`` wheel (pip's resolver report, cached in ``dest``).

    Raises:
        RuntimeError: pip failed.
    """
    cached = dest / f"vllm-{version}-requires-dist.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kda-requires-") as scratch:
        report = pathlib.Path(scratch) / "report.json"
        argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
                "--disable-pip-version-check", *pip_target(python_version), "--target",
                str(pathlib.Path(scratch) / "target"), "--report", str(report), f"vllm=={version}"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"pip could not read vllm=={version}'s metadata:\n{done.stderr[-3000:]}")
        lines = json.loads(report.read_text())["install"][0]["metadata"].get("requires_dist", [])
    cached.write_text(json.dumps(lines, indent=0))
    return lines


def check_pins(release: ReleaseCarry, python_version: str, dest: pathlib.Path) -> None:
    """Refuse a declaration whose wheels the release itself would not accept.

    Raises:
        RuntimeError: names every unmet pin.
    """
    unmet = unmet_pins(release.wheels, requires_dist(release.version, python_version, dest), python_version)
    if unmet:
        raise RuntimeError(f"vllm_bundle.RELEASES[{release.version!r}] pins wheels vLLM {release.version} does not "
                           "allow (fix the declaration):\n  " + "\n  ".join(unmet))


def download_wheels(dest: pathlib.Path, python_version: str,
                    requirements: tuple[tuple[str, str], ...]) -> list[pathlib.Path]:
    """Download every requirement for CPython ``python_version`` on manylinux x86-64.

    Raises:
        RuntimeError: pip failed (names the requirement and pip's stderr tail).
    """
    dest.mkdir(parents=True, exist_ok=True)
    for requirement, _ in requirements:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
                *pip_target(python_version), "-d", str(dest), requirement]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"pip download {requirement} for cp{python_version} failed:\n{done.stderr[-3000:]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != len(requirements):
        raise RuntimeError(f"expected {len(requirements)} wheels in {dest}, found {[w.name for w in wheels]}")
    return wheels


# The Ray executor (issue 29): Ray and what it imports that the GPU image lacks (the image has click, filelock,
# msgpack, packaging, protobuf, pyyaml, requests, aiohttp and attrs). 79 MB for Ray's wheel alone: two more calls.
# vLLM pins no Ray version (0.33.0 and 0.34.0 alike), so the set is shared and its name carries none.
RAY_WHEELS: tuple[tuple[str, str], ...] = (
    ("ray==2.60.0", "vLLM's Ray executor (distributed_executor_backend=ray)"),
    ("jsonschema==4.26.0", "ray"),
    ("jsonschema-specifications==2025.9.1", "jsonschema"),
    ("referencing==0.37.0", "jsonschema"),
    ("rpds-py==2026.9.1", "referencing"),
)


def wheel_set_name(name: str, python_version: str) -> str:
    """Return a carried wheel set's file name, ``<name>-wheels-cpXY.zip`` (``gpu_harness.is_wheel_set``)."""
    return f"{name}-wheels-cp{python_version.replace('.', '')}.zip"


def build_wheel_set(dest: pathlib.Path, name: str, requirements: tuple[tuple[str, str], ...],
                    python_version: str) -> pathlib.Path:
    """Download ``requirements`` and store them in ``dest/<name>-wheels-cpXY.zip`` (a carried wheel set)."""
    target = dest / wheel_set_name(name, python_version)
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="kda-wheels-") as scratch:
        wheels = download_wheels(pathlib.Path(scratch), python_version, requirements)
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED) as archive:
            for wheel in wheels:
                archive.write(wheel, wheel.name)
        os.replace(partial, target)
    return target


# ---------------------------------------------------------------- xz-compressed wheel sets (--with-flashinfer)

XZ_PRESET = 6


def wheel_set_artifact(release: ReleaseCarry, carried: WheelSetCarry, python_version: str) -> str:
    """Return a compressed wheel set's artifact name, ``vllm-<version>-<name>-wheels-cpXY.tar.xz``
    (``gpu_harness.is_wheel_set``; the version makes it one release's, as every ``vllm-<version>-`` artifact)."""
    return f"vllm-{release.version}-{carried.name}-wheels-cp{python_version.replace('.', '')}.tar.xz"


def _dist_info_member(archive: zipfile.ZipFile, file: str) -> str:
    """Return the name of the wheel's own ``<name>.dist-info/<file>``."""
    return next(name for name in archive.namelist() if name.count("/") == 1 and name.endswith(f".dist-info/{file}"))


def wheel_requires(wheel: pathlib.Path) -> list[str]:
    """Return the ``Requires-Dist`` values of a wheel's own METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(_dist_info_member(archive, "METADATA")).decode()
    return email.parser.Parser().parsestr(metadata).get_all("Requires-Dist") or []


def wheel_set_problems(carried: WheelSetCarry, release: ReleaseCarry, requires: Mapping[str, list[str]],
                       release_requires: list[str], python_version: str) -> list[str]:
    """Return why a wheel set cannot be carried as declared (empty: it can).

    Args:
        carried: the declaration.
        release: the release it goes with (its bundle's wheels count as carried).
        requires: each carried requirement -> the ``Requires-Dist`` of its downloaded wheel.
        release_requires: the release's own ``Requires-Dist``.
        python_version: the CPython of the wheels.
    Returns:
        One line per problem: a pin the release does not allow and no exception declares (or an exception for a
        pin it allows); a requirement of a carried wheel that is neither carried, in the bundle, provided nor left
        out; a carried or bundled pin a carried wheel does not accept.
    """
    problems = []
    excepted = {_canonical(name) for name in carried.release_pin_exceptions}
    unmet = unmet_pins(carried.wheels, release_requires, python_version)
    problems += [f"{line}: declare why in release_pin_exceptions or carry the release's pin" for line in unmet
                 if _canonical(line.split("==")[0]) not in excepted]
    stale = excepted - {_canonical(line.split("==")[0]) for line in unmet}
    problems += [f"{name}: a release_pin_exception is declared, but vLLM {release.version} allows the carried pin"
                 for name in sorted(stale)]
    accounted = {_canonical(requirement.split("==")[0]) for requirement, _ in (*carried.wheels, *release.wheels)}
    accounted |= {_canonical(name) for name in (*carried.provided, *carried.left_out)}
    for requirement, lines in requires.items():
        for needed in _applying(lines, python_version):
            if _canonical(needed.name) not in accounted:
                problems.append(f"{requirement} requires {needed}: not carried, not in the bundle, and not "
                                "declared provided or left out")
        problems += unmet_pins((*carried.wheels, *release.wheels), lines, python_version, who=requirement)
    return problems


def record_mismatches(wheel: pathlib.Path) -> list[str]:
    """Return every file a wheel's own RECORD lists whose bytes in the wheel differ from its hash (or are missing)."""
    bad = []
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for row in csv.reader(io.StringIO(archive.read(_dist_info_member(archive, "RECORD")).decode())):
            if len(row) < 2 or not row[1]:
                continue  # RECORD itself, and files it lists without a hash
            algorithm, _, expected = row[1].partition("=")
            if row[0] not in names:
                bad.append(f"{row[0]} (missing)")
                continue
            digest = hashlib.new(algorithm, archive.read(row[0])).digest()
            if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != expected:
                bad.append(row[0])
    return bad


def repack_stored(wheel: pathlib.Path, target: pathlib.Path) -> None:
    """Write ``wheel``'s members, names, dates and modes unchanged, into ``target`` without compression (so xz sees
    the raw bytes: a deflated wheel does not compress further)."""
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED) as out:
        for info in source.infolist():
            member = zipfile.ZipInfo(info.filename, info.date_time)
            member.external_attr, member.create_system = info.external_attr, info.create_system
            out.writestr(member, source.read(info), compress_type=zipfile.ZIP_STORED)


def write_xz_tar(target: pathlib.Path, manifest: dict, files: list[pathlib.Path]) -> None:
    """Write ``manifest.json`` and ``wheels/<file>`` into an xz-compressed tar at ``target`` (atomically).

    The ``xz`` tool compresses on every core where there is one, else :mod:`lzma` does; both write one xz stream
    that ``tarfile`` reads.
    """
    partial = target.with_name(target.name + ".partial")
    tool = shutil.which("xz")
    with open(partial, "wb") as out:
        process = subprocess.Popen([tool, f"-{XZ_PRESET}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out) \
            if tool else None
        sink = process.stdin if process else lzma.open(out, "wb", preset=XZ_PRESET)
        try:
            with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                data = json.dumps(manifest, indent=1, sort_keys=True).encode()
                info = tarfile.TarInfo("manifest.json")
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
                for path in files:
                    info = tarfile.TarInfo(f"wheels/{path.name}")
                    info.size, info.mode = path.stat().st_size, 0o644
                    with open(path, "rb") as handle:
                        tar.addfile(info, handle)
        finally:
            sink.close()
            failed = bool(process and process.wait())
    if failed:
        partial.unlink()
        raise RuntimeError(f"xz failed ({process.returncode}) writing {target.name}")
    os.replace(partial, target)


def build_compressed_wheel_set(dest: pathlib.Path, release: ReleaseCarry, carried: WheelSetCarry,
                               python_version: str) -> pathlib.Path:
    """Download ``carried``'s wheels and write ``dest/<wheel_set_artifact>`` (reused while it holds the same pins).

    Beside it, ``<artifact>.json`` is its manifest (also inside the tar): per wheel the registry file's sha256 and
    the repacked one's, which ``gpu_harness.install_wheel_set`` checks before installing.

    Raises:
        RuntimeError: a wheel cannot be fetched (names the set, the artifact and the requirement; nothing is
            written), :func:`wheel_set_problems` finds any, or a repacked wheel differs from its RECORD.
    """
    target = dest / wheel_set_artifact(release, carried, python_version)
    sidecar = target.with_name(target.name + ".json")
    wanted = sorted(requirement for requirement, _ in carried.wheels)
    if target.is_file() and sidecar.is_file():
        previous = json.loads(sidecar.read_text())
        if previous.get("requirements") == wanted and previous.get("artifact_sha256") == gpu_harness.sha256_of(target):
            return target
    release_requires = requires_dist(release.version, python_version, dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"kda-{carried.name}-") as folder:
        scratch = pathlib.Path(folder)
        try:
            wheels = download_wheels(scratch / "registry", python_version, carried.wheels)
        except RuntimeError as error:
            raise RuntimeError(f"cannot fetch the {carried.name} carry of vLLM {release.version} ({target.name}); "
                               f"nothing was written: {error}") from None
        paired = _pair_wheels(wheels, carried.wheels)
        problems = wheel_set_problems(carried, release, {req: wheel_requires(w) for w, (req, _) in paired},
                                      release_requires, python_version)
        if problems:
            raise RuntimeError(f"vllm_bundle.RELEASES[{release.version!r}].{carried.name} cannot be carried as "
                               "declared:\n  " + "\n  ".join(problems))
        (scratch / "stored").mkdir()
        entries, stored_files = [], []
        for wheel, (requirement, why) in paired:
            stored = scratch / "stored" / wheel.name
            repack_stored(wheel, stored)
            if bad := record_mismatches(stored):
                raise RuntimeError(f"{wheel.name} repacked: files differ from the wheel's own RECORD: {bad[:5]}")
            stored_files.append(stored)
            entries.append({"file": wheel.name, "requirement": requirement, "needed_by": why,
                            "registry_sha256": gpu_harness.sha256_of(wheel), "registry_bytes": wheel.stat().st_size,
                            "sha256": gpu_harness.sha256_of(stored), "bytes": stored.stat().st_size})
        manifest = {"set": carried.name, "vllm_version": release.version, "python_version": python_version,
                    "requirements": wanted, "wheels": entries,
                    "release_pin_exceptions": dict(carried.release_pin_exceptions),
                    "provided": dict(carried.provided), "left_out": dict(carried.left_out),
                    "declaration_evidence": carried.evidence,
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        write_xz_tar(target, manifest, stored_files)
    manifest.update(artifact_sha256=gpu_harness.sha256_of(target), artifact_bytes=target.stat().st_size)
    sidecar.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return target


def write_bundle(target: pathlib.Path, source: pathlib.Path, wheels: list[pathlib.Path], python_version: str,
                 release: ReleaseCarry) -> dict:
    """Write the bundle zip (``site/``, ``wheels/``, ``manifest.json``) atomically and return its manifest.

    Args:
        target: the zip to write.
        source: the release cache entry holding ``vllm/**.py`` of the wheel.
        wheels: the downloaded third-party wheels.
        python_version: the CPython version the wheels are for.
        release: the declaration (its version goes into the manifest and the dist-info).
    Raises:
        RuntimeError: the release cache entry is of another version than the declaration.
    """
    marker = json.loads((source / ".kda-release.json").read_text())
    if marker.get("version") != release.version:
        raise RuntimeError(f"{source} holds vLLM {marker.get('version')}, the bundle is for {release.version}")
    files = sorted(p for p in (source / "vllm").rglob("*.py") if p.is_file())
    version = release.version
    metadata = (f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: the .py files of the "
                f"registry's {marker['archive']} (sha256 {marker['sha256']}), bundled by kda_patches "
                "scripts/gpu/vllm_bundle.py; no compiled extension\n")
    manifest = {
        "vllm_version": version, "vllm_archive": marker["archive"], "vllm_archive_sha256": marker["sha256"],
        "vllm_py_files": len(files), "python_version": python_version, "platforms": list(PLATFORMS),
        "declaration_evidence": release.evidence,
        "wheels": [{"file": w.name, "sha256": gpu_harness.sha256_of(w), "bytes": w.stat().st_size,
                    "requirement": req, "needed_by": why} for w, (req, why) in _pair_wheels(wheels, release.wheels)],
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        for path in files:
            archive.write(path, f"site/{path.relative_to(source).as_posix()}")
        archive.writestr(f"site/vllm-{version}.dist-info/METADATA", metadata)
        archive.writestr(f"site/vllm-{version}.dist-info/INSTALLER", "kda_patches-bundle\n")
        for wheel in wheels:
            archive.write(wheel, f"wheels/{wheel.name}", compress_type=zipfile.ZIP_STORED)
        archive.writestr("manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(partial, target)
    manifest["bundle_bytes"] = target.stat().st_size
    return manifest


def _pair_wheels(wheels: list[pathlib.Path], requirements: tuple[tuple[str, str], ...]
                 ) -> list[tuple[pathlib.Path, tuple[str, str]]]:
    """Pair each wheel file with its requirement by distribution name (``pydantic_core-...``)."""
    by_name = {_canonical(requirement.split("==")[0]): (requirement, why) for requirement, why in requirements}
    return [(wheel, by_name[_canonical(wheel.name.split("-")[0])]) for wheel in wheels]


def build(dest: pathlib.Path, python_version: str, release: ReleaseCarry | None = None) -> dict:
    """Build ``dest/<bundle_name>`` of ``release`` (default :data:`DEFAULT_VERSION`); return its manifest (+ ``path``).

    Raises:
        RuntimeError: a pin the release does not allow, a download failed, or the bundle is over
            :data:`MAX_BUNDLE_BYTES`.
    """
    release = release or release_of(DEFAULT_VERSION)
    sys.path.insert(0, str(ROOT))
    from kda_patches.releases.fetch import release_dir

    check_pins(release, python_version, dest)
    source = release_dir("vllm", release.version)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kda-bundle-") as scratch:
        wheels = download_wheels(pathlib.Path(scratch), python_version, release.wheels)
        wheels.sort(key=lambda w: w.name.lower())
        target = dest / bundle_name(python_version, release.version)
        manifest = write_bundle(target, source, wheels, python_version, release)
    if manifest["bundle_bytes"] > MAX_BUNDLE_BYTES:
        raise RuntimeError(f"{target} is {manifest['bundle_bytes'] / 2**20:.1f} MiB, over the "
                           f"{MAX_BUNDLE_BYTES >> 20} MiB this script allows (the call carries 64 MiB in all)")
    manifest["path"] = str(target)
    return manifest


def compress_libraries(dest: pathlib.Path, release: ReleaseCarry, keys: tuple[str, ...]) -> dict[str, str]:
    """Download ``release``'s ``vllm`` wheel once, xz-compress the libraries ``keys`` into ``dest``.

    Writes ``<artifact>`` and ``<artifact>.sha256`` (the sha256 of the library itself, checked on the GPU machine
    after decompression) for each one.

    Returns:
        artifact name -> sha256 of the library.
    Raises:
        RuntimeError: pip failed, or the wheel lacks a declared library.
    """
    shas = {}
    with tempfile.TemporaryDirectory(prefix="kda-wheel-") as scratch:
        # the libraries are stable-ABI (abi3): any CPython's wheel of the release holds the same files
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
                *pip_target("3.12"), "-d", scratch, f"vllm=={release.version}"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"pip download vllm=={release.version} failed:\n{done.stderr[-3000:]}")
        wheel = next(pathlib.Path(scratch).glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            for key in keys:
                member = release.libraries[key]
                try:
                    library = archive.read(member)
                except KeyError:
                    raise RuntimeError(f"{wheel.name} has no {member} (vllm_bundle.RELEASES[{release.version!r}] "
                                       f"declares it as {key!r})") from None
                name = library_artifact(member, release.version)
                partial = dest / (name + ".partial")
                partial.write_bytes(lzma.compress(library, preset=6))
                os.replace(partial, dest / name)
                shas[name] = hashlib.sha256(library).hexdigest()
                (dest / (name + ".sha256")).write_text(shas[name] + "\n")
    return shas


def tree_bytes() -> int:
    """Return the bytes of the working tree a device call carries (tracked + untracked files git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def carry_artifacts(release: ReleaseCarry, python_version: str, libraries: tuple[str, ...],
                    ray: bool, flashinfer: bool = False) -> list[str]:
    """Return the artifact names a carry of ``release`` holds, in carrying order (libraries, bundle, wheel sets).

    Raises:
        KeyError: a library key the release does not declare (names the declared ones), or ``flashinfer`` for a
            release that declares no FlashInfer carry (names those that do).
    """
    unknown = [key for key in libraries if key not in release.libraries]
    if unknown:
        raise KeyError(f"vLLM {release.version} declares no library {unknown} (declared: {sorted(release.libraries)})")
    if flashinfer and release.flashinfer is None:
        raise KeyError(f"vLLM {release.version} declares no FlashInfer carry (ReleaseCarry.flashinfer; declared for: "
                       f"{', '.join(v for v, r in RELEASES.items() if r.flashinfer) or 'none'})")
    names = [library_artifact(release.libraries[key], release.version) for key in dict.fromkeys(("core", *libraries))]
    names.append(bundle_name(python_version, release.version))
    names += [wheel_set_name("ray", python_version)] if ray else []
    return names + ([wheel_set_artifact(release, release.flashinfer, python_version)] if flashinfer else [])


def bundle_matches(bundle: pathlib.Path, release: ReleaseCarry) -> bool:
    """Return whether an existing bundle holds exactly what ``release`` declares (version and wheel pins)."""
    if not bundle.is_file():
        return False
    with zipfile.ZipFile(bundle) as archive:
        manifest = json.loads(archive.read("manifest.json"))
    return (manifest.get("vllm_version") == release.version
            and sorted(w["requirement"] for w in manifest.get("wheels", [])) == sorted(r for r, _ in release.wheels))


def carry(dest: pathlib.Path, python_version: str, libraries: tuple[str, ...] = ("core",),
          ray: bool = False, release: ReleaseCarry | None = None, flashinfer: bool = False) -> dict:
    """Build (or reuse) the bundle and the compressed libraries; write ``dest/carry/run<N>`` for consecutive calls.

    Args:
        dest: the bundle folder (gitignored).
        python_version: CPython of the bundle's wheels.
        libraries: keys of the release's libraries to carry (``core`` always; ``moe`` for MoE models).
        ray: also carry :data:`RAY_WHEELS` as a wheel set (the Ray executor).
        release: the declaration (default :data:`DEFAULT_VERSION`).
        flashinfer: also carry the release's :attr:`ReleaseCarry.flashinfer` (:func:`build_compressed_wheel_set`).
    Returns:
        The carry manifest (with ``vllm_version``), with ``tree_bytes`` (the working tree each call also carries).
    Raises:
        KeyError: see :func:`carry_artifacts` (before anything is downloaded).
        RuntimeError: a download, a pin or a checksum failed (see :func:`build`, :func:`build_compressed_wheel_set`).
    """
    release = release or release_of(DEFAULT_VERSION)
    names = carry_artifacts(release, python_version, libraries, ray, flashinfer)
    if not bundle_matches(dest / bundle_name(python_version, release.version), release):
        build(dest, python_version, release)  # checks the pins first
    missing = [key for key in dict.fromkeys(("core", *libraries))
               if not all((dest / (library_artifact(release.libraries[key], release.version) + suffix)).is_file()
                          for suffix in ("", ".sha256"))]
    if missing:
        compress_libraries(dest, release, tuple(missing))
    unpacked = {name: (dest / (name + ".sha256")).read_text().strip() for name in names if name.endswith(".so.xz")}
    if ray:
        build_wheel_set(dest, "ray", RAY_WHEELS, python_version)
    if flashinfer:
        build_compressed_wheel_set(dest, release, release.flashinfer, python_version)
    tree = tree_bytes()
    manifest = gpu_harness.write_carry({name: dest / name for name in names}, dest / "carry",
                                       gpu_harness.CALL_BYTES - tree - CALL_MARGIN, unpacked,
                                       vllm_version=release.version)
    manifest["tree_bytes"] = tree
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Command line: ``build|carry [--vllm-version V] [--python-version X.Y] [--dest DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="download and zip the bundle (CPU machine, needs the registry)")
    carry_parser = commands.add_parser("carry", help="bundle + compiled library in pieces for consecutive calls")
    for sub in (build_parser, carry_parser):
        sub.add_argument("--vllm-version", default=DEFAULT_VERSION, choices=sorted(RELEASES),
                         help=f"the declared release to carry (default {DEFAULT_VERSION})")
        sub.add_argument("--python-version", default="3.12", help="CPython of the wheels (H200: 3.12)")
        sub.add_argument("--dest", type=pathlib.Path, default=DEFAULT_DEST, help="folder (gitignored)")
    carry_parser.add_argument("--with-moe", action="store_true",
                              help="also carry vLLM's MoE op library (Qwen3-Next; one more call)")
    carry_parser.add_argument("--with-ray", action="store_true",
                              help="also carry Ray and its missing dependencies (the Ray executor; two more calls)")
    carry_parser.add_argument("--with-flashkda", action="store_true",
                              help="also carry FlashKDA (vLLM >= 0.34: Kimi K3's default prefill backend on SM90+)")
    carry_parser.add_argument("--with-fa3", action="store_true",
                              help="also carry FlashAttention 3 (vLLM >= 0.34: the attention default on SM90, for "
                                   "cases at vLLM's defaults with attention layers)")
    carry_parser.add_argument("--with-flashinfer", action="store_true",
                              help="also carry FlashInfer and the CuTe DSL (vLLM 0.34: Qwen's default GDN prefill "
                                   "on SM90; about two more calls)")
    args = parser.parse_args(argv)
    release = release_of(args.vllm_version)
    if args.command == "carry":
        libraries = ("core", *(key for key, wanted in (("moe", args.with_moe), ("flashkda", args.with_flashkda),
                                                       ("fa3", args.with_fa3)) if wanted))
        try:
            manifest = carry(args.dest, args.python_version, libraries, args.with_ray, release, args.with_flashinfer)
        except (KeyError, RuntimeError) as error:
            print(f"carry: {error.args[0] if isinstance(error, KeyError) else error}", file=sys.stderr)
            return 1
        for run in range(1, manifest["runs"] + 1):
            pieces = [p for a in manifest["artifacts"].values() for p in a["pieces"] if p["run"] == run]
            folder = os.path.relpath(args.dest / "carry" / f"run{run}", ROOT)
            print(f"run{run}: {len(pieces)} pieces, {sum(p['bytes'] for p in pieces) / 2**20:.1f} MiB + tree "
                  f"{manifest['tree_bytes'] / 2**20:.1f} MiB -> carry {folder} (vLLM {release.version})")
        return 0
    manifest = build(args.dest, args.python_version, release)
    wheel_bytes = sum(w["bytes"] for w in manifest["wheels"])
    print(f"{manifest['path']}: {manifest['bundle_bytes'] / 2**20:.1f} MiB; vllm {release.version} .py files "
          f"{manifest['vllm_py_files']}; {len(manifest['wheels'])} wheels {wheel_bytes / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
