"""Build the carry bundle that brings vLLM 0.33.0's own Python code to the GPU machine (issue 9).

The H200 machine has torch 2.11 + triton 3.6 but no vLLM and no network, and one call carries at most 64 MiB
(the CUDA wheel is ~330 MB). The paths the overlay patches -- ``KimiK3DeltaAttention._forward`` and
``QwenGatedDeltaNetAttention._forward_core`` with their Triton kernels -- are pure Python + Triton, so this
bundle carries exactly:

- ``site/vllm/**.py``: every ``.py`` file of the registry's ``vllm==0.33.0`` wheel (taken through
  :func:`kda_patches.releases.fetch.release_dir`, the project's release cache), plus a minimal
  ``vllm-0.33.0.dist-info/METADATA`` written here (name and version only: vLLM's platform detection and the
  overlay's version ranges read ``importlib.metadata.version("vllm")``; without it CUDA is never detected);
- ``wheels/*.whl``: CPython wheels of the third-party packages vLLM's import chain of those layers needs and
  the GPU image lacks (:data:`WHEELS`, found by importing the layer modules in a clean interpreter that has
  only the GPU image's packages, see ``vllm_layers_check.py --dry-run``);
- ``manifest.json``: versions, sha256 of every wheel, file counts.

Usage (here, on the CPU machine; the result is gitignored and never committed)::

    python scripts/gpu/vllm_bundle.py build                       # -> .bundle/vllm-0.33.0-cp312.zip (H200)
    python scripts/gpu/vllm_bundle.py build --python-version 3.11 # same bundle for this machine's dry run
    python scripts/gpu/vllm_bundle.py carry                       # -> .bundle/carry/run1, run2, ...

The GPU side (``gpu_harness.unpack_bundle``) unpacks the zip and installs the wheels with
``pip install --no-index --no-deps --target``. The zip holds no compiled vLLM extension; ``carry`` adds vLLM's
real compiled op library (:data:`LIBRARY_MEMBER` of the same wheel, xz-compressed, 92.6 -> 63.7 MB) and cuts
library and bundle into pieces that fill consecutive device calls beside the working tree
(``gpu_harness.write_carry``): carry ``.bundle/carry/run1``, then ``run2``, ... in back-to-back calls, each
command starting with ``python3 scripts/gpu/gpu_harness.py stage .bundle/carry/runN``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_harness  # noqa: E402  (carrying: pieces, checksums)

sys.path.remove(str(pathlib.Path(__file__).resolve().parent))
VLLM_VERSION = "0.33.0"
DEFAULT_DEST = ROOT / ".bundle"

# (requirement, why: the first import in vLLM's chain that needs it). Versions honour vLLM 0.33.0's
# Requires-Dist; each one missing from the H200 image's package list (device KINDS.md, read 2026-11-17).
# --no-deps: every package the chain imports is listed by hand (a dry run finds a missing one).
WHEELS: tuple[tuple[str, str], ...] = (
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
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux1_x86_64",
             "manylinux_2_5_x86_64")
MAX_BUNDLE_BYTES = 48 << 20  # the call carries 64 MiB in all, the working tree included
# vLLM's compiled libraries that can be carried: the op library every engine needs, and the MoE op library
# (topk_softmax, moe_align_block_size, ...) only the MoE models need (Qwen3-Next)
LIBRARIES = {"core": "vllm/_C_stable_libtorch.abi3.so", "moe": "vllm/_moe_C_stable_libtorch.abi3.so"}
LIBRARY_MEMBER = LIBRARIES["core"]


def library_artifact(member: str) -> str:
    """Return the carried artifact's name of a wheel member (``vllm-0.33.0-<file>.xz``; gpu_harness reads it back)."""
    return f"vllm-{VLLM_VERSION}-{pathlib.PurePosixPath(member).name}.xz"


LIBRARY_ARTIFACT = library_artifact(LIBRARY_MEMBER)
CALL_MARGIN = 2 << 20  # slack for files written between planning and the call


def bundle_name(python_version: str) -> str:
    """Return the bundle's file name for a CPython version such as ``3.12``."""
    return f"vllm-{VLLM_VERSION}-cp{python_version.replace('.', '')}.zip"


def download_wheels(dest: pathlib.Path, python_version: str,
                    requirements: tuple[tuple[str, str], ...] = WHEELS) -> list[pathlib.Path]:
    """Download every requirement (default :data:`WHEELS`) for CPython ``python_version`` on manylinux x86-64.

    Raises:
        RuntimeError: pip failed (names the requirement and pip's stderr tail).
    """
    dest.mkdir(parents=True, exist_ok=True)
    for requirement, _ in requirements:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
                "--disable-pip-version-check", "--python-version", python_version, "--implementation", "cp",
                *[flag for platform in PLATFORMS for flag in ("--platform", platform)], "-d", str(dest), requirement]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"pip download {requirement} for cp{python_version} failed:\n{done.stderr[-3000:]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != len(requirements):
        raise RuntimeError(f"expected {len(requirements)} wheels in {dest}, found {[w.name for w in wheels]}")
    return wheels


# The Ray executor (issue 29): Ray and what it imports that the GPU image lacks (the image has click, filelock,
# msgpack, packaging, protobuf, pyyaml, requests, aiohttp and attrs). 79 MB for Ray's wheel alone: two more calls.
RAY_WHEELS: tuple[tuple[str, str], ...] = (
    ("ray==2.60.0", "vLLM's Ray executor (distributed_executor_backend=ray)"),
    ("jsonschema==4.26.0", "ray"),
    ("jsonschema-specifications==2025.9.1", "jsonschema"),
    ("referencing==0.37.0", "jsonschema"),
    ("rpds-py==2026.9.1", "referencing"),
)


def build_wheel_set(dest: pathlib.Path, name: str, requirements: tuple[tuple[str, str], ...],
                    python_version: str) -> pathlib.Path:
    """Download ``requirements`` and store them in ``dest/<name>-wheels-cpXY.zip`` (a carried wheel set)."""
    target = dest / f"{name}-wheels-cp{python_version.replace('.', '')}.zip"
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


def write_bundle(target: pathlib.Path, source: pathlib.Path, wheels: list[pathlib.Path], python_version: str) -> dict:
    """Write the bundle zip (``site/``, ``wheels/``, ``manifest.json``) atomically and return its manifest.

    Args:
        target: the zip to write.
        source: the release cache entry holding ``vllm/**.py`` of the wheel.
        wheels: the downloaded third-party wheels.
        python_version: the CPython version the wheels are for.
    """
    marker = json.loads((source / ".kda-release.json").read_text())
    files = sorted(p for p in (source / "vllm").rglob("*.py") if p.is_file())
    metadata = (f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\nSummary: the .py files of the "
                f"registry's {marker['archive']} (sha256 {marker['sha256']}), bundled by kda_patches "
                "scripts/gpu/vllm_bundle.py; no compiled extension\n")
    manifest = {
        "vllm_version": VLLM_VERSION, "vllm_archive": marker["archive"], "vllm_archive_sha256": marker["sha256"],
        "vllm_py_files": len(files), "python_version": python_version, "platforms": list(PLATFORMS),
        "wheels": [{"file": w.name, "sha256": gpu_harness.sha256_of(w), "bytes": w.stat().st_size,
                    "requirement": req, "needed_by": why} for w, (req, why) in _pair_wheels(wheels)],
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        for path in files:
            archive.write(path, f"site/{path.relative_to(source).as_posix()}")
        archive.writestr(f"site/vllm-{VLLM_VERSION}.dist-info/METADATA", metadata)
        archive.writestr(f"site/vllm-{VLLM_VERSION}.dist-info/INSTALLER", "kda_patches-bundle\n")
        for wheel in wheels:
            archive.write(wheel, f"wheels/{wheel.name}", compress_type=zipfile.ZIP_STORED)
        archive.writestr("manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(partial, target)
    manifest["bundle_bytes"] = target.stat().st_size
    return manifest


def _pair_wheels(wheels: list[pathlib.Path]) -> list[tuple[pathlib.Path, tuple[str, str]]]:
    """Pair each wheel file with its :data:`WHEELS` entry by distribution name (``pydantic_core-...``)."""
    by_name = {requirement.split("==")[0].replace("-", "_").lower(): (requirement, why) for requirement, why in WHEELS}
    return [(wheel, by_name[wheel.name.split("-")[0].lower()]) for wheel in wheels]


def build(dest: pathlib.Path, python_version: str) -> dict:
    """Build ``dest/<bundle_name>`` for ``python_version``; return its manifest (with ``path``).

    Raises:
        RuntimeError: a download failed, or the bundle is over :data:`MAX_BUNDLE_BYTES`.
    """
    sys.path.insert(0, str(ROOT))
    from kda_patches.releases.fetch import release_dir

    source = release_dir("vllm", VLLM_VERSION)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kda-bundle-") as scratch:
        wheels = download_wheels(pathlib.Path(scratch), python_version)
        wheels.sort(key=lambda w: w.name.lower())
        target = dest / bundle_name(python_version)
        manifest = write_bundle(target, source, wheels, python_version)
    if manifest["bundle_bytes"] > MAX_BUNDLE_BYTES:
        raise RuntimeError(f"{target} is {manifest['bundle_bytes'] / 2**20:.1f} MiB, over the "
                           f"{MAX_BUNDLE_BYTES >> 20} MiB this script allows (the call carries 64 MiB in all)")
    manifest["path"] = str(target)
    return manifest


def compress_library(dest: pathlib.Path, member: str = LIBRARY_MEMBER) -> tuple[pathlib.Path, str]:
    """Download the ``vllm`` wheel, xz-compress its ``member`` into ``dest``; return (file, sha256).

    The sha256 is of the library itself, checked on the GPU machine after decompression.

    Raises:
        RuntimeError: pip failed.
    """
    target = dest / library_artifact(member)
    with tempfile.TemporaryDirectory(prefix="kda-wheel-") as scratch:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", scratch,
                f"vllm=={VLLM_VERSION}"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"pip download vllm=={VLLM_VERSION} failed:\n{done.stderr[-3000:]}")
        wheel = next(pathlib.Path(scratch).glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            library = archive.read(member)
    sha = hashlib.sha256(library).hexdigest()
    partial = target.with_suffix(".partial")
    partial.write_bytes(lzma.compress(library, preset=6))
    os.replace(partial, target)
    return target, sha


def tree_bytes() -> int:
    """Return the bytes of the working tree a device call carries (tracked + untracked files git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def carry(dest: pathlib.Path, python_version: str, libraries: tuple[str, ...] = ("core",),
          ray: bool = False) -> dict:
    """Build (or reuse) the bundle and the compressed libraries; write ``dest/carry/run<N>`` for consecutive calls.

    Args:
        dest: the bundle folder (gitignored).
        python_version: CPython of the bundle's wheels.
        libraries: keys of :data:`LIBRARIES` to carry (``core`` always; ``moe`` for MoE models).
        ray: also carry :data:`RAY_WHEELS` as a wheel set (the Ray executor).
    Returns:
        The carry manifest, with ``tree_bytes`` (the working tree each call also carries).
    """
    bundle = dest / bundle_name(python_version)
    if not bundle.is_file():
        build(dest, python_version)
    compressed, unpacked = {}, {}
    for key in dict.fromkeys(("core", *libraries)):
        name = library_artifact(LIBRARIES[key])
        sha_file = dest / (name + ".sha256")
        if not (dest / name).is_file() or not sha_file.is_file():
            _, sha = compress_library(dest, LIBRARIES[key])
            sha_file.write_text(sha + "\n")
        compressed[name], unpacked[name] = dest / name, sha_file.read_text().strip()
    extra = {}
    if ray:
        wheel_set = build_wheel_set(dest, "ray", RAY_WHEELS, python_version)
        extra[wheel_set.name] = wheel_set
    tree = tree_bytes()
    manifest = gpu_harness.write_carry({**compressed, bundle.name: bundle, **extra}, dest / "carry",
                                       gpu_harness.CALL_BYTES - tree - CALL_MARGIN, unpacked)
    manifest["tree_bytes"] = tree
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Command line: ``build|carry [--python-version X.Y] [--dest DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="download and zip the bundle (CPU machine, needs the registry)")
    build_parser.add_argument("--python-version", default="3.12", help="CPython of the wheels (H200: 3.12)")
    build_parser.add_argument("--dest", type=pathlib.Path, default=DEFAULT_DEST, help="folder (gitignored)")
    carry_parser = commands.add_parser("carry", help="bundle + compiled library in pieces for consecutive calls")
    carry_parser.add_argument("--python-version", default="3.12", help="CPython of the wheels (H200: 3.12)")
    carry_parser.add_argument("--dest", type=pathlib.Path, default=DEFAULT_DEST, help="folder (gitignored)")
    carry_parser.add_argument("--with-moe", action="store_true",
                              help="also carry vLLM's MoE op library (Qwen3-Next; one more call)")
    carry_parser.add_argument("--with-ray", action="store_true",
                              help="also carry Ray and its missing dependencies (the Ray executor; two more calls)")
    args = parser.parse_args(argv)
    if args.command == "carry":
        manifest = carry(args.dest, args.python_version, ("core", "moe") if args.with_moe else ("core",),
                         args.with_ray)
        for run in range(1, manifest["runs"] + 1):
            pieces = [p for a in manifest["artifacts"].values() for p in a["pieces"] if p["run"] == run]
            folder = os.path.relpath(args.dest / "carry" / f"run{run}", ROOT)
            print(f"run{run}: {len(pieces)} pieces, {sum(p['bytes'] for p in pieces) / 2**20:.1f} MiB + tree "
                  f"{manifest['tree_bytes'] / 2**20:.1f} MiB -> carry {folder}")
        return 0
    manifest = build(args.dest, args.python_version)
    wheel_bytes = sum(w["bytes"] for w in manifest["wheels"])
    print(f"{manifest['path']}: {manifest['bundle_bytes'] / 2**20:.1f} MiB; vllm {VLLM_VERSION} .py files "
          f"{manifest['vllm_py_files']}; {len(manifest['wheels'])} wheels {wheel_bytes / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
