"""``kv_cache_layout`` on vllm-ascend 0.26-0.30: a read-only verifier that refuses an overlapping layout (issue 53.2).

The release cases run the fork's RELEASED config, spec, planner, allocation and reshape code from the release cache
on the meta device (:class:`~kda_patches.kv_layout.ascend_stack.AscendStack`), with the runner's
``_reshape_kv_cache_tensors`` wrapped by the wrapper the ``kv_cache_layout`` record selects for that release (its
fingerprint read from the release file): the verifier sees exactly the views the fork builds at startup. Each rule
of :mod:`kda_patches.kv_layout.ascend_verify` is then decided alone: an overlap refuses (Kimi K3 on 0.30), a proven
layout of the same release (Qwen3-Next on 0.30) and of the same model (Kimi K3 on 0.29.0rc1 + vLLM 0.29.0) passes
untouched; out of storage refuses; not checkable warns, and refuses under STRICT; the verdict, not the release,
decides (synthetic views). Status and effects say "upstream layout proven" with what was checked.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import wrapt

from kda_patches import registry, static_check
from kda_patches.effects import IN_EFFECT, judge_effect
from kda_patches.kv_layout import ascend_models, ascend_proof, ascend_verify
from kda_patches.kv_layout.ascend_engine import engine_environment
from kda_patches.kv_layout.ascend_stack import AscendStack
from kda_patches.kv_layout.ascend_verify import NOT_PROVEN, PROVEN, LayoutRefused, action_for, verify
from kda_patches.kv_layout.checker import Footprint
from kda_patches.ledger import get_ledger
from kda_patches.patches import kv_cache_layout
from kda_patches.releases.fetch import release_dir

KEY = "vllm_ascend.worker.model_runner_v1:NPUModelRunner._reshape_kv_cache_tensors"
K3_ATTENTION = "language_model.model.layers.3.self_attn.attn"
K3_FIRST_KDA = "language_model.model.layers.0.self_attn"


def selected(fork: str) -> registry.Target:
    """The sibling the record applies on ``fork``; its fingerprint must match the release's own signature."""
    target = registry.select_target(kv_cache_layout.PATCH, KEY, fork)
    assert target is not None, f"no {KEY} target for vllm-ascend {fork}"
    path = release_dir("vllm-ascend", fork) / "vllm_ascend/worker/model_runner_v1.py"
    parameters = static_check.read_parameters(path, "NPUModelRunner._reshape_kv_cache_tensors")
    verdict = registry.check_key(kv_cache_layout.PATCH, KEY, fork, parameters)
    assert verdict.ok, (verdict, path)
    return target


def verified_stack(fork: str, vllm: str) -> AscendStack:
    """The release pairing, its runner's reshape wrapped by the record's selected wrapper."""
    wrapper = selected(fork).wrapper

    def runner_class(release_class: type) -> type:
        patched = type("VerifiedNPUModelRunner", (release_class,), {})
        wrapt.wrap_function_wrapper(patched, "_reshape_kv_cache_tensors", wrapper)
        return patched

    return AscendStack(fork, vllm, runner_class=runner_class)


@pytest.fixture(scope="module")
def stack030() -> AscendStack:
    return verified_stack("0.30.0rc2", "0.30.0")


@pytest.fixture
def release_named(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The installed-release probe answers for the pairing under test (this environment has no vllm-ascend)."""
    def name(fork: str, vllm: str) -> None:
        monkeypatch.setattr(kv_cache_layout, "_installed_release", lambda: f"vllm-ascend {fork} + vLLM {vllm}")
    return name


def run(stack: AscendStack, model: str, tp: int = 8) -> tuple[Any, Any, dict[str, Any]]:
    logging.disable(logging.WARNING)
    try:
        with engine_environment():
            return stack.run(ascend_models.MODELS[model], tp)
    finally:
        logging.disable(logging.NOTSET)


def fact() -> dict[str, Any]:
    return get_ledger().snapshot()["facts"]["kv_cache_layout"]["ascend_layout"]


@pytest.mark.parametrize("fork", ascend_proof.ASCEND_RELEASES)
def test_every_fork_release_gets_the_verifier_with_its_own_fingerprint(fork: str) -> None:
    assert selected(fork).wrapper is kv_cache_layout.wrap_ascend_reshape_kv_cache_tensors


def test_overlap_refuses_to_start_kimi_k3_on_030_naming_witness_and_fix(stack030: AscendStack,
                                                                        release_named: Any) -> None:
    release_named("0.30.0rc2", "0.30.0")
    with pytest.raises(LayoutRefused) as refused:
        run(stack030, "Kimi K3")
    message = str(refused.value)
    assert "refusing to start KimiK3ForConditionalGeneration on vllm-ascend 0.30.0rc2 + vLLM 0.30.0" in message
    assert f"`{K3_ATTENTION}` k block" in message and f"`{K3_FIRST_KDA}` state0 block" in message
    assert "share byte" in message and "bytes per block id" in message
    assert "Checked: 186 views of 93 layers on 1 storage(s), block ids 0-63" in message
    assert "Fix: serve this model with a vllm-ascend release" in message and "0.29.0rc1" in message
    assert fact()["status"] == "refused: overlap found" and fact()["verdict"] == "overlap found"


def test_proven_layout_of_the_same_release_is_verified_and_left_untouched(stack030: AscendStack,
                                                                          release_named: Any) -> None:
    release_named("0.30.0rc2", "0.30.0")
    _, config, views = run(stack030, "Qwen3-Next-80B")  # run() checks the bound views are the ones returned
    recorded = fact()
    assert recorded["status"] == PROVEN and recorded["verdict"] == "proven"
    assert recorded["checked"] == "96 views of 48 layers on 1 storage(s), block ids 0-63, by the aliasing checker"
    assert recorded["state_views"] == 72 and recorded["state_views_page_strided"] == 72  # 0.30: stride(0) = page
    assert len(views) == 48 and config.num_blocks == 64


def test_proven_layout_of_the_same_model_on_029_is_verified(release_named: Any) -> None:
    release_named("0.29.0rc1", "0.29.0")
    run(verified_stack("0.29.0rc1", "0.29.0"), "Kimi K3")
    assert fact()["status"] == PROVEN and fact()["state_views_page_strided"] == 0  # 0.26-0.29: dense state views


# -- each rule alone, on synthetic fork-shaped views -------------------------------------------------------------

PAGE, BLOCKS = 64, 8


def config(*groups: list[str]) -> SimpleNamespace:
    return SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[SimpleNamespace(layer_names=g) for g in groups])


def pages(raw: torch.Tensor, start: int, width: int) -> torch.Tensor:
    return raw.view(BLOCKS, PAGE)[:, start:start + width]


def aligned() -> dict[str, Any]:
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    return {"attn": (pages(raw, 0, 32), pages(raw, 32, 32)), "gdn": [pages(raw, 0, 16), pages(raw, 16, 40)]}


@pytest.mark.parametrize(("verdict", "strict", "action"), [
    ("proven", False, "verified"), ("proven", True, "verified"),
    ("overlap found", False, "refuse"), ("out of storage", False, "refuse"),
    ("not checkable", False, "warn"), ("not checkable", True, "refuse")])
def test_action_of_each_verdict(verdict: str, strict: bool, action: str) -> None:
    assert action_for(verdict, strict) == action


def test_the_verdict_decides_not_the_release() -> None:
    """The same 0.30 release name with aligned pages passes; with a dense slab over the pages it refuses."""
    recorded = verify(config(["attn"], ["gdn"]), aligned(), "vllm-ascend 0.30.0rc2 + vLLM 0.30.0", "M", False)
    assert recorded["status"] == PROVEN
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    slab = {"mla": (raw[:BLOCKS * 48].view(BLOCKS, 48), raw[BLOCKS * 48:].view(BLOCKS, 16)),
            "kda": [pages(raw, 0, 16), pages(raw, 16, 40)]}
    with pytest.raises(LayoutRefused, match="lets two requests' cache bytes collide"):
        verify(config(["mla"], ["kda"]), slab, "vllm-ascend 0.26.0rc1 + vLLM 0.26.0", "M", False)


def test_a_view_out_of_its_storage_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch builds no view past its storage's end, so the described footprints stand in for one that would."""
    past_the_end = Footprint("gdn", "state0", 0, base=PAGE * (BLOCKS - 1), stride=PAGE, num_blocks=2, runs=((0, 16),))
    monkeypatch.setattr(ascend_verify, "describe_views", lambda *_: {"storage": (BLOCKS * PAGE, [past_the_end])})
    with pytest.raises(LayoutRefused, match=r"out of storage: .* outside the storage"):
        verify(config(["attn"], ["gdn"]), aligned(), "R", "M", False)


def test_not_checkable_keeps_the_layout_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    raw = torch.zeros(BLOCKS * PAGE + PAGE, dtype=torch.int8)
    odd = {"attn": (raw.view(BLOCKS + 1, PAGE), raw.view(BLOCKS + 1, PAGE))}  # 9 rows for 8 blocks
    with caplog.at_level(logging.WARNING, logger="kda_patches"):
        recorded = verify(config(["attn"]), odd, "R", "M", strict=False)
    assert recorded["status"] == NOT_PROVEN and recorded["detail"].startswith("views: ValueError")
    assert "upstream layout not proven for M on R" in caplog.text


def test_not_checkable_refuses_under_strict() -> None:
    raw = torch.zeros(BLOCKS * PAGE + PAGE, dtype=torch.int8)
    odd = {"attn": (raw.view(BLOCKS + 1, PAGE), raw.view(BLOCKS + 1, PAGE))}
    with pytest.raises(LayoutRefused, match=r"KDA_PATCHES_STRICT=1 refuses an unproven layout"):
        verify(config(["attn"]), odd, "R", "M", strict=True)


def test_layers_outside_the_groups_are_listed_not_checked() -> None:
    views = {**aligned(), "shared": (torch.zeros(3), torch.zeros(3))}  # e.g. a cross-layer shared cache
    recorded = verify(config(["attn"], ["gdn"]), views, "R", "M", False)
    assert recorded["status"] == PROVEN and recorded["layers_outside_groups"] == ["shared"]


def test_status_and_effect_say_upstream_layout_proven() -> None:
    verify(config(["attn"], ["gdn"]), aligned(), "vllm-ascend 0.29.0rc1 + vLLM 0.29.0", "Arch", False)
    snapshot = get_ledger().snapshot()
    line = kv_cache_layout.format_status_line(snapshot)
    assert line.startswith("kv_cache_layout: upstream layout proven on vllm-ascend 0.29.0rc1 + vLLM 0.29.0 for Arch")
    assert "4 views of 2 layers on 1 storage(s), block ids 0-7, by the aliasing checker" in line
    assert "2 of 2 state views page-strided" in line and "kda-patches doctor" in line
    snapshot["patches"] = {"kv_cache_layout": {"state": "applied", "reason": "", "targets": {}}}
    assert judge_effect("kv_cache_layout", [snapshot]) == (IN_EFFECT, "verify mode: upstream-proven 2")
