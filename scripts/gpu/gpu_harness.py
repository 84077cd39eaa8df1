"""The GPU harness both vLLM scripts share: carrying vLLM to the H200, its compiled library, stand-ins, caches.

The H200 machine has torch 2.11 + triton 3.6, no vLLM and no network, and one call carries at most 64 MiB, the
working tree included. What vLLM needs there travels as *artifacts* (the bundle zip of ``vllm_bundle.py build``
and vLLM's real compiled op library ``vllm/_C_stable_libtorch.abi3.so``, xz-compressed), cut into *pieces* that
fill consecutive calls (:func:`plan_carry` / :func:`write_carry`, run here). On the machine, each call's command
starts with ``python3 scripts/gpu/gpu_harness.py stage CARRIED_DIR``: :func:`stage_pieces` keeps the pieces under
``/tmp`` (it survives while the machine is warm, ~30 s between calls) and joins an artifact once all its pieces are
there, checking the sha256 of every piece, of the whole, and of the unpacked library. A carry plan is of one vLLM
release (its manifest's ``vllm_version``, which every ``vllm-<version>-...`` artifact name must match): pieces of
another release are refused while a plan is staged (``stage --replace`` discards it and the unpacked site), and
:func:`prepare_site` unpacks only a bundle and libraries of one release into a site that holds no other.

:func:`install_stand_ins` (run in every GPU process through the ``sitecustomize.py`` :func:`write_stand_in_hook`
writes) supplies only what cannot run there: FlashAttention's compiled package, and -- only when the real library
is absent -- the library's import and its capability queries. Which of the two ran is :func:`stood_in_record`.
:func:`compile_cache_env` points Triton, Inductor and vLLM at one cache directory, so the engine processes of a
run (and of consecutive runs on a warm machine) compile each kernel once.

CLI (on the GPU machine): ``python3 scripts/gpu/gpu_harness.py stage DIR [--stage-dir D] [--replace]``;
``... ready`` exits 0 once every artifact of the carry plan is joined.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import lzma
import os
import pathlib
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

TMP = pathlib.Path(tempfile.gettempdir())
STAGE_DIR = TMP / "kda-stage"
SITE_DIR = TMP / "kda-vllm-bundle"
CACHE_ROOT = TMP / "kda-compile-cache"
LIBRARY_FILE = "_C_stable_libtorch.abi3.so"  # in the wheel's vllm/ folder
FA3_LIBRARY = "vllm_flash_attn/_vllm_fa3_C.abi3.so"  # FlashAttention 3, under vllm/ (vllm_bundle.py carry --with-fa3)
CALL_BYTES = 64 << 20  # what one device call carries, the working tree included
MANIFEST = "carry-manifest.json"


class CarryError(RuntimeError):
    """A piece or an artifact is missing, damaged, or does not fit a call."""


def sha256_of(path: pathlib.Path) -> str:
    """Return the hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------- carrying: artifacts -> pieces -> calls


@dataclass(frozen=True)
class Piece:
    """A byte range of one artifact, carried by call ``run`` (1-based)."""

    artifact: str
    index: int
    offset: int
    size: int
    run: int

    @property
    def file(self) -> str:
        return f"{self.artifact}.piece{self.index:02d}"


def plan_carry(sizes: dict[str, int], capacity: int) -> list[Piece]:
    """Cut artifacts into pieces that fill consecutive calls of ``capacity`` bytes each, in the given order.

    Args:
        sizes: artifact name -> bytes (dict order is carrying order).
        capacity: bytes one call may carry besides the working tree.
    Returns:
        The pieces, each with the call that carries it; the fewest calls the sizes allow.
    Raises:
        CarryError: ``capacity`` is not positive.
    """
    if capacity <= 0:
        raise CarryError(f"no room left in a call ({capacity} bytes): the working tree alone fills the "
                         f"{CALL_BYTES >> 20} MiB a call carries; carry less (compress docs/results)")
    pieces, run, room = [], 1, capacity
    for artifact, size in sizes.items():
        offset, index = 0, 0
        while offset < size or (size == 0 and index == 0):
            if room == 0:
                run, room = run + 1, capacity
            take = min(room, size - offset)
            pieces.append(Piece(artifact, index, offset, take, run))
            offset, index, room = offset + take, index + 1, room - take
            if size == 0:
                break
    return pieces


def artifact_version(name: str) -> str | None:
    """Return the vLLM version a carried artifact's name declares (``vllm-<version>-<rest>``), None for others.

    Wheel sets (``ray-wheels-cp312.zip``) name no version: vLLM pins none of them.
    """
    parts = name.split("-", 2)
    return parts[1] if len(parts) == 3 and parts[0] == "vllm" and parts[1] and parts[2] else None


def plan_version(manifest: dict[str, Any]) -> str | None:
    """Return the one vLLM version of a carry plan: its ``vllm_version`` and every artifact name's version.

    Raises:
        CarryError: the plan names two versions (both named, with the artifacts that carry each).
    """
    names: dict[str, list[str]] = {}
    if manifest.get("vllm_version"):
        names.setdefault(manifest["vllm_version"], []).append("the manifest's vllm_version")
    for name in manifest["artifacts"]:
        if version := artifact_version(name):
            names.setdefault(version, []).append(name)
    if len(names) > 1:
        raise CarryError("one carry plan mixes vLLM versions: " + "; ".join(
            f"{version} ({', '.join(where)})" for version, where in sorted(names.items()))
            + ": carry the run folders of one `vllm_bundle.py carry --vllm-version V`")
    return next(iter(names), None)


def write_carry(artifacts: dict[str, pathlib.Path], dest: pathlib.Path, capacity: int,
                unpacked_sha256: dict[str, str] | None = None, vllm_version: str | None = None) -> dict[str, Any]:
    """Write ``dest/run<N>/`` folders holding each call's pieces and the manifest; return the manifest.

    Args:
        artifacts: name -> file, in carrying order.
        dest: folder to fill (its ``run*`` folders are replaced).
        capacity: bytes per call besides the working tree.
        unpacked_sha256: for a compressed artifact, the sha256 of its decompressed content.
        vllm_version: the release carried (recorded; else the one the artifact names give, if any).
    Raises:
        CarryError: the artifacts name another version than ``vllm_version``, or two (nothing is written).
    """
    manifest: dict[str, Any] = {"vllm_version": vllm_version, "capacity": capacity,
                                "artifacts": dict.fromkeys(artifacts)}
    manifest["vllm_version"] = plan_version(manifest)
    pieces = plan_carry({name: path.stat().st_size for name, path in artifacts.items()}, capacity)
    for old in dest.glob("run*"):
        shutil.rmtree(old)
    manifest["runs"] = max(p.run for p in pieces)
    for name, path in artifacts.items():
        manifest["artifacts"][name] = {"bytes": path.stat().st_size, "sha256": sha256_of(path),
                                       "unpacked_sha256": (unpacked_sha256 or {}).get(name), "pieces": []}
    with_data = {name: path.read_bytes() for name, path in artifacts.items()}
    for piece in pieces:
        folder = dest / f"run{piece.run}"
        folder.mkdir(parents=True, exist_ok=True)
        data = with_data[piece.artifact][piece.offset:piece.offset + piece.size]
        (folder / piece.file).write_bytes(data)
        manifest["artifacts"][piece.artifact]["pieces"].append(
            {"file": piece.file, "run": piece.run, "offset": piece.offset, "bytes": piece.size,
             "sha256": hashlib.sha256(data).hexdigest()})
    for folder in sorted(dest.glob("run*")):
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def stage_pieces(carried: pathlib.Path, stage: pathlib.Path = STAGE_DIR, replace: bool = False,
                 site: pathlib.Path = SITE_DIR) -> dict[str, Any]:
    """Keep the pieces ``carried`` brought in ``stage``; join every artifact whose pieces are all there.

    Args:
        carried: one ``run<N>`` folder of :func:`write_carry`, as it arrived on the machine.
        stage: where pieces wait for the next call and joined artifacts are written.
        replace: a staged plan of another vLLM release is discarded instead of refusing these pieces, and so is
            a ``site`` that holds another release (:func:`discard_site`).
        site: the unpacked site ``replace`` discards.
    Returns:
        ``{"have": [...], "missing": [...], "joined": {artifact: path}, "artifacts", "vllm_version"}``
        (``missing`` lists pieces still to come).
    Raises:
        CarryError: no manifest; the plan mixes versions; a plan of another vLLM version is staged (both named;
            ``replace`` not given); a piece's sha256 differs, or a joined artifact's sha256 differs.
    """
    source = carried / MANIFEST
    if not source.is_file():
        raise CarryError(f"{carried} has no {MANIFEST}: carry a run folder written by vllm_bundle.py carry")
    manifest = json.loads(source.read_text())
    version = plan_version(manifest)
    stage.mkdir(parents=True, exist_ok=True)
    previous = stage / MANIFEST
    if previous.is_file():
        staged = json.loads(previous.read_text())
        staged_version = plan_version(staged)
        if staged_version != version and not replace:
            raise CarryError(f"{carried} brings pieces of vLLM {version or '(no version)'}, but {stage} holds a "
                             f"staged carry of vLLM {staged_version or '(no version)'}: pieces of two releases never "
                             "join; stage with --replace to discard the staged one (and the unpacked site)")
        if staged["artifacts"] != manifest["artifacts"]:
            for stale in stage.iterdir():  # pieces of another carry plan must not mix with these
                if stale.is_file():
                    stale.unlink()
    if replace and any(found != version for found in site_versions(site)):
        discard_site(site)
    shutil.copyfile(source, previous)
    have, missing, joined = [], [], {}
    for name, artifact in manifest["artifacts"].items():
        for piece in artifact["pieces"]:
            arrived, kept = carried / piece["file"], stage / piece["file"]
            if arrived.is_file() and not kept.is_file():
                if sha256_of(arrived) != piece["sha256"]:
                    raise CarryError(f"piece {piece['file']} arrived damaged (sha256 differs from the manifest)")
                shutil.copyfile(arrived, kept)
            (have if kept.is_file() else missing).append(piece["file"])
        target = stage / name
        if target.is_file() and sha256_of(target) == artifact["sha256"]:
            joined[name] = str(target)
        elif all((stage / piece["file"]).is_file() for piece in artifact["pieces"]):
            partial = target.with_name(target.name + ".joining")
            with open(partial, "wb") as out:
                for piece in artifact["pieces"]:
                    out.write((stage / piece["file"]).read_bytes())
            if sha256_of(partial) != artifact["sha256"]:
                partial.unlink()
                raise CarryError(f"{name}: the joined pieces' sha256 differs from the manifest")
            os.replace(partial, target)
            joined[name] = str(target)
    return {"have": have, "missing": missing, "joined": joined, "artifacts": manifest["artifacts"],
            "vllm_version": version}


def staged_version(stage: pathlib.Path = STAGE_DIR) -> str | None:
    """Return the vLLM version of the carry plan staged in ``stage`` (None: nothing staged, or no version)."""
    manifest = stage / MANIFEST
    return plan_version(json.loads(manifest.read_text())) if manifest.is_file() else None


def site_versions(site: pathlib.Path = SITE_DIR) -> list[str]:
    """Return the vLLM versions unpacked in ``site`` (its ``vllm-<version>.dist-info`` folders)."""
    return sorted(entry.name[len("vllm-"):-len(".dist-info")] for entry in site.glob("vllm-*.dist-info")) \
        if site.is_dir() else []


def discard_site(site: pathlib.Path = SITE_DIR) -> list[str]:
    """Remove the unpacked site and its scratch folders (``<site>-zip``, wheel sets); return what was removed."""
    removed = []
    for folder in sorted(site.parent.glob(site.name + "*")):
        if folder.is_dir() and (folder == site or folder.name.startswith(site.name + "-")):
            shutil.rmtree(folder)
            removed.append(str(folder))
    return removed


# marks a folder in a carried library's artifact name: vllm-0.34.0-vllm_flash_attn+_vllm_fa3_C.abi3.so.xz is
# vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so (vllm_bundle.library_artifact writes it)
LIBRARY_FOLDER_MARK = "+"


def library_file_of(artifact: str) -> str:
    """Return the path under ``vllm/`` of a carried library artifact ``vllm-<version>-<file>.xz`` (folders marked by
    :data:`LIBRARY_FOLDER_MARK`).

    Raises:
        CarryError: the name is not of that form, or it climbs out of ``vllm/``.
    """
    parts = artifact.split("-", 2)
    if len(parts) != 3 or parts[0] != "vllm" or not parts[2].endswith(".so.xz"):
        raise CarryError(f"{artifact!r} is not a carried library (vllm-<version>-<file>.so.xz)")
    folders = parts[2].removesuffix(".xz").split(LIBRARY_FOLDER_MARK)
    if any(part in ("", ".", "..") for part in folders):
        raise CarryError(f"{artifact!r} is not a carried library (an empty or relative folder in its name)")
    return "/".join(folders)


def install_library(compressed: pathlib.Path, expected_sha256: str, site: pathlib.Path = SITE_DIR,
                    file: str = LIBRARY_FILE) -> pathlib.Path:
    """Decompress one of vLLM's compiled libraries into ``site/vllm/<file>`` and check it is the wheel's own file.

    Raises:
        CarryError: the decompressed library's sha256 is not ``expected_sha256``.
    """
    target = site / "vllm" / file
    if target.is_file() and sha256_of(target) == expected_sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with lzma.open(compressed) as source, open(partial, "wb") as out:
        shutil.copyfileobj(source, out, 1 << 22)
    if sha256_of(partial) != expected_sha256:
        partial.unlink()
        raise CarryError(f"{file}: decompressed sha256 differs from the wheel's ({expected_sha256[:12]}...)")
    os.replace(partial, target)
    return target


def unpack_bundle(bundle: pathlib.Path, site: pathlib.Path = SITE_DIR) -> dict[str, Any]:
    """Unzip the bundle into ``site`` and install its wheels there (no index, no deps); return its manifest.

    Raises:
        CarryError: the bundle is missing or pip failed.
    """
    import subprocess
    import zipfile

    if not bundle.is_file():
        raise CarryError(f"no bundle at {bundle}: build it with `python scripts/gpu/vllm_bundle.py carry` on the "
                         "CPU machine and carry its run folders (gpu_harness.py stage)")
    version = bundle_version(bundle)
    other = [found for found in site_versions(site) if found != version]
    if other:
        raise CarryError(f"{site} already holds vLLM {', '.join(other)}; the bundle {bundle.name} is vLLM {version}: "
                         "one site never holds two releases (gpu_harness.py stage --replace discards it)")
    scratch = site.with_name(site.name + "-zip")
    if scratch.is_dir():
        shutil.rmtree(scratch)
    with zipfile.ZipFile(bundle) as archive:
        archive.extractall(scratch)
    manifest = json.loads((scratch / "manifest.json").read_text())
    site.mkdir(parents=True, exist_ok=True)
    for entry in (scratch / "site").iterdir():
        target = site / entry.name
        if not target.exists():
            entry.rename(target)
    wheels = sorted(str(w) for w in (scratch / "wheels").glob("*.whl"))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], capture_output=True,
                          text=True)
    if done.returncode:
        raise CarryError(f"installing the bundle's wheels failed:\n{done.stderr[-3000:]}")
    return manifest


def bundle_version(bundle: pathlib.Path) -> str | None:
    """Return the ``vllm_version`` of a bundle zip's own manifest."""
    import zipfile

    with zipfile.ZipFile(bundle) as archive:
        return json.loads(archive.read("manifest.json")).get("vllm_version")


def is_wheel_set(name: str) -> bool:
    """Return whether a carried artifact is a wheel set of ``vllm_bundle.py``: ``<name>-wheels-cpXY.zip`` (the
    wheels as downloaded) or ``vllm-<version>-<name>-wheels-cpXY.tar.xz`` (repacked, xz-compressed, a manifest)."""
    return name.endswith((".zip", ".tar.xz")) and "-wheels-cp" in name


def _unpack_compressed_wheel_set(archive_path: pathlib.Path, scratch: pathlib.Path) -> dict[str, Any]:
    """Unpack a ``.tar.xz`` wheel set into ``scratch``; check every wheel against its manifest; return the manifest.

    Raises:
        CarryError: no manifest, a wheel it lists is missing or its sha256 differs, or the archive holds a wheel
            it does not list.
    """
    import tarfile

    with tarfile.open(archive_path, "r:xz") as archive:
        members = [m for m in archive.getmembers() if m.isfile()]
        names = {m.name for m in members}
        if "manifest.json" not in names or any(m.name.startswith("/") or ".." in m.name.split("/") for m in members):
            raise CarryError(f"{archive_path.name} is not a wheel set of vllm_bundle.py (no manifest.json, or a path "
                             "outside the set)")
        for member in members:
            target = scratch / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.extractfile(member) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 22)
    manifest = json.loads((scratch / "manifest.json").read_text())
    listed = {f"wheels/{entry['file']}": entry["sha256"] for entry in manifest["wheels"]}
    for name, expected in listed.items():
        if not (scratch / name).is_file() or sha256_of(scratch / name) != expected:
            raise CarryError(f"{archive_path.name}: {name} is missing or its sha256 differs from the set's manifest")
    unlisted = sorted(n for n in names if n.endswith(".whl") and n not in listed)
    if unlisted:
        raise CarryError(f"{archive_path.name}: wheels its manifest does not list: {', '.join(unlisted)}")
    return manifest


def install_wheel_set(archive_path: pathlib.Path, site: pathlib.Path = SITE_DIR) -> dict[str, Any]:
    """Install every wheel of a carried wheel set into ``site`` (no index, no deps); return what was installed.

    A ``.pth`` file a wheel puts at the site's top (the CuTe DSL's adds its ``dsl_packages`` folder to the path) is
    listed in ``site/`` :data:`CARRIED_PTH`: the engine processes get the site through ``PYTHONPATH``, whose entries
    Python does not scan for ``.pth`` files; :func:`activate_carried_pth` processes them.

    A compressed set already installed in ``site`` from the same archive (its sha256, in ``site/``
    :data:`INSTALLED_SETS`) is not installed again: the engine check prepares the site at every call.

    Raises:
        CarryError: a checksum of a compressed set differs, or pip failed.
    """
    import subprocess
    import zipfile

    compressed = archive_path.name.endswith(".tar.xz")
    installed_sets = site / INSTALLED_SETS
    known = json.loads(installed_sets.read_text()) if compressed and installed_sets.is_file() else {}
    digest = sha256_of(archive_path) if compressed else None
    if digest and known.get(archive_path.name, {}).get("sha256") == digest:
        return known[archive_path.name]["record"]
    scratch = site.with_name(site.name + "-" + archive_path.name.removesuffix(".tar.xz").removesuffix(".zip"))
    if scratch.is_dir():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    record: dict[str, Any] = {"set": archive_path.name}
    if compressed:
        manifest = _unpack_compressed_wheel_set(archive_path, scratch)
        wheels = sorted(str(w) for w in (scratch / "wheels").glob("*.whl"))
        record["registry_sha256"] = {entry["file"]: entry["registry_sha256"] for entry in manifest["wheels"]}
    else:
        with zipfile.ZipFile(archive_path) as archive:
            archive.extractall(scratch)
        wheels = sorted(str(w) for w in scratch.glob("*.whl"))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], capture_output=True,
                          text=True)
    if done.returncode:
        raise CarryError(f"installing {archive_path.name} failed:\n{done.stderr[-3000:]}")
    pth = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            pth += [name for name in archive.namelist() if "/" not in name and name.endswith(".pth")]
    pth = sorted(set(pth))
    record["wheels"] = [pathlib.Path(w).name for w in wheels]
    if pth:
        listed = site / CARRIED_PTH
        before = json.loads(listed.read_text()) if listed.is_file() else []
        listed.write_text(json.dumps(sorted(set(before) | set(pth))))
        record["pth"] = pth
    if compressed:
        shutil.rmtree(scratch)  # the repacked wheels (the size of the installed files) are not needed again
        installed_sets.write_text(json.dumps({**known, archive_path.name: {"sha256": digest, "record": record}}))
    return record


CARRIED_PTH = "kda-carried-pth.json"  # in the site: the .pth files carried wheels installed there
INSTALLED_SETS = "kda-installed-wheel-sets.json"  # in the site: compressed wheel sets installed there, by sha256
_ACTIVATED_PTH: set[tuple[str, str]] = set()


def activate_carried_pth(entries: list[str] | None = None) -> list[str]:
    """Process the ``.pth`` files carried wheels installed in a site on the path, as if it were a site directory.

    Only the files the site's :data:`CARRIED_PTH` lists, each once per process (``site.addpackage``: a line
    starting with ``import`` is executed, any other adds a folder). Run by :func:`install_stand_ins`, so every
    process the stand-in hook reaches sees e.g. the CuTe DSL's ``cutlass`` package.

    Args:
        entries: path entries to look in (default: ``sys.path``).
    Returns:
        The ``.pth`` files processed by this call (full paths).
    """
    import site as site_module

    done = []
    for entry in list(sys.path if entries is None else entries):
        listed = os.path.join(entry or ".", CARRIED_PTH)
        if not os.path.isfile(listed):
            continue
        with open(listed) as handle:
            names = json.load(handle)
        for name in names:
            if (entry, name) not in _ACTIVATED_PTH and os.path.isfile(os.path.join(entry, name)):
                _ACTIVATED_PTH.add((entry, name))
                site_module.addpackage(entry, name, None)
                done.append(os.path.join(entry, name))
    return done


def prepare_site(bundle: pathlib.Path | None = None, site: pathlib.Path = SITE_DIR,
                 stage: pathlib.Path = STAGE_DIR) -> dict[str, Any]:
    """Unpack vLLM into ``site``: the given bundle zip, else the staged one; the staged compiled library with it.

    Returns:
        ``{"bundle": its manifest, "bundle_file", "vllm_version": the bundle's, "libraries": files installed,
        "wheel_sets": installed sets (the compressed ones with the registry's sha256 of each wheel and the ``.pth``
        files they brought), "compiled_library": bool}`` (the last: vLLM's op library is there).
    Raises:
        CarryError: no bundle given and none staged; the bundle, the staged plan and the staged libraries are
            not all of one vLLM version (checked before anything is unpacked; both named); the site holds another
            version; or a checksum differs.
    """
    manifest_file = stage / MANIFEST
    staged = json.loads(manifest_file.read_text()) if manifest_file.is_file() else {"artifacts": {}}
    artifacts = staged["artifacts"]
    joined, _ = staged_artifacts(stage)
    if bundle is None:
        staged_zip = [name for name in joined if name.endswith(".zip") and not is_wheel_set(name)]
        if not staged_zip:
            raise CarryError(f"no bundle given and none staged in {stage}: carry .bundle/carry/run* "
                             "(vllm_bundle.py carry) and stage them, or pass the bundle zip")
        bundle = stage / staged_zip[0]
    version = bundle_version(bundle) if bundle.is_file() else None
    if joined and plan_version(staged) != version:  # plan_version also refuses a plan that mixes versions
        raise CarryError(f"{bundle.name} is vLLM {version}, the carry staged in {stage} is vLLM "
                         f"{plan_version(staged)} ({', '.join(joined)}): a bundle and libraries of two releases are "
                         "never unpacked together")
    prepared: dict[str, Any] = {"bundle": unpack_bundle(bundle, site), "bundle_file": str(bundle), "libraries": [],
                                "vllm_version": version}
    prepared["wheel_sets"] = []
    for name in joined:
        if name.endswith(".so.xz"):
            file = library_file_of(name)
            install_library(stage / name, artifacts[name]["unpacked_sha256"], site, file)
            prepared["libraries"].append(file)
        elif is_wheel_set(name):
            prepared["wheel_sets"].append(install_wheel_set(stage / name, site))
    prepared["compiled_library"] = library_present(site)
    return prepared


def library_present(site: pathlib.Path = SITE_DIR, file: str = LIBRARY_FILE) -> bool:
    """Return whether vLLM's real compiled library ``file`` (default: the op library) is in the unpacked bundle."""
    return (site / "vllm" / file).is_file()


# ---------------------------------------------------------------- stand-ins (only what cannot run there)

MSA_WARMUP = "vllm.model_executor.warmup.minimax_m3_msa_warmup"
MSA_WARMUP_FILE = pathlib.Path(*MSA_WARMUP.split(".")).with_suffix(".py")
STOOD_IN = {
    "vllm._C_stable_libtorch": "vLLM's compiled custom-op library, only when its real file is not carried (92 MB "
    "in the wheel; it loads on the H200's torch 2.11): vllm/platforms/cuda.py imports it unconditionally to "
    "register torch.ops._C.*",
    "vllm.vllm_flash_attn": "only where FlashAttention 3 is not carried (vllm_bundle.py carry --with-fa3): package "
    "__init__ raises ImportError without the compiled FA2/FA3 extensions (~480 MB); "
    "vllm.v1.worker.utils imports it through vllm.model_executor.layers.attention. Stood in by the package's own "
    "flash_attn_interface module (FA2_AVAILABLE = FA3_AVAILABLE = False there): no FlashAttention kernel runs",
    MSA_WARMUP: "vLLM >= 0.34's kernel_warmup imports it on every CUDA GPU, and it imports MiniMax M3's CuTe DSL "
    "kernels (`import cutlass` and `quack`: the nvidia-cutlass-dsl and quack-kernels wheels, carried only with "
    "--with-flashinfer). Stood in only when the release has "
    "the file and either package is absent, by a minimax_m3_msa_warmup(worker) that returns None where the release's "
    "returns None before any kernel (the model has no MiniMaxM3SparseAttention, or the GPU is not SM100-family: "
    "the H200 is SM90) and raises otherwise",
}
CAPABILITY_QUERIES = ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8",
                      "cutlass_group_gemm_supported")
_LIBRARIES: list[Any] = []


def stood_in_names(library: bool, site: pathlib.Path | None = None) -> tuple[str, ...]:
    """Return the modules stood in.

    Args:
        library: vLLM's real compiled library is carried (then its import is not stood in).
        site: the unpacked bundle; the MiniMax M3 warm-up module is stood in only where it holds that file and no
            ``cutlass`` package (None: not stood in); FlashAttention's package is not stood in where it holds
            FlashAttention 3's library (:data:`FA3_LIBRARY`).
    Returns:
        FlashAttention's package unless carried; the library's import only without it; the warm-up module as above.
    """
    left_out = {"vllm._C_stable_libtorch": library,
                MSA_WARMUP: site is None or not msa_warmup_needs_stand_in(site),
                "vllm.vllm_flash_attn": site is not None and library_present(site, FA3_LIBRARY)}
    return tuple(name for name in STOOD_IN if not left_out.get(name, False))


# the packages the MiniMax M3 warm-up module's import chain needs, and where each lies in a site when carried: the top
# (a plain wheel) or, for ``cutlass``, the folder the nvidia-cutlass-dsl wheel's .pth adds to the path (vllm_bundle.py
# carry --with-flashinfer; H100 run 21: with ``cutlass`` carried and ``quack`` not, every 0.34 engine stopped at
# warm-up on ``No module named 'quack'``)
CUTE_DSL_PACKAGES = {
    "cutlass": (pathlib.PurePosixPath("cutlass"), pathlib.PurePosixPath("nvidia_cutlass_dsl/dsl_packages/cutlass")),
    "quack": (pathlib.PurePosixPath("quack"),),
}


def msa_warmup_needs_stand_in(site: pathlib.Path) -> bool:
    """Return whether the bundle in ``site`` has vLLM >= 0.34's MiniMax M3 warm-up module but not every package of
    :data:`CUTE_DSL_PACKAGES` (neither in the site nor importable)."""
    if not (site / MSA_WARMUP_FILE).is_file():
        return False
    return any(not any((site / folder).is_dir() for folder in folders) and importlib.util.find_spec(name) is None
               for name, folders in CUTE_DSL_PACKAGES.items())


def stand_in_msa_warmup(worker: Any) -> None:
    """The stood-in ``minimax_m3_msa_warmup``: nothing to warm, as in the release, unless MiniMax M3 is served.

    Raises:
        RuntimeError: the model has a ``MiniMaxM3SparseAttention`` module on an SM100-family GPU (the release
            would build its CuTe DSL kernels; the fix is carrying nvidia-cutlass-dsl).
    """
    import torch

    sparse = any(type(m).__name__ == "MiniMaxM3SparseAttention" for m in worker.get_model().modules())
    if sparse and torch.cuda.get_device_capability()[0] == 10:
        raise RuntimeError("MiniMax M3's MSA warm-up is stood in (gpu_harness.STOOD_IN): carry nvidia-cutlass-dsl "
                           "to serve a MiniMax M3 model on an SM100-family GPU")


class StandInFinder:
    """Meta-path finder that supplies the stood-in modules when vLLM imports them (GPU processes only).

    Installed by the ``sitecustomize.py`` of :func:`write_stand_in_hook`, so every process vLLM starts gets the
    same stand-ins. The library's import is stood in only when its file is absent next to the ``vllm`` package.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        """Return a spec for a stood-in name, None for everything else (the real module then loads)."""
        if fullname == "vllm._C_stable_libtorch":
            package = sys.modules.get("vllm")
            folders = list(getattr(package, "__path__", []) or [])
            if any(os.path.isfile(os.path.join(folder, LIBRARY_FILE)) for folder in folders):
                return None
            return importlib.machinery.ModuleSpec(fullname, self)
        if fullname == MSA_WARMUP and path:
            site = pathlib.Path(next(iter(path))).parents[2]  # .../site/vllm/model_executor/warmup
            return importlib.machinery.ModuleSpec(fullname, self) if msa_warmup_needs_stand_in(site) else None
        if fullname == "vllm.vllm_flash_attn" and path:
            if os.path.isfile(os.path.join(next(iter(path)), FA3_LIBRARY)):
                return None  # FlashAttention 3 carried: the package imports as released
            spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            spec.submodule_search_locations = [os.path.join(next(iter(path)), "vllm_flash_attn")]
            return spec
        return None

    def create_module(self, spec: Any) -> Any:
        """Default module creation."""
        return None

    def exec_module(self, module: Any) -> None:
        """Fill the stand-in: capability queries for the library; FA's own interface names otherwise."""
        module.__doc__ = f"kda_patches gpu_harness stand-in: {STOOD_IN[module.__name__]}"
        if module.__name__ == "vllm._C_stable_libtorch":
            stand_in_capability_queries()
            return
        if module.__name__ == MSA_WARMUP:
            module.minimax_m3_msa_warmup = stand_in_msa_warmup
            return
        interface = importlib.import_module("vllm.vllm_flash_attn.flash_attn_interface")
        for name in dir(interface):
            if not name.startswith("__"):
                setattr(module, name, getattr(interface, name))


def stand_in_capability_queries() -> None:
    """Define the ``torch.ops._C`` capability queries vLLM calls while importing, each answering False."""
    import torch

    library = torch.library.Library("_C", "FRAGMENT")  # kept alive by _LIBRARIES
    for name in CAPABILITY_QUERIES:
        library.define(f"{name}(int cuda_device_capability) -> bool")
        library.impl(name, lambda cuda_device_capability: False, "CompositeExplicitAutograd")
    _LIBRARIES.append(library)


def install_stand_ins() -> None:
    """Process the carried ``.pth`` files (:func:`activate_carried_pth`), then put :class:`StandInFinder` first on
    ``sys.meta_path`` (idempotent)."""
    activate_carried_pth()
    if not any(isinstance(finder, StandInFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, StandInFinder())


# served GDN shapes per GPU for the kernel-level probes: name -> (value heads H, key heads Hg, K, V)
GDN_SHAPES = {"qwen3-next-80b-tp1": (32, 16, 128, 128), "qwen3.6-27b-tp4": (12, 4, 128, 128)}


def add_row_grid(parser: argparse.ArgumentParser, tokens: list[int], dtypes: list[str]) -> None:
    """Add a kernel probe's row grid to ``parser``: ``--out``, ``--shapes`` (of :data:`GDN_SHAPES`), ``--sequences``
    (1, 8, 64, 256), ``--tokens`` and ``--dtypes`` (the cache dtypes) with these defaults."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", default=list(GDN_SHAPES), choices=list(GDN_SHAPES))
    parser.add_argument("--sequences", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--tokens", nargs="+", type=int, default=tokens)
    parser.add_argument("--dtypes", nargs="+", default=dtypes)


def open_site_in_process() -> dict[str, Any]:
    """Unpack the staged carry (:func:`prepare_site`), put the site first on ``sys.path`` and install the stand-ins
    (:func:`install_stand_ins`): this process can then import the carried vLLM. Returns what :func:`prepare_site`
    returns."""
    prepared = prepare_site()
    sys.path.insert(0, str(SITE_DIR))
    install_stand_ins()
    return prepared


def write_stand_in_hook(folder: pathlib.Path, module: str, function: str) -> pathlib.Path:
    """Write ``folder/sitecustomize.py`` that calls ``scripts/gpu/<module>.<function>()`` in every process.

    Args:
        folder: put on ``PYTHONPATH`` of the processes that need the stand-ins.
        module: a module of ``scripts/gpu`` (imported by name with that folder on the path for the import only).
        function: its stand-in installer.
    """
    folder.mkdir(parents=True, exist_ok=True)
    script_dir = str(pathlib.Path(__file__).resolve().parent)
    (folder / "sitecustomize.py").write_text(
        "# written by kda_patches scripts/gpu/gpu_harness.py: stand-ins for what cannot run on the GPU machine\n"
        f"import sys\nsys.path.insert(0, {script_dir!r})\nimport {module}\n"
        f"sys.path.remove({script_dir!r})\n{module}.{function}()\n")
    return folder


def stood_in_record(library: bool, site: pathlib.Path | None = None) -> dict[str, str]:
    """Return every module stood in and why, for the results (the capability queries only without the library;
    ``site`` as in :func:`stood_in_names`)."""
    record = {name: STOOD_IN[name] for name in stood_in_names(library, site)}
    if not library:
        record.update({f"torch.ops._C.{name}": "capability query called at import time; answers False "
                       "(unsupported), so vLLM picks no CUTLASS/compiled path" for name in CAPABILITY_QUERIES})
    return record


# ---------------------------------------------------------------- compile caches


def compile_cache_env(root: pathlib.Path = CACHE_ROOT) -> dict[str, str]:
    """Return the variables that put Triton's, Inductor's and vLLM's compile caches under ``root``.

    Every engine process of a run (and of the next call while the machine is warm) then reuses kernels compiled
    once, instead of compiling vLLM's Triton kernels again (minutes per cold process).
    """
    return {"TRITON_CACHE_DIR": str(root / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "VLLM_CACHE_ROOT": str(root / "vllm")}


def staged_artifacts(stage: pathlib.Path = STAGE_DIR) -> tuple[list[str], list[str]]:
    """Return (joined, missing) artifact names of the carry plan last staged in ``stage`` (both empty: none)."""
    manifest = stage / MANIFEST
    if not manifest.is_file():
        return [], []
    artifacts = json.loads(manifest.read_text())["artifacts"]
    joined = [name for name, entry in artifacts.items()
              if (stage / name).is_file() and (stage / name).stat().st_size == entry["bytes"]]
    return joined, [name for name in artifacts if name not in joined]


def main(argv: list[str] | None = None) -> int:
    """``stage DIR``: keep the carried pieces, join what is complete, print one ``STAGE`` line.
    ``ready``: exit 0 when every artifact of the staged plan is joined (the engine check can run), 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    stage_parser = commands.add_parser("stage", help="keep this call's pieces; join complete artifacts")
    stage_parser.add_argument("carried", type=pathlib.Path)
    stage_parser.add_argument("--stage-dir", type=pathlib.Path, default=STAGE_DIR)
    stage_parser.add_argument("--replace", action="store_true",
                              help="a staged carry of another vLLM release is discarded (with the unpacked site) "
                                   "instead of refusing these pieces")
    stage_parser.add_argument("--site-dir", type=pathlib.Path, default=SITE_DIR,
                              help="the unpacked site --replace discards when it holds another release")
    ready_parser = commands.add_parser("ready", help="exit 0 when every carried artifact is joined")
    ready_parser.add_argument("--stage-dir", type=pathlib.Path, default=STAGE_DIR)
    args = parser.parse_args(argv)
    if args.command == "ready":
        joined, missing = staged_artifacts(args.stage_dir)
        if joined and not missing:
            return 0
        print(f"not staged: {', '.join(missing) or 'nothing carried'} (carry .bundle/carry/run* of "
              "vllm_bundle.py carry in consecutive calls)")
        return 1
    state = stage_pieces(args.carried, args.stage_dir, args.replace, args.site_dir)
    print(f"STAGE vLLM {state['vllm_version']}: {len(state['have'])} pieces here, {len(state['missing'])} to come; "
          f"joined: {', '.join(sorted(state['joined'])) or 'none yet'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
