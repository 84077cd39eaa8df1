"""The runners' ``initialize_kv_cache`` fingerprints against every release the matrix reads, and the hook on them.

vLLM 0.29 gave both ``GPUModelRunner.initialize_kv_cache`` a ``kv_cache_allocation_context`` inside the
0.27-0.29 era of the state-copy records, which had taken the new signature from 0.30: on a vLLM 0.29 install both
records would have been skipped (drift), and under STRICT the engine would not start. No test saw it, because
the support matrix read no vLLM 0.29 stack (vllm-ascend 0.29.0rc1 was paired with vLLM 0.28.0, and vLLM 0.29.0
was not in the list). Here: the signature tables of :mod:`kda_patches.routing.eras` and every record's declared
runner fingerprint equal the release's own (read with ``ast`` from the registry's files), the matrix reads one
release of every vLLM minor, and the startup hook, registered with the record's fingerprint, runs on a runner of
the release's signature and passes ``kv_cache_allocation_context`` through as given.
"""

from __future__ import annotations

import importlib
import re
import sys
import uuid

import pytest

from kda_patches import registry
from kda_patches.ledger import get_ledger
from kda_patches.patches import gdn_state_copy, kimi_prefill
from kda_patches.releases.fetch import release_dir
from kda_patches.releases.matrix import CONTIGUOUS_FROM, DEFAULT_ASCEND, DEFAULT_VLLM, PAIRED_VLLM
from kda_patches.releases.source import ReleaseSource
from kda_patches.routing import eras

RECORDS = (kimi_prefill.PATCH, gdn_state_copy.PATCH)
UPSTREAM = [(version, module) for version in DEFAULT_VLLM if registry.parse_version(version) >= (0, 26)
            for module in eras.UPSTREAM_RUNNER_SIGNATURES]
ASCEND = [(version, module) for version in DEFAULT_ASCEND for module in eras.NPU_RUNNER_MODULES]


def runner_id(module: str) -> str:
    return "v1" if module == eras.V1_RUNNER_MODULE else "v2"


def in_span(version: str, first: str | None, last: str | None) -> bool:
    found = registry.parse_version(version)
    return (first is None or found >= registry.parse_version(first)) and (
        last is None or found < registry.parse_version(last))


def expected(version: str, signatures) -> tuple[str, ...] | None:
    held = [parameters for first, last, parameters in signatures if in_span(version, first, last)]
    assert len(held) <= 1, (version, held)  # the spans of one runner are disjoint
    return held[0] if held else None


def released(dist: str, version: str, module: str, cls: str) -> tuple[str, ...] | None:
    return ReleaseSource(release_dir(dist, version)).parameters(module, f"{cls}.initialize_kv_cache")


@pytest.mark.parametrize(("version", "module"), UPSTREAM, ids=[f"{v}-{runner_id(m)}" for v, m in UPSTREAM])
def test_upstream_signature_table_is_the_releases(version: str, module: str) -> None:
    # None on both sides: the release does not ship this runner (0.34's V1) and no span claims it does
    assert released("vllm", version, module, "GPUModelRunner") == expected(
        version, eras.UPSTREAM_RUNNER_SIGNATURES[module])


@pytest.mark.parametrize(("version", "module"), ASCEND, ids=[f"{v}-{m.rsplit('.', 1)[-1]}" for v, m in ASCEND])
def test_ascend_signature_table_is_the_releases(version: str, module: str) -> None:
    assert released("vllm-ascend", version, module, "NPUModelRunner") == expected(
        version, eras.ASCEND_RUNNER_SIGNATURES)


def runner_keys(patch: registry.Patch) -> list[str]:
    return [key for key in patch.keys() if key.endswith("Runner.initialize_kv_cache")]


@pytest.mark.parametrize("patch", RECORDS, ids=lambda patch: patch.name)
def test_every_declared_runner_fingerprint_is_the_releases(patch: registry.Patch) -> None:
    """Each record's sibling in range on each matrix release declares that release's parameters exactly."""
    stacks = [("vllm", v) for v in DEFAULT_VLLM] + [("vllm-ascend", v) for v in DEFAULT_ASCEND]
    checked = []
    for key in runner_keys(patch):
        module, _, qualname = key.partition(":")
        dist = "vllm-ascend" if module.startswith("vllm_ascend.") else "vllm"
        for stack_dist, version in stacks:
            target = registry.select_target(patch, key, version)
            if stack_dist != dist or target is None or target.parameters is None:
                continue
            found = ReleaseSource(release_dir(dist, version)).parameters(module, qualname)
            assert found == target.parameters, f"{patch.name} {key} on {dist} {version}: declared " \
                                               f"{target.parameters}, the release has {found}"
            checked.append((key, version))
    assert ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache", "0.29.0") in checked
    assert ("vllm_ascend.worker.model_runner_v1:NPUModelRunner.initialize_kv_cache", "0.29.0rc1") in checked


def test_matrix_reads_one_release_of_every_vllm_minor() -> None:
    """The rule of DEFAULT_VLLM alone: from CONTIGUOUS_FROM to the newest listed, no minor is missing."""
    minors = sorted({registry.parse_version(v)[:2] for v in DEFAULT_VLLM
                     if registry.parse_version(v) >= registry.parse_version(CONTIGUOUS_FROM)})
    first, last = minors[0][1], minors[-1][1]
    assert minors == [(0, minor) for minor in range(first, last + 1)], DEFAULT_VLLM


def test_each_fork_release_is_read_with_the_vllm_its_sources_target() -> None:
    """The paired vLLM is no older than the newest vLLM a fork release's version gates name (gates keep older
    vLLMs working; 0.29.0rc1 names 0.29.0, as its sdist's Dockerfile and release tag do) and no newer than the
    fork's own minor; each pairing's vLLM is also read alone."""
    for fork, vllm in PAIRED_VLLM.items():
        text = "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in
                         (release_dir("vllm-ascend", fork) / "vllm_ascend").rglob("*.py"))
        gated = [registry.parse_version(v) for v in re.findall(r"vllm_version_is\(['\"]([0-9.]+)['\"]\)", text)]
        paired = registry.parse_version(vllm)
        assert gated and max(gated) <= paired, (fork, vllm, max(gated))
        assert paired[:2] <= registry.parse_version(fork)[:2], (fork, vllm)
        assert vllm in DEFAULT_VLLM, (fork, vllm)


HOOKED = ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context", "extensible")


def runner_module(tmp_path, monkeypatch, parameters: tuple[str, ...]) -> str:
    """A module whose ``Runner.initialize_kv_cache`` has exactly ``parameters`` and records what it received."""
    name = f"runner_{uuid.uuid4().hex[:10]}"
    defaults = ", ".join(p if p in ("self", "kv_cache_config") else f"{p}=None" for p in parameters)
    received = ", ".join(f"{p!r}: {p}" for p in parameters[1:])
    (tmp_path / f"{name}.py").write_text(f"class Runner:\n    def initialize_kv_cache({defaults}):\n"
                                         f"        self.received = {{{received}}}\n        return 'bound'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


CASES = [(record, module, version) for record in ("kimi_prefill", "gdn_state_copy")
         for module in eras.UPSTREAM_RUNNER_SIGNATURES for version in ("0.29.0", "0.30.0")]


@pytest.mark.parametrize(("record", "module", "version"), CASES,
                         ids=[f"{r}-{runner_id(m)}-{v}" for r, m, v in CASES])
def test_startup_hook_applies_and_passes_the_allocation_context_through(tmp_path, monkeypatch, record: str,
                                                                        module: str, version: str) -> None:
    """The record's declared fingerprint on the release's runner signature: wrapped under STRICT, and the
    context manager the worker passes reaches the runner as the same object, positionally or by keyword."""
    source = {"kimi_prefill": kimi_prefill, "gdn_state_copy": gdn_state_copy}[record]
    declared = registry.select_target(source.PATCH, f"{module}:GPUModelRunner.initialize_kv_cache", version)
    parameters = released("vllm", version, module, "GPUModelRunner")
    assert declared is not None and parameters == declared.parameters
    assert set(parameters) <= set(HOOKED) and "kv_cache_allocation_context" in parameters
    name = runner_module(tmp_path, monkeypatch, parameters)
    patch = source.build_patch(name=f"t_{uuid.uuid4().hex[:8]}", runners=((name, "Runner", declared.parameters),),
                               **({"seams": ()} if record == "gdn_state_copy" else {}))
    registry.register_patch(patch, strict=True)
    try:
        runner_class = importlib.import_module(name).Runner
        assert registry.is_applied(patch, patch.targets[0])
        context = object()
        runner = runner_class()
        assert runner.initialize_kv_cache({}, False, context) == "bound"
        assert runner.received["kv_cache_allocation_context"] is context
        assert runner.received["is_profiling"] is False
        runner = runner_class()
        assert runner.initialize_kv_cache({}, kv_cache_allocation_context=context) == "bound"
        assert runner.received["kv_cache_allocation_context"] is context
        assert get_ledger().snapshot()["facts"][record]["startup"] == {"ok": True, "layers": 0}
    finally:
        registry.revert_patch(patch)
        sys.modules.pop(name, None)
