"""``scripts/gpu/vllm_bundle.py`` on the CPU, without the registry: the per-release declarations (``RELEASES``)
drive every artifact's name, the wheels a bundle holds, the libraries a carry takes, and the pins checked against the
release's own ``Requires-Dist``; adding a release is a declaration.
"""

from __future__ import annotations

import json
import lzma
import pathlib
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
]


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
