"""``scripts/gpu/gpu_harness.py`` on the CPU (issue 26): carrying artifacts in pieces over consecutive device calls,
joining them with every checksum checked, the compiled library's install, and which stand-ins apply.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import pathlib
import sys

import pytest
from script_loader import load_script

harness = load_script("gpu/gpu_harness.py", "gpu_harness_under_test")


def artifacts(tmp_path: pathlib.Path, sizes: dict[str, int]) -> dict[str, pathlib.Path]:
    files = {}
    for name, size in sizes.items():
        path = tmp_path / "source" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        files[name] = path
    return files


def test_pieces_fill_each_call_in_order_and_use_the_fewest_calls():
    pieces = harness.plan_carry({"library.xz": 250, "bundle.zip": 120}, capacity=100)
    assert [(p.artifact, p.offset, p.size, p.run) for p in pieces] == [
        ("library.xz", 0, 100, 1), ("library.xz", 100, 100, 2), ("library.xz", 200, 50, 3),
        ("bundle.zip", 0, 50, 3), ("bundle.zip", 50, 70, 4)]
    assert max(p.run for p in pieces) == -(-370 // 100)


def test_a_call_with_no_room_beside_the_tree_is_refused():
    with pytest.raises(harness.CarryError, match="working tree"):
        harness.plan_carry({"library.xz": 10}, capacity=0)


def test_artifacts_join_only_when_every_piece_arrived_and_match_the_whole(tmp_path):
    files = artifacts(tmp_path, {"library.xz": 3000, "bundle.zip": 1500})
    harness.write_carry(files, tmp_path / "carry", capacity=2000)
    stage = tmp_path / "stage"
    first = harness.stage_pieces(tmp_path / "carry" / "run1", stage)
    assert first["joined"] == {} and first["missing"]
    harness.stage_pieces(tmp_path / "carry" / "run2", stage)
    last = harness.stage_pieces(tmp_path / "carry" / "run3", stage)
    assert last["missing"] == [] and set(last["joined"]) == set(files)
    for name, path in files.items():
        assert pathlib.Path(last["joined"][name]).read_bytes() == path.read_bytes()


def test_a_damaged_piece_is_refused_and_nothing_is_joined(tmp_path):
    files = artifacts(tmp_path, {"library.xz": 500})
    harness.write_carry(files, tmp_path / "carry", capacity=300)
    piece = next((tmp_path / "carry" / "run2").glob("*.piece*"))
    data = bytearray(piece.read_bytes())
    data[0] ^= 0xFF
    piece.write_bytes(bytes(data))
    harness.stage_pieces(tmp_path / "carry" / "run1", tmp_path / "stage")
    with pytest.raises(harness.CarryError, match="damaged"):
        harness.stage_pieces(tmp_path / "carry" / "run2", tmp_path / "stage")
    assert not (tmp_path / "stage" / "library.xz").exists()


def test_a_joined_artifact_whose_whole_differs_from_the_manifest_is_refused(tmp_path):
    files = artifacts(tmp_path, {"library.xz": 500})
    harness.write_carry(files, tmp_path / "carry", capacity=1000)
    manifest_path = tmp_path / "carry" / "run1" / harness.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["artifacts"]["library.xz"]["sha256"] = "0" * 64  # pieces intact, the whole's record wrong
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(harness.CarryError, match="joined pieces"):
        harness.stage_pieces(tmp_path / "carry" / "run1", tmp_path / "stage")
    assert not (tmp_path / "stage" / "library.xz").exists()


def test_pieces_of_another_carry_plan_are_cleared_before_staging(tmp_path):
    stage = tmp_path / "stage"
    old = artifacts(tmp_path / "old", {"library.xz": 400})
    harness.write_carry(old, tmp_path / "old-carry", capacity=300)
    harness.stage_pieces(tmp_path / "old-carry" / "run1", stage)  # one old piece left waiting
    new = artifacts(tmp_path / "new", {"library.xz": 400})
    harness.write_carry(new, tmp_path / "new-carry", capacity=300)
    harness.stage_pieces(tmp_path / "new-carry" / "run2", stage)
    state = harness.stage_pieces(tmp_path / "new-carry" / "run1", stage)
    assert pathlib.Path(state["joined"]["library.xz"]).read_bytes() == new["library.xz"].read_bytes()


def test_a_run_folder_without_manifest_is_refused_with_the_fix(tmp_path):
    (tmp_path / "run1").mkdir()
    with pytest.raises(harness.CarryError, match=r"vllm_bundle\.py carry"):
        harness.stage_pieces(tmp_path / "run1", tmp_path / "stage")


def test_the_library_installs_only_with_the_wheels_checksum(tmp_path):
    library = os.urandom(4096)
    compressed = tmp_path / "lib.so.xz"
    compressed.write_bytes(lzma.compress(library))
    site = tmp_path / "site"
    with pytest.raises(harness.CarryError, match="sha256"):
        harness.install_library(compressed, "0" * 64, site)
    assert not harness.library_present(site) and not list((site / "vllm").iterdir())
    path = harness.install_library(compressed, hashlib.sha256(library).hexdigest(), site)
    assert path.read_bytes() == library and harness.library_present(site)


def fake_vllm(tmp_path: pathlib.Path, with_library: bool, monkeypatch) -> None:
    package = tmp_path / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    if with_library:
        (package / harness.LIBRARY_FILE).write_bytes(b"\x7fELF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    import vllm  # noqa: F401  (the fake package)


@pytest.mark.parametrize("with_library", [True, False])
def test_the_library_import_is_stood_in_only_when_its_file_is_absent(tmp_path, monkeypatch, with_library):
    fake_vllm(tmp_path, with_library, monkeypatch)
    spec = harness.StandInFinder().find_spec("vllm._C_stable_libtorch")
    assert (spec is None) == with_library
    record = harness.stood_in_record(with_library)
    assert ("vllm._C_stable_libtorch" in record) != with_library
    assert any("cutlass" in name for name in record) != with_library
    assert "vllm.vllm_flash_attn" in record


def test_the_compile_caches_share_one_root(tmp_path):
    env = harness.compile_cache_env(tmp_path)
    assert set(env) == {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"}
    assert all(value.startswith(str(tmp_path)) for value in env.values())
    assert len(set(env.values())) == 3


def test_the_engine_check_is_ready_only_once_every_artifact_is_joined(tmp_path):
    files = artifacts(tmp_path, {"library.xz": 300, "bundle.zip": 100})
    harness.write_carry(files, tmp_path / "carry", capacity=250)
    stage = tmp_path / "stage"
    assert harness.main(["ready", "--stage-dir", str(stage)]) == 1  # nothing carried yet
    harness.stage_pieces(tmp_path / "carry" / "run1", stage)
    assert harness.staged_artifacts(stage) == ([], ["library.xz", "bundle.zip"])
    assert harness.main(["ready", "--stage-dir", str(stage)]) == 1
    harness.stage_pieces(tmp_path / "carry" / "run2", stage)
    assert harness.staged_artifacts(stage) == (["library.xz", "bundle.zip"], [])
    assert harness.main(["ready", "--stage-dir", str(stage)]) == 0


def tiny_wheel(folder: pathlib.Path, name: str) -> pathlib.Path:
    """A minimal real wheel of a package ``name`` that pip installs."""
    import zipfile

    wheel = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{name}/__init__.py", "VALUE = 1\n")
        archive.writestr(f"{name}-0.1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        archive.writestr(f"{name}-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n")
        archive.writestr(f"{name}-0.1.dist-info/RECORD", "")
    return wheel


def tiny_bundle(path: pathlib.Path, version: str = "test") -> pathlib.Path:
    """A bundle zip shaped like vllm_bundle.py's: site/vllm/__init__.py, its dist-info, one real (minimal) wheel,
    the manifest."""
    import zipfile

    wheel = tiny_wheel(path.parent, "kdafake")
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("site/vllm/__init__.py", f"VERSION = {version!r}\n")
        archive.writestr(f"site/vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\n")
        archive.write(wheel, f"wheels/{wheel.name}")
        archive.writestr("manifest.json", json.dumps({"vllm_version": version}))
    return path


def test_the_site_gets_the_staged_bundle_and_libraries(tmp_path):
    library, moe = os.urandom(2048), os.urandom(1024)
    xz = tmp_path / "source" / "vllm-test-_C_stable_libtorch.abi3.so.xz"
    moe_xz = tmp_path / "source" / "vllm-test-_moe_C_stable_libtorch.abi3.so.xz"
    xz.parent.mkdir()
    xz.write_bytes(lzma.compress(library))
    moe_xz.write_bytes(lzma.compress(moe))
    bundle = tiny_bundle(tmp_path / "source" / "vllm-test-cp312.zip")
    import zipfile

    wheel_set = tmp_path / "source" / "ray-wheels-cp312.zip"  # named like a wheel set, sorted before the bundle
    with zipfile.ZipFile(wheel_set, "w") as archive:
        archive.write(tiny_wheel(tmp_path / "source", "kdafakeray"), "kdafakeray-0.1-py3-none-any.whl")
    harness.write_carry({xz.name: xz, moe_xz.name: moe_xz, wheel_set.name: wheel_set, bundle.name: bundle},
                        tmp_path / "carry",
                        capacity=1 << 20, unpacked_sha256={xz.name: hashlib.sha256(library).hexdigest(),
                                                           moe_xz.name: hashlib.sha256(moe).hexdigest()})
    stage, site = tmp_path / "stage", tmp_path / "site"
    with pytest.raises(harness.CarryError, match="none staged"):
        harness.prepare_site(None, site, stage)
    harness.stage_pieces(tmp_path / "carry" / "run1", stage)
    prepared = harness.prepare_site(None, site, stage)
    assert prepared["compiled_library"] and prepared["bundle"] == {"vllm_version": "test"}
    assert (site / "vllm" / harness.LIBRARY_FILE).read_bytes() == library
    assert (site / "vllm" / "_moe_C_stable_libtorch.abi3.so").read_bytes() == moe
    assert sorted(prepared["libraries"]) == sorted([harness.LIBRARY_FILE, "_moe_C_stable_libtorch.abi3.so"])
    assert (site / "kdafake" / "__init__.py").is_file()  # the bundle's wheels are installed into the site
    assert (site / "kdafakeray" / "__init__.py").is_file()  # and every carried wheel set's
    assert prepared["bundle_file"].endswith("vllm-test-cp312.zip")
    assert prepared["wheel_sets"] == [{"set": wheel_set.name, "wheels": ["kdafakeray-0.1-py3-none-any.whl"]}]


def test_a_library_artifact_names_its_file_and_anything_else_is_refused():
    assert harness.library_file_of("vllm-0.33.0-_moe_C_stable_libtorch.abi3.so.xz") == "_moe_C_stable_libtorch.abi3.so"
    # a library in a folder of vllm/ (FlashAttention 3): the folder is marked in the name
    assert harness.library_file_of("vllm-0.34.0-vllm_flash_attn+_vllm_fa3_C.abi3.so.xz") == harness.FA3_LIBRARY
    for name in ("vllm-0.33.0-cp312.zip", "lib.so.xz", "torch-2.11-_C.so.xz", "vllm-0.34.0-..+_C.so.xz",
                 "vllm-0.34.0-+_C.so.xz"):
        with pytest.raises(harness.CarryError, match="not a carried library"):
            harness.library_file_of(name)


@pytest.mark.parametrize("fa3_carried", [False, True])
def test_flash_attention_is_stood_in_only_where_fa3_was_not_carried(tmp_path, fa3_carried):
    site = tmp_path / "site"
    (site / "vllm" / "vllm_flash_attn").mkdir(parents=True)
    if fa3_carried:
        (site / "vllm" / harness.FA3_LIBRARY).write_bytes(b"\x7fELF")
    assert ("vllm.vllm_flash_attn" in harness.stood_in_record(True, site)) is not fa3_carried
    spec = harness.StandInFinder().find_spec("vllm.vllm_flash_attn", [str(site / "vllm")])
    assert (spec is None) is fa3_carried  # carried: the released package imports with its real extension
    assert "vllm.vllm_flash_attn" in harness.stood_in_record(True)  # no site named: stood in as before


# ---------------------------------------------------------------- one vLLM release per carry plan, stage and site


def versioned_carry(tmp_path: pathlib.Path, version: str, capacity: int = 1 << 20) -> tuple[pathlib.Path, bytes]:
    """Write the carry of a tiny release ``version`` (its op library and its bundle, named as vllm_bundle names them);
    return the carry folder and the library's bytes."""
    source = tmp_path / f"source-{version}"
    source.mkdir(parents=True)
    library = os.urandom(2048)
    xz = source / f"vllm-{version}-{harness.LIBRARY_FILE}.xz"
    xz.write_bytes(lzma.compress(library))
    bundle = tiny_bundle(source / f"vllm-{version}-cp312.zip", version)
    harness.write_carry({xz.name: xz, bundle.name: bundle}, tmp_path / f"carry-{version}", capacity,
                        {xz.name: hashlib.sha256(library).hexdigest()}, vllm_version=version)
    return tmp_path / f"carry-{version}", library


def test_a_carry_plan_records_its_version_and_the_stage_reports_it(tmp_path):
    carry, _ = versioned_carry(tmp_path, "0.34.0")
    manifest = json.loads((carry / "run1" / harness.MANIFEST).read_text())
    assert manifest["vllm_version"] == "0.34.0"
    state = harness.stage_pieces(carry / "run1", tmp_path / "stage")
    assert state["vllm_version"] == "0.34.0" and harness.staged_version(tmp_path / "stage") == "0.34.0"


def test_artifacts_of_two_versions_never_make_one_carry_plan(tmp_path):
    files = artifacts(tmp_path, {"vllm-0.33.0-_C_stable_libtorch.abi3.so.xz": 100, "vllm-0.34.0-cp312.zip": 100})
    with pytest.raises(harness.CarryError, match=r"0\.33\.0.*0\.34\.0"):
        harness.write_carry(files, tmp_path / "carry", capacity=1000)
    one = {"vllm-0.34.0-cp312.zip": files["vllm-0.34.0-cp312.zip"]}
    with pytest.raises(harness.CarryError, match=r"0\.33\.0.*0\.34\.0"):  # the declared version against the names
        harness.write_carry(one, tmp_path / "carry", capacity=1000, vllm_version="0.33.0")
    assert not (tmp_path / "carry").exists()  # nothing written
    manifest = harness.write_carry(one, tmp_path / "carry", capacity=1000)
    assert manifest["vllm_version"] == "0.34.0"  # undeclared: the artifact names give it
    manifest["artifacts"]["vllm-0.33.0-_C_stable_libtorch.abi3.so.xz"] = manifest["artifacts"]["vllm-0.34.0-cp312.zip"]
    (tmp_path / "carry" / "run1" / harness.MANIFEST).write_text(json.dumps(manifest))  # a hand-mixed plan
    with pytest.raises(harness.CarryError, match="mixes vLLM versions"):
        harness.stage_pieces(tmp_path / "carry" / "run1", tmp_path / "stage")


def test_pieces_of_another_release_are_refused_while_one_is_staged_naming_both(tmp_path):
    old, _ = versioned_carry(tmp_path, "0.33.0", capacity=2000)
    new, library = versioned_carry(tmp_path, "0.34.0", capacity=2000)
    stage = tmp_path / "stage"
    harness.stage_pieces(old / "run1", stage)  # 0.33.0's first call; its second never came
    kept = sorted(path.name for path in stage.iterdir())
    with pytest.raises(harness.CarryError, match=r"vLLM 0\.34\.0.*vLLM 0\.33\.0"):
        harness.stage_pieces(new / "run1", stage)
    assert sorted(path.name for path in stage.iterdir()) == kept  # nothing of 0.34.0 joined the staged pieces
    with pytest.raises(harness.CarryError, match="--replace"):  # the command line refuses too, naming the way out
        harness.main(["stage", str(new / "run1"), "--stage-dir", str(stage)])
    site = tmp_path / "site"
    for run in sorted(new.glob("run*")):
        assert harness.main(["stage", str(run), "--stage-dir", str(stage), "--replace", "--site-dir", str(site)]) == 0
    assert harness.staged_version(stage) == "0.34.0" and harness.staged_artifacts(stage)[1] == []
    assert harness.prepare_site(None, site, stage)["vllm_version"] == "0.34.0"
    assert (site / "vllm" / harness.LIBRARY_FILE).read_bytes() == library


def test_a_bundle_and_staged_libraries_of_two_releases_are_never_unpacked_together(tmp_path):
    carry, _ = versioned_carry(tmp_path, "0.33.0")
    stage, site = tmp_path / "stage", tmp_path / "site"
    harness.stage_pieces(carry / "run1", stage)
    other = tiny_bundle(tmp_path / "vllm-0.34.0-cp312.zip", "0.34.0")
    with pytest.raises(harness.CarryError, match=r"vLLM 0\.34\.0.*vLLM 0\.33\.0"):
        harness.prepare_site(other, site, stage)
    assert not site.exists()  # refused before anything was unpacked


def test_a_site_holding_another_release_is_refused_until_replaced(tmp_path):
    old, _ = versioned_carry(tmp_path, "0.33.0")
    new, _ = versioned_carry(tmp_path, "0.34.0")
    site = tmp_path / "site"
    harness.stage_pieces(old / "run1", tmp_path / "stage-old", site=site)
    assert harness.prepare_site(None, site, tmp_path / "stage-old")["vllm_version"] == "0.33.0"
    harness.stage_pieces(new / "run1", tmp_path / "stage-new", site=site)  # another stage: the site still holds 0.33
    with pytest.raises(harness.CarryError, match=r"holds vLLM 0\.33\.0.*is vLLM 0\.34\.0"):
        harness.prepare_site(None, site, tmp_path / "stage-new")
    assert harness.site_versions(site) == ["0.33.0"] and (site / "vllm" / "__init__.py").read_text() == \
        "VERSION = '0.33.0'\n"
    harness.stage_pieces(new / "run1", tmp_path / "stage-new", replace=True, site=site)
    assert harness.prepare_site(None, site, tmp_path / "stage-new")["vllm_version"] == "0.34.0"
    assert harness.site_versions(site) == ["0.34.0"] and (site / "vllm" / "__init__.py").read_text() == \
        "VERSION = '0.34.0'\n"


def test_a_library_artifact_names_its_version():
    assert harness.artifact_version("vllm-0.34.0-_C_stable_libtorch.abi3.so.xz") == "0.34.0"
    assert harness.artifact_version("vllm-0.34.0-cp312.zip") == "0.34.0"
    assert harness.artifact_version("ray-wheels-cp312.zip") is None and harness.artifact_version("library.xz") is None


# which of the CuTe DSL packages the warm-up module imports are carried beside it: stood in unless both are
CUTE_DSL_CARRIED = [(), ("cutlass",), ("quack",), ("cutlass", "quack")]


def fake_site_with_msa_warmup(tmp_path: pathlib.Path, monkeypatch, carried: tuple[str, ...]) -> pathlib.Path:
    """An unpacked bundle with vLLM 0.34's MiniMax M3 warm-up module (which imports ``cutlass`` and ``quack``), with
    the ``carried`` packages beside it."""
    site = tmp_path / "site"
    warmup = site / harness.MSA_WARMUP_FILE
    warmup.parent.mkdir(parents=True)
    for folder in (site / "vllm", site / "vllm" / "model_executor", warmup.parent):
        (folder / "__init__.py").write_text("")
    warmup.write_text("import cutlass\nimport quack\n\ndef minimax_m3_msa_warmup(worker):\n    return 'release'\n")
    for package in carried:
        (site / package).mkdir()
        (site / package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.") or n in ("cutlass", "quack")]:
        monkeypatch.delitem(sys.modules, name)
    return site


@pytest.fixture
def modules_imported_here_dropped():
    """Drop the modules a test imported from its own fake site (``cutlass``, ``vllm.*``) when it ends."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


@pytest.mark.parametrize("carried", CUTE_DSL_CARRIED)
def test_the_msa_warmup_is_stood_in_only_where_the_release_has_it_without_its_cute_dsl_packages(
        tmp_path, monkeypatch, carried, modules_imported_here_dropped):
    import importlib

    site = fake_site_with_msa_warmup(tmp_path, monkeypatch, carried)
    monkeypatch.setattr(sys, "meta_path", [harness.StandInFinder(), *sys.meta_path])
    module = importlib.import_module(harness.MSA_WARMUP)
    complete = set(carried) == {"cutlass", "quack"}
    assert (module.minimax_m3_msa_warmup is harness.stand_in_msa_warmup) != complete
    assert (harness.MSA_WARMUP in harness.stood_in_record(True, site)) != complete
    assert harness.MSA_WARMUP not in harness.stood_in_record(True)  # no site: a 0.33 run stands nothing in there


def test_the_msa_warmup_is_stood_in_only_where_the_release_would_have_warmed_nothing(monkeypatch):
    import torch

    class MiniMaxM3SparseAttention(torch.nn.Module):
        pass

    def worker(*layers):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), *layers)
        return type("Worker", (), {"get_model": lambda self: model})()

    for major, layers, raises in ((10, (), False), (9, (MiniMaxM3SparseAttention(),), False),
                                  (10, (MiniMaxM3SparseAttention(),), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda major=major: (major, 0))
        if raises:
            with pytest.raises(RuntimeError, match="nvidia-cutlass-dsl"):
                harness.stand_in_msa_warmup(worker(*layers))
        else:
            assert harness.stand_in_msa_warmup(worker(*layers)) is None


@pytest.mark.parametrize("carried", CUTE_DSL_CARRIED)
def test_the_parent_s_record_reads_the_unpacked_site_it_does_not_import(tmp_path, carried):
    """The engine check's parent process never puts the unpacked bundle on its path: the record follows the files."""
    site = tmp_path / "site"
    (site / harness.MSA_WARMUP_FILE).parent.mkdir(parents=True)
    (site / harness.MSA_WARMUP_FILE).write_text("import cutlass\nimport quack\n")
    for package in carried:
        (site / package).mkdir()
        (site / package / "__init__.py").write_text("")
    assert str(site) not in sys.path
    assert (harness.MSA_WARMUP in harness.stood_in_record(True, site)) != (set(carried) == {"cutlass", "quack"})


# ---------------------------------------------------------------- xz-compressed wheel sets and their .pth files


def compressed_wheel_set(path: pathlib.Path, wheels: list[pathlib.Path], listed: list[pathlib.Path] | None = None,
                         lie_about: str | None = None) -> pathlib.Path:
    """A ``.tar.xz`` wheel set shaped like vllm_bundle.py's: ``manifest.json`` listing ``listed`` (default: every
    wheel) with their sha256 (a wrong one for ``lie_about``), and ``wheels/<file>``."""
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    entries = [{"file": w.name, "registry_sha256": "r" * 64,
                "sha256": "0" * 64 if w.name == lie_about else hashlib.sha256(w.read_bytes()).hexdigest()}
               for w in (wheels if listed is None else listed)]
    with tarfile.open(path, "w:xz") as archive:
        data = json.dumps({"set": "flashinfer", "wheels": entries}).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
        for wheel in wheels:
            archive.add(wheel, f"wheels/{wheel.name}")
    return path


def test_a_compressed_wheel_set_installs_only_what_its_manifest_lists_with_the_same_sha256(tmp_path, monkeypatch):
    assert harness.is_wheel_set("vllm-0.34.0-flashinfer-wheels-cp312.tar.xz") and harness.is_wheel_set(
        "ray-wheels-cp312.zip") and not harness.is_wheel_set("vllm-0.34.0-_flashkda_C.abi3.so.xz")
    wheels = [tiny_wheel(tmp_path, "kdafakefi"), tiny_wheel(tmp_path, "kdafakedsl")]
    site = tmp_path / "site"
    good = compressed_wheel_set(tmp_path / "vllm-9.9.9-flashinfer-wheels-cp312.tar.xz", wheels)
    installed = harness.install_wheel_set(good, site)
    assert installed["wheels"] == sorted(w.name for w in wheels) and "pth" not in installed
    assert installed["registry_sha256"] == {w.name: "r" * 64 for w in wheels}
    assert (site / "kdafakefi" / "__init__.py").is_file() and (site / "kdafakedsl" / "__init__.py").is_file()
    with monkeypatch.context() as patched:  # the same archive again (the next call's engine check): not reinstalled
        patched.setattr("subprocess.run", lambda *a, **k: pytest.fail("reinstalled an installed set"))
        assert harness.install_wheel_set(good, site) == installed
    other = tmp_path / "other-site"
    lying = compressed_wheel_set(tmp_path / "lying" / good.name, wheels, lie_about=wheels[1].name)
    with pytest.raises(harness.CarryError, match=r"kdafakedsl-0\.1-py3-none-any\.whl is missing or its sha256 differs"):
        harness.install_wheel_set(lying, other)
    unlisted = compressed_wheel_set(tmp_path / "unlisted" / good.name, wheels, listed=wheels[:1])
    with pytest.raises(harness.CarryError, match=r"does not list: wheels/kdafakedsl-0\.1-py3-none-any\.whl"):
        harness.install_wheel_set(unlisted, other)
    assert not other.exists()  # refused before pip ran


def test_only_the_carried_pth_files_are_processed_and_each_once(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "listed-folder").mkdir(parents=True)
    (site / "other-folder").mkdir()
    (site / "carried.pth").write_text("listed-folder\n")
    (site / "not-carried.pth").write_text("other-folder\n")
    (site / harness.CARRIED_PTH).write_text(json.dumps(["carried.pth"]))
    monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere"), str(site)])
    monkeypatch.setattr(harness, "_ACTIVATED_PTH", set())
    assert harness.activate_carried_pth() == [str(site / "carried.pth")]
    assert str(site / "listed-folder") in sys.path and str(site / "other-folder") not in sys.path
    assert harness.activate_carried_pth() == []  # once per process


@pytest.mark.parametrize("layout", ["none", "top", "nvidia-cutlass-dsl"])
def test_a_cute_dsl_carried_in_its_wheel_s_layout_is_not_stood_in(tmp_path, layout):
    """The nvidia-cutlass-dsl wheel puts ``cutlass`` under ``nvidia_cutlass_dsl/dsl_packages`` (its .pth adds it);
    quack-kernels is carried beside it at the top."""
    site = tmp_path / "site"
    (site / harness.MSA_WARMUP_FILE).parent.mkdir(parents=True)
    (site / harness.MSA_WARMUP_FILE).write_text("import cutlass\nimport quack\n")
    (site / "quack").mkdir()
    (site / "quack" / "__init__.py").write_text("")
    folder = {"top": "cutlass", "nvidia-cutlass-dsl": "nvidia_cutlass_dsl/dsl_packages/cutlass"}.get(layout)
    if folder:
        (site / folder).mkdir(parents=True)
        (site / folder / "__init__.py").write_text("")
    assert (harness.MSA_WARMUP in harness.stood_in_record(True, site)) == (layout == "none")
