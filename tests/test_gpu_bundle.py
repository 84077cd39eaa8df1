"""``scripts/gpu/vllm_bundle.py`` on the CPU, without the registry: the per-release declarations (``RELEASES``)
drive every artifact's name, the wheels a bundle holds, the libraries a carry takes, and the pins checked against the
release's own ``Requires-Dist``; adding a release is a declaration.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import lzma
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest
from script_loader import load_script

bundle = load_script("gpu/vllm_bundle.py", "vllm_bundle_under_test")
harness = load_script("gpu/gpu_harness.py", "gpu_harness_for_bundle_test")

# Requires-Dist of the registry's vllm==0.34.0 wheel (its METADATA, read 2026-12-03): every line that names a carried
# package, and two that must not count (another platform's pin, an extra's).
REQUIRES_034 = [
    "cachetools", "fastapi[standard]<0.137.0,>=0.133.0", "starlette>=1.0.1", "openai>=2.25.0", "pydantic>=2.12.0",
    'llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64" or platform_machine == "arm64" or platform_machine == '
    '"aarch64" or platform_machine == "ppc64le" or platform_machine == "s390x"',
    'xgrammar==0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64" or platform_machine == "arm64" or '
    'platform_machine == "s390x" or platform_machine == "ppc64le"',
    "partial-json-parser", "pyzmq>=25.0.0", "msgspec", "compressed-tensors==0.17.0", "pybase64", "cbor2",
    "oss-harmony>=0.0.11", "apache-tvm-ffi==0.1.11",
    'protobuf==7.36.1; platform_machine == "s390x"', 'zentorch==2.14.0.2; extra == "zen"',
    "flashinfer-python==0.7.3", "nvidia-cutlass-dsl[cu13]==4.8.0", "nvidia-cudnn-frontend>=1.31.0",
]
# Requires-Dist of the registry's wheels the 0.34.0 FlashInfer carry holds (their METADATA, read 2026-12-07)
FLASHINFER_REQUIRES = {
    "flashinfer-python==0.7.4": [
        "apache-tvm-ffi<0.2,>=0.1.11", "click", "cuda-python>=12.0", "cuda-tile>=1.4.0", "einops",
        "nccl-extensions>=0.1.0", "nccl4py>=0.4.1", "ninja", "numpy", "nvidia-cudnn-frontend>=1.32.0",
        "nvidia-cutlass-dsl>=4.8.0", "nvidia-ml-py", "packaging>=24.2", "requests", "tabulate", "torch", "tqdm",
        'torch>=2.12.0; extra == "b12x"', 'nvidia-cutlass-dsl[cu13]>=4.8.0; extra == "cu13"',
        'nvshmem4py-cu13>=0.3.1; extra == "sm107"'],
    "nvidia-cutlass-dsl==4.8.0": [
        "nvidia-cutlass-dsl-libs-base==4.8.0", "nvidia-cutlass-dsl-libs-cu12==4.8.0",
        'nvidia-cutlass-dsl-libs-cu13==4.8.0; extra == "cu13"',
        'nvidia-cutlass-dsl-libs-qnx-cu12==4.8.0; extra == "qnx"'],
    "nvidia-cutlass-dsl-libs-base==4.8.0": [
        "typing-extensions>=4.10.0", "cuda-bindings>=12.8", 'backports.strenum; python_version < "3.11"',
        "protobuf>=4.21.12", "nvidia-cutlass-dsl-libs-core==4.8.0",
        'nvidia-cuda-nvdisasm<14,>=13.4.0rc1; extra == "sass"'],
    "nvidia-cutlass-dsl-libs-core==4.8.0": [
        "typing-extensions>=4.10.0", "cuda-bindings>=12.8", 'backports.strenum; python_version < "3.11"',
        "protobuf>=4.21.12"],
    "nvidia-cutlass-dsl-libs-cu13==4.8.0": [
        "typing-extensions>=4.10.0", "cuda-bindings>=12.8", "protobuf>=4.21.12",
        "nvidia-cutlass-dsl-libs-base==4.8.0"],
}


def fake_release(version: str = "9.9.9", **changes) -> object:
    fields = {"version": version, "wheels": (("kdafake==0.1", "the test's import chain"),),
              "libraries": {"core": "vllm/_C_stable_libtorch.abi3.so", "moe": "vllm/_moe_C_stable_libtorch.abi3.so"},
              "evidence": "a test"}
    return bundle.ReleaseCarry(**{**fields, **changes})


def test_every_declared_release_names_its_artifacts_by_its_version():
    assert {"0.33.0", "0.34.0"} <= set(bundle.RELEASES) and bundle.DEFAULT_VERSION in bundle.RELEASES
    for version, release in bundle.RELEASES.items():
        assert release.version == version
        names = bundle.carry_artifacts(release, "3.12", ("core", "moe"), ray=True)
        assert names == [f"vllm-{version}-_C_stable_libtorch.abi3.so.xz",
                         f"vllm-{version}-_moe_C_stable_libtorch.abi3.so.xz", f"vllm-{version}-cp312.zip",
                         "ray-wheels-cp312.zip"]
        assert [harness.artifact_version(name) for name in names] == [version] * 3 + [None]
        assert [harness.library_file_of(name) for name in names[:2]] == [
            pathlib.PurePosixPath(release.libraries[key]).name for key in ("core", "moe")]
    # every declared library's artifact names where it lies under vllm/ (FlashAttention 3 in vllm_flash_attn/)
    for release in bundle.RELEASES.values():
        for member in release.libraries.values():
            artifact = bundle.library_artifact(member, release.version)
            assert "vllm/" + harness.library_file_of(artifact) == member, artifact
    assert bundle.RELEASES["0.34.0"].libraries["fa3"] == "vllm/" + harness.FA3_LIBRARY


def test_a_library_the_release_does_not_declare_is_refused():
    with pytest.raises(KeyError, match=r"declares no library \['moe'\]"):
        bundle.carry_artifacts(fake_release(libraries={"core": "vllm/_C.so"}), "3.12", ("core", "moe"), ray=False)


def test_the_command_line_offers_exactly_the_declared_releases(monkeypatch, tmp_path):
    with pytest.raises(SystemExit):
        bundle.main(["carry", "--vllm-version", "9.9.9", "--dest", str(tmp_path)])  # not declared
    seen = []
    monkeypatch.setitem(bundle.RELEASES, "9.9.9", fake_release())  # one declaration is all a release needs
    monkeypatch.setattr(bundle, "build", lambda dest, python_version, release: seen.append(release) or {
        "path": "x", "bundle_bytes": 0, "vllm_py_files": 0, "wheels": []})
    assert bundle.main(["build", "--vllm-version", "9.9.9", "--dest", str(tmp_path)]) == 0
    assert [release.version for release in seen] == ["9.9.9"]
    assert bundle.main(["build", "--dest", str(tmp_path)]) == 0
    assert seen[-1].version == bundle.DEFAULT_VERSION == "0.33.0"


def test_the_declared_pins_honour_the_release_s_own_requires_dist():
    assert bundle.unmet_pins(bundle.RELEASES["0.34.0"].wheels, REQUIRES_034, "3.12") == []
    wheels = dict(bundle.RELEASES["0.34.0"].wheels)
    for pin, requirement in (("xgrammar==0.2.7", "xgrammar==0.2.8"), ("fastapi==0.137.0", "fastapi<0.137.0,>=0.133.0"),
                             ("llguidance==1.8.1", "llguidance<1.8.0,>=1.7.0")):
        name = pin.split("==")[0]
        changed = tuple((pin if req.split("==")[0] == name else req, why) for req, why in wheels.items())
        assert bundle.unmet_pins(changed, REQUIRES_034, "3.12") == [f"{pin}: vLLM requires {requirement}"]
    # another platform's pin and an extra's are not the release's requirements here
    assert bundle.unmet_pins((("protobuf==6.0.0", ""), ("zentorch==1.0", "")), REQUIRES_034, "3.12") == []


def test_a_declaration_whose_pins_the_release_refuses_stops_before_any_download(tmp_path, monkeypatch):
    release = fake_release(wheels=(("kdafake==0.1", "test"),))
    (tmp_path / "vllm-9.9.9-requires-dist.json").write_text(json.dumps(["kdafake>=0.2"]))
    monkeypatch.setattr(bundle, "download_wheels", lambda *a: pytest.fail("downloaded despite an unmet pin"))
    with pytest.raises(RuntimeError, match=r"kdafake==0\.1: vLLM requires kdafake>=0\.2"):
        bundle.build(tmp_path, "3.12", release)


def fake_source(root: pathlib.Path, version: str) -> pathlib.Path:
    """A release cache entry of ``vllm==version``: one .py file and the fetcher's marker."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / ".kda-release.json").write_text(json.dumps({"version": version, "archive": f"vllm-{version}.whl",
                                                        "sha256": "0" * 64}))
    return root


def fake_wheels(folder: pathlib.Path, requirements) -> list[pathlib.Path]:
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for requirement, _ in requirements:
        name, _, version = requirement.partition("==")
        wheel = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{name}/__init__.py", "")
        wheels.append(wheel)
    return wheels


def test_the_bundle_holds_the_declared_release_and_its_wheels(tmp_path, monkeypatch):
    import kda_patches.releases.fetch as fetch

    release = fake_release(wheels=(("kdafake==0.1", "the chain"), ("kda-other==2.0", "kdafake")))
    monkeypatch.setattr(fetch, "release_dir", lambda dist, version: fake_source(tmp_path / "cache" / version, version))
    asked = []
    monkeypatch.setattr(bundle, "download_wheels", lambda dest, python_version, requirements: (
        asked.append(requirements) or fake_wheels(dest, requirements)))
    (tmp_path / "vllm-9.9.9-requires-dist.json").write_text(json.dumps(["kdafake==0.1"]))
    manifest = bundle.build(tmp_path, "3.12", release)
    assert asked == [release.wheels] and manifest["path"] == str(tmp_path / "vllm-9.9.9-cp312.zip")
    with zipfile.ZipFile(manifest["path"]) as archive:
        inside = json.loads(archive.read("manifest.json"))
        assert "Version: 9.9.9" in archive.read("site/vllm-9.9.9.dist-info/METADATA").decode()
    assert inside["vllm_version"] == "9.9.9"
    assert sorted(w["requirement"] for w in inside["wheels"]) == ["kda-other==2.0", "kdafake==0.1"]
    assert bundle.bundle_matches(pathlib.Path(manifest["path"]), release)
    assert not bundle.bundle_matches(pathlib.Path(manifest["path"]), fake_release(wheels=(("kdafake==0.2", ""),)))
    # a release cache entry of another version than the declaration
    with pytest.raises(RuntimeError, match=r"holds vLLM 9\.9\.9, the bundle is for 9\.9\.8"):
        bundle.write_bundle(tmp_path / "other.zip", tmp_path / "cache" / "9.9.9", [], "3.12", fake_release("9.9.8"))


def test_a_carry_is_one_declared_release_and_a_bundle_of_other_pins_is_rebuilt(tmp_path, monkeypatch):
    release = fake_release()
    built = []

    def build(dest, python_version, chosen):
        built.append(chosen.version)
        bundle.write_bundle(dest / bundle.bundle_name(python_version, chosen.version),
                            fake_source(dest / f"src-{len(built)}", chosen.version),
                            fake_wheels(dest / f"wheels-{len(built)}", chosen.wheels), python_version, chosen)

    def compress(dest, chosen, keys):
        for key in keys:
            name = bundle.library_artifact(chosen.libraries[key], chosen.version)
            (dest / name).write_bytes(lzma.compress(key.encode()))
            (dest / (name + ".sha256")).write_text(f"sha-of-{key}\n")

    monkeypatch.setattr(bundle, "build", build)
    monkeypatch.setattr(bundle, "compress_libraries", compress)
    monkeypatch.setattr(bundle, "tree_bytes", lambda: 0)
    manifest = bundle.carry(tmp_path, "3.12", ("core", "moe"), False, release)
    assert manifest["vllm_version"] == "9.9.9" and built == ["9.9.9"]
    assert list(manifest["artifacts"]) == bundle.carry_artifacts(release, "3.12", ("core", "moe"), False)
    assert manifest["artifacts"]["vllm-9.9.9-_moe_C_stable_libtorch.abi3.so.xz"]["unpacked_sha256"] == "sha-of-moe"
    state = harness.stage_pieces(tmp_path / "carry" / "run1", tmp_path / "stage")
    assert state["vllm_version"] == "9.9.9" and not state["missing"]
    bundle.carry(tmp_path, "3.12", ("core",), False, release)
    assert built == ["9.9.9"]  # the bundle holds what the declaration says: reused
    bundle.carry(tmp_path, "3.12", ("core",), False, fake_release(wheels=(("kdafake==0.2", "a new pin"),)))
    assert built == ["9.9.9", "9.9.9"]  # its pins changed: rebuilt


# ---------------------------------------------------------------- --with-flashinfer: an xz-compressed wheel set


def test_the_flashinfer_carry_is_declared_for_0_34_and_named_by_its_release():
    release = bundle.RELEASES["0.34.0"]
    names = bundle.carry_artifacts(release, "3.12", ("core", "flashkda"), ray=False, flashinfer=True)
    assert names[:-1] == bundle.carry_artifacts(release, "3.12", ("core", "flashkda"), ray=False)  # unchanged
    assert names[-1] == "vllm-0.34.0-flashinfer-wheels-cp312.tar.xz"
    assert harness.artifact_version(names[-1]) == "0.34.0" and harness.is_wheel_set(names[-1])
    assert dict(release.flashinfer.wheels).keys() >= {"flashinfer-python==0.7.4", "nvidia-cutlass-dsl==4.8.0"}
    with pytest.raises(KeyError, match=r"vLLM 0\.33\.0 declares no FlashInfer carry.*declared for: 0\.34\.0"):
        bundle.carry_artifacts(bundle.RELEASES["0.33.0"], "3.12", ("core",), ray=False, flashinfer=True)


def test_the_command_line_refuses_a_flashinfer_carry_the_release_does_not_declare(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bundle, "build", lambda *a: pytest.fail("built a bundle for an undeclared FlashInfer carry"))
    assert bundle.main(["carry", "--vllm-version", "0.33.0", "--with-flashinfer", "--dest", str(tmp_path)]) == 1
    assert "vLLM 0.33.0 declares no FlashInfer carry" in capsys.readouterr().err


def test_every_requirement_of_the_declared_flashinfer_set_is_accounted_for():
    release = bundle.RELEASES["0.34.0"]
    declared = release.flashinfer
    assert bundle.wheel_set_problems(declared, release, FLASHINFER_REQUIRES, REQUIRES_034, "3.12") == []
    assert {"nvidia-cutlass-dsl-libs-cu12", "nvidia-cudnn-frontend", "cuda-tile", "nccl4py"} <= set(declared.left_out)

    def problems(carried=declared, requires=FLASHINFER_REQUIRES, chosen=release):
        return bundle.wheel_set_problems(carried, chosen, requires, REQUIRES_034, "3.12")

    # each rule alone: the release's own pin, a stale exception, an unaccounted requirement, a refused pin
    assert problems(dataclasses.replace(declared, release_pin_exceptions={})) == [
        "flashinfer-python==0.7.4: vLLM requires flashinfer-python==0.7.3: declare why in release_pin_exceptions or "
        "carry the release's pin"]
    stale = {**declared.release_pin_exceptions, "nvidia-cutlass-dsl": "no reason"}
    assert problems(dataclasses.replace(declared, release_pin_exceptions=stale)) == [
        "nvidia-cutlass-dsl: a release_pin_exception is declared, but vLLM 0.34.0 allows the carried pin"]
    requires = {**FLASHINFER_REQUIRES, "flashinfer-python==0.7.4": [
        *FLASHINFER_REQUIRES["flashinfer-python==0.7.4"], "kdanewdep>=1"]}
    assert problems(requires=requires) == ["flashinfer-python==0.7.4 requires kdanewdep>=1: not carried, not in the "
                                           "bundle, and not declared provided or left out"]
    left_out = {k: v for k, v in declared.left_out.items() if k != "nccl4py"}
    assert problems(dataclasses.replace(declared, left_out=left_out)) == [
        "flashinfer-python==0.7.4 requires nccl4py>=0.4.1: not carried, not in the bundle, and not declared "
        "provided or left out"]
    newer_base = tuple(("nvidia-cutlass-dsl-libs-base==4.8.1", why) if req.startswith("nvidia-cutlass-dsl-libs-base")
                       else (req, why) for req, why in declared.wheels)
    assert problems(dataclasses.replace(declared, wheels=newer_base), requires={
        "nvidia-cutlass-dsl==4.8.0": FLASHINFER_REQUIRES["nvidia-cutlass-dsl==4.8.0"]}) == [
        "nvidia-cutlass-dsl-libs-base==4.8.1: nvidia-cutlass-dsl==4.8.0 requires "
        "nvidia-cutlass-dsl-libs-base==4.8.0"]
    other_tvm = dataclasses.replace(release, wheels=tuple(("apache-tvm-ffi==0.2.0", why) if req.startswith(
        "apache-tvm-ffi") else (req, why) for req, why in release.wheels))
    assert problems(chosen=other_tvm, requires={"flashinfer-python==0.7.4": ["apache-tvm-ffi<0.2,>=0.1.11"]}) == [
        "apache-tvm-ffi==0.2.0: flashinfer-python==0.7.4 requires apache-tvm-ffi<0.2,>=0.1.11"]


def record_wheel(folder: pathlib.Path, name: str, version: str, files: dict[str, str],
                 requires: tuple[str, ...] = ()) -> pathlib.Path:
    """A real (deflated) wheel with METADATA, WHEEL and a RECORD of every file, as the registry's are."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    members = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
               + "".join(f"Requires-Dist: {line}\n" for line in requires),
               f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    rows = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
            f"{len(text.encode())}" for path, text in members.items()]
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path, text in members.items():
            archive.writestr(path, text)
        archive.writestr(f"{info}/RECORD", "\n".join([*rows, f"{info}/RECORD,,"]) + "\n")
    return wheel


def test_a_wheel_repacked_uncompressed_keeps_every_file_its_record_lists(tmp_path):
    wheel = record_wheel(tmp_path / "registry", "kdafake", "0.1", {"kdafake/__init__.py": "VALUE = 1\n" * 50})
    stored = tmp_path / wheel.name
    bundle.repack_stored(wheel, stored)
    assert bundle.record_mismatches(wheel) == bundle.record_mismatches(stored) == []
    with zipfile.ZipFile(wheel) as original, zipfile.ZipFile(stored) as repacked:
        assert [(i.filename, i.date_time, i.external_attr) for i in original.infolist()] == [
            (i.filename, i.date_time, i.external_attr) for i in repacked.infolist()]
        assert all(original.read(i) == repacked.read(i.filename) for i in original.infolist())
        assert {i.compress_type for i in repacked.infolist()} == {zipfile.ZIP_STORED}
    lying = tmp_path / "lying" / wheel.name
    lying.parent.mkdir()
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(lying, "w") as out:
        for info in source.infolist():
            out.writestr(info.filename, source.read(info) if info.filename != "kdafake/__init__.py" else b"X = 2\n")
    assert bundle.record_mismatches(lying) == ["kdafake/__init__.py"]


DSL_PTH = "import sys, os, kdafakedsl; sys.path.insert(0, os.path.join(kdafakedsl.__path__[0], 'dsl_packages'))\n"


def fake_flashinfer_release() -> object:
    carried = bundle.WheelSetCarry(
        name="flashinfer", wheels=(("kdafakefi==0.1", "the GDN prefill"), ("kdafakedsl==0.2", "its DSL kernels")),
        release_pin_exceptions={}, provided={"kdaimage": "the image"}, left_out={"kdaskipped": "not on the path"},
        evidence="a test")
    return fake_release(flashinfer=carried)


def fake_flashinfer_wheels(dest: pathlib.Path, python_version: str, requirements) -> list[pathlib.Path]:
    """The registry's wheels of :func:`fake_flashinfer_release`: the DSL's ``kdainner`` package lies in a folder
    only its ``.pth`` file puts on the path, as nvidia-cutlass-dsl's ``cutlass`` does."""
    assert [r for r, _ in requirements] == ["kdafakefi==0.1", "kdafakedsl==0.2"]
    return [record_wheel(dest, "kdafakefi", "0.1", {"kdafakefi/__init__.py": "VALUE = 1\n"},
                         ("kdafakedsl>=0.2", "kdaimage", 'kdaskipped; extra == "x"', "kdaskipped")),
            record_wheel(dest, "kdafakedsl", "0.2", {"kdafakedsl/__init__.py": "", "kdafakedsl.pth": DSL_PTH,
                                                     "kdafakedsl/dsl_packages/kdainner/__init__.py": "INNER = 2\n"})]


def test_the_flashinfer_set_is_carried_staged_installed_and_its_pth_processed(tmp_path, monkeypatch):
    release = fake_flashinfer_release()
    monkeypatch.setattr(bundle, "build", lambda dest, python_version, chosen: bundle.write_bundle(
        dest / bundle.bundle_name(python_version, chosen.version), fake_source(dest / "src", chosen.version),
        [record_wheel(dest / "bundle-wheels", "kdafake", "0.1", {"kdafake/__init__.py": ""})], python_version, chosen))
    monkeypatch.setattr(bundle, "compress_libraries", lambda dest, chosen, keys: [
        ((dest / (name := bundle.library_artifact(chosen.libraries[key], chosen.version))).write_bytes(
            lzma.compress(key.encode())), (dest / (name + ".sha256")).write_text(
            hashlib.sha256(key.encode()).hexdigest())) for key in keys])
    monkeypatch.setattr(bundle, "tree_bytes", lambda: 0)
    downloads = []
    monkeypatch.setattr(bundle, "download_wheels", lambda dest, python_version, requirements: (
        downloads.append(requirements), fake_flashinfer_wheels(dest, python_version, requirements))[1])
    (tmp_path / "vllm-9.9.9-requires-dist.json").write_text(json.dumps(["kdafakefi>=0.1"]))
    manifest = bundle.carry(tmp_path, "3.12", ("core",), False, release, flashinfer=True)
    name = "vllm-9.9.9-flashinfer-wheels-cp312.tar.xz"
    assert list(manifest["artifacts"])[-1] == name and manifest["vllm_version"] == "9.9.9"
    with tarfile.open(tmp_path / name, "r:xz") as archive:
        inside = json.loads(archive.extractfile("manifest.json").read())
    assert [w["requirement"] for w in inside["wheels"]] == ["kdafakefi==0.1", "kdafakedsl==0.2"]
    assert inside["left_out"] == {"kdaskipped": "not on the path"} and inside["vllm_version"] == "9.9.9"
    bundle.carry(tmp_path, "3.12", ("core",), False, release, flashinfer=True)
    assert len(downloads) == 1  # the set holds what the declaration says: reused
    stage, site = tmp_path / "stage", tmp_path / "site"
    for run in sorted((tmp_path / "carry").glob("run*")):
        harness.stage_pieces(run, stage)
    prepared = harness.prepare_site(None, site, stage)
    installed = next(s for s in prepared["wheel_sets"] if s["set"] == name)
    assert installed["pth"] == ["kdafakedsl.pth"] and set(installed["registry_sha256"]) == {
        "kdafakefi-0.1-py3-none-any.whl", "kdafakedsl-0.2-py3-none-any.whl"}
    assert (site / "kdafakefi" / "__init__.py").is_file() and (site / "kdafakedsl.pth").is_file()
    # a process that gets the site through PYTHONPATH sees the .pth's folder only once the hook activates it
    probe = ("import sys; sys.path.insert(0, {scripts!r}); import gpu_harness; {activate}"
             "import importlib.util; print(importlib.util.find_spec('kdainner') is not None)")
    for activate, expected in (("", "False"), ("gpu_harness.install_stand_ins(); ", "True")):
        done = subprocess.run([sys.executable, "-c", probe.format(scripts=str(harness.__file__).rsplit("/", 1)[0],
                                                                  activate=activate)],
                              env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
        assert done.stdout.strip() == expected, done.stderr


def test_a_flashinfer_wheel_that_cannot_be_fetched_is_named_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    release = fake_flashinfer_release()
    (tmp_path / "vllm-9.9.9-requires-dist.json").write_text(json.dumps([]))
    real_run = subprocess.run

    def pip(argv, **kwargs):
        if "kdafakedsl==0.2" in argv:
            return subprocess.CompletedProcess(argv, 1, "", "ERROR: No matching distribution found for kdafakedsl==0.2")
        if "kdafakefi==0.1" in argv:
            record_wheel(pathlib.Path(argv[argv.index("-d") + 1]), "kdafakefi", "0.1", {"kdafakefi/__init__.py": ""})
            return subprocess.CompletedProcess(argv, 0, "", "")
        return real_run(argv, **kwargs)

    monkeypatch.setattr(bundle.subprocess, "run", pip)
    with pytest.raises(RuntimeError, match=r"cannot fetch the flashinfer carry of vLLM 9\.9\.9 \(vllm-9\.9\.9-"
                       r"flashinfer-wheels-cp312\.tar\.xz\); nothing was written: pip download kdafakedsl==0\.2 (?s:.)*"
                       r"No matching"):
        bundle.build_compressed_wheel_set(tmp_path, release, release.flashinfer, "3.12")
    assert not list(tmp_path.glob("*.tar.xz*"))
    monkeypatch.setitem(bundle.RELEASES, "9.9.9", release)
    monkeypatch.setattr(bundle, "bundle_matches", lambda *a: True)
    monkeypatch.setattr(bundle, "compress_libraries", lambda *a: None)
    for key in ("", ".sha256"):
        (tmp_path / (bundle.library_artifact(release.libraries["core"], "9.9.9") + key)).write_text("0")
    assert bundle.main(["carry", "--vllm-version", "9.9.9", "--with-flashinfer", "--dest", str(tmp_path)]) == 1
    assert "carry: cannot fetch the flashinfer carry of vLLM 9.9.9" in capsys.readouterr().err
