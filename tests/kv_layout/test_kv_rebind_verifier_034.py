"""``kv_cache_layout`` on vLLM 0.34: a read-only verifier after ``extend_kv_cache`` (issue 53.3).

The release cases run vLLM 0.34.0's RELEASED config, spec, planner, extensible allocation and ``extend_kv_cache``
code from the release cache on the CPU (:class:`~kda_patches.kv_layout.upstream034_stack.Upstream034Stack`, one
stack for the file), with ``extend_kv_cache`` called through the wrapper the ``kv_cache_layout`` record selects
for 0.34 (its fingerprint read from the release file): the verifier sees exactly the views the release rebinds.
Proven layouts (Qwen3-Next and Kimi K3 at TP 8) pass untouched with status "upstream layout proven"; a rebind that
binds one layer to another layer's bytes of the same group (fault injected after the release's rebind) refuses,
naming the witness. Each rule of :mod:`kda_patches.kv_layout.rebind_verify` and of
:func:`~kda_patches.kv_layout.upstream034_proof.describe_address_spaces` is then decided alone on synthetic views.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kda_patches import registry, static_check
from kda_patches.effects import IN_EFFECT, judge_effect
from kda_patches.kv_layout import ascend_models, upstream034_proof
from kda_patches.kv_layout.ascend_engine import engine_environment
from kda_patches.kv_layout.ascend_verify import NOT_PROVEN, PROVEN, LayoutRefused
from kda_patches.kv_layout.rebind_verify import bound_views, verify_rebind
from kda_patches.kv_layout.upstream034_stack import FINAL_BLOCKS, Upstream034Stack
from kda_patches.ledger import get_ledger
from kda_patches.patches import kv_cache_layout
from kda_patches.releases.fetch import release_dir

KEY = "vllm.v1.worker.extensible_kv_cache:extend_kv_cache"


def selected() -> registry.Target:
    """The 0.34 target of the record; its fingerprint must match the release's own signature."""
    target = registry.select_target(kv_cache_layout.PATCH, KEY, "0.34.0")
    assert target is not None
    parameters = static_check.read_parameters(release_dir("vllm", "0.34.0") / "vllm/v1/worker/extensible_kv_cache.py",
                                              "extend_kv_cache")
    assert parameters == kv_cache_layout.EXTEND_PARAMETERS
    assert registry.check_key(kv_cache_layout.PATCH, KEY, "0.34.0", parameters).ok
    assert registry.select_target(kv_cache_layout.PATCH, KEY, "0.33.0") is None
    return target


class Fault:
    """What the test's stand-in ``extend_kv_cache`` does after the release's rebind (nothing, by default)."""

    after: Any = None


@pytest.fixture(scope="module")
def stack() -> Any:
    wrapper = selected().wrapper
    assert wrapper is kv_cache_layout.wrap_extend_kv_cache

    def extend_wrapper(extend: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        def release_then_fault(*call_args: Any, **call_kwargs: Any) -> Any:
            result = extend(*call_args, **call_kwargs)
            if Fault.after is not None:
                Fault.after(call_args[0])
            return result
        return wrapper(release_then_fault, instance, args, kwargs)

    built = Upstream034Stack(extend_wrapper=extend_wrapper)
    yield built
    built.close()


def run(stack: Any, model: str, tp: int = 8) -> Any:
    logging.disable(logging.WARNING)
    try:
        with engine_environment():
            return stack.run(ascend_models.MODELS[model], tp)
    finally:
        logging.disable(logging.NOTSET)


def fact() -> dict[str, Any]:
    return get_ledger().snapshot()["facts"]["kv_cache_layout"]["upstream_layout"]


@pytest.mark.parametrize(("model", "views", "layers", "spaces"), [
    ("Qwen3-Next-80B", 84, 48, 12), ("Kimi K3", 162, 93, 24)])
def test_released_rebind_is_verified_and_left_untouched(stack: Any, model: str, views: int, layers: int,
                                                        spaces: int) -> None:
    Fault.after = None
    seen = {}

    def remember(runner: Any) -> None:  # the views the release bound, before the verifier looked at them
        seen.update({name: layer.kv_cache for name, layer in runner.compilation_config.static_forward_context.items()})

    Fault.after = remember
    try:
        result = run(stack, model)
    finally:
        Fault.after = None
    recorded = fact()
    assert recorded["status"] == PROVEN and recorded["verdict"] == "proven", recorded
    assert recorded["checked"] == (f"{views} views of {layers} layers in {spaces} address space(s) after "
                                   f"extend_kv_cache, block ids 0-{FINAL_BLOCKS - 1}, by the aliasing checker")
    context = stack.runner.compilation_config.static_forward_context
    assert all(context[name].kv_cache is bound for name, bound in seen.items())  # read-only: the same objects
    assert result.config_after.num_blocks == FINAL_BLOCKS
    snapshot = get_ledger().snapshot()
    # a vllm-ascend verifier test run earlier in this process (one xdist worker runs many files) leaves its own fact,
    # which a real process (one stack) never has beside this one
    snapshot["facts"]["kv_cache_layout"].pop("ascend_layout", None)
    line = kv_cache_layout.format_status_line(snapshot)
    assert line.startswith("kv_cache_layout: upstream layout proven on vLLM ") and "after extend_kv_cache" in line
    snapshot["patches"] = {"kv_cache_layout": {"state": "applied", "reason": "", "targets": {}}}
    assert judge_effect("kv_cache_layout", [snapshot]) == (IN_EFFECT, f"verify mode: upstream-proven {layers}")


def test_a_rebind_that_overlaps_refuses_naming_the_witness(stack: Any) -> None:
    """After the release's rebind, one KDA layer is bound to another same-group layer's committed view."""
    def misbind(runner: Any) -> None:
        first, second = runner.kv_cache_config.kv_cache_groups[0].layer_names[:2]
        context = runner.compilation_config.static_forward_context
        context[first].bind_kv_cache(runner.kv_caches_by_layer[second])

    Fault.after = misbind
    refusals = get_ledger().snapshot().get("counters", {}).get("kv_cache_layout", {}).get("refusals", 0)
    try:
        with pytest.raises(LayoutRefused) as refused:
            run(stack, "Kimi K3")
    finally:
        Fault.after = None
    message = str(refused.value)
    assert "refusing to serve KimiK3ForConditionalGeneration on vLLM" in message
    assert "the KV-cache views extend_kv_cache bound lets two requests' cache bytes collide" in message
    first, second = stack.runner.kv_cache_config.kv_cache_groups[0].layer_names[:2]  # two KDA layers, group 0
    assert f"`{first}` state0 block 0 (group 0)" in message and f"`{second}` state0 block 0 (group 0)" in message
    assert "share byte" in message and "bytes per block id" in message and "Fix: report it" in message
    assert fact()["status"] == "refused: overlap found"
    assert get_ledger().snapshot()["counters"]["kv_cache_layout"]["refusals"] == refusals + 1


# -- each rule alone, on synthetic views ---------------------------------------------------------------------

PAGE, BLOCKS = 64, 8


def config(*groups: list[str]) -> SimpleNamespace:
    return SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[SimpleNamespace(layer_names=g) for g in groups])


def twin_storages() -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors with different storage objects over the same bytes (as committed_views' segment views are)."""
    buffer = bytearray(BLOCKS * PAGE)
    first, second = torch.frombuffer(buffer, dtype=torch.uint8), torch.frombuffer(buffer, dtype=torch.uint8)
    assert first.untyped_storage()._cdata != second.untyped_storage()._cdata
    assert first.data_ptr() == second.data_ptr()
    return first.view(BLOCKS, PAGE), second.view(BLOCKS, PAGE)


def test_storages_over_the_same_bytes_are_one_address_space() -> None:
    """The rule alone: layers of one group on two storage objects over the same bytes collide; of two groups not."""
    first, second = twin_storages()
    verdict, detail, spaces, views = upstream034_proof.prove_phase(config(["a"], ["b"]), {"a": first, "b": second})
    assert (verdict, spaces, views) == ("proven", 1, 2)
    verdict, detail, spaces, _ = upstream034_proof.prove_phase(config(["a", "b"]), {"a": first, "b": second})
    assert verdict == "overlap found" and "share byte 0" in detail and spaces == 1


def test_a_view_past_its_own_storage_is_out_of_storage() -> None:
    """The rule alone: inside the address space, but past the (committed) bytes its own storage holds."""
    full = torch.zeros(BLOCKS * PAGE, dtype=torch.uint8)
    view = full.view(BLOCKS, PAGE)

    class Committed:  # what a segment view of fewer committed bytes reports; torch builds no view past its end
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def __getattr__(self, name: str) -> Any:
            return getattr(self.tensor, name)

        def untyped_storage(self) -> Any:
            storage = self.tensor.untyped_storage()
            return SimpleNamespace(data_ptr=storage.data_ptr, nbytes=lambda: (BLOCKS - 1) * PAGE)

    verdict, detail, _, _ = upstream034_proof.prove_phase(config(["a"], ["b"]),
                                                          {"a": view, "b": full.view(BLOCKS, PAGE)})
    assert verdict == "proven"
    verdict, detail, _, _ = upstream034_proof.prove_phase(config(["a"], ["b"]),
                                                          {"a": Committed(view), "b": full.view(BLOCKS, PAGE)})
    assert verdict == "out of storage" and "outside the storage" in detail


def test_a_view_past_its_own_storage_refuses() -> None:
    full = torch.zeros(BLOCKS * PAGE, dtype=torch.uint8)

    class Committed:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def __getattr__(self, name: str) -> Any:
            return getattr(self.tensor, name)

        def untyped_storage(self) -> Any:
            return SimpleNamespace(data_ptr=self.tensor.untyped_storage().data_ptr, nbytes=lambda: PAGE)

    with pytest.raises(LayoutRefused, match=r"extend_kv_cache bound out of storage: .* outside the storage"):
        verify_rebind(config(["a"]), {"a": Committed(full.view(BLOCKS, PAGE))}, "vLLM X", "M", False)


@pytest.mark.parametrize(("before", "after", "worse"), [
    ("proven", "proven", "proven"), ("proven", "overlap found", "overlap found"),
    ("out of storage", "not checkable", "out of storage"), ("not checkable", "proven", "not checkable")])
def test_a_case_has_its_worse_phases_verdict(before: str, after: str, worse: str) -> None:
    result = upstream034_proof.RebindResult({"before": upstream034_proof.CaseResult(before, ""),
                                             "after": upstream034_proof.CaseResult(after, "")})
    assert result.verdict == worse


def test_proven_views_are_verified() -> None:
    first, second = twin_storages()
    recorded = verify_rebind(config(["a"], ["b"]), {"a": first, "b": [second[:, :16], second[:, 16:]]}, "vLLM X",
                             "M", False)
    assert recorded["status"] == PROVEN and recorded["checked"].startswith("3 views of 2 layers in 1 address space")


def test_an_overlap_refuses() -> None:
    first, second = twin_storages()
    with pytest.raises(LayoutRefused, match=r"refusing to serve M on vLLM X: .* collide: .*share byte 0"):
        verify_rebind(config(["a", "b"]), {"a": first, "b": second}, "vLLM X", "M", False)


def test_not_checkable_keeps_the_views_with_a_warning_and_refuses_under_strict(
        caplog: pytest.LogCaptureFixture) -> None:
    odd = {"a": torch.zeros(BLOCKS + 1, PAGE)}  # 9 rows for 8 blocks
    with caplog.at_level(logging.WARNING, logger="kda_patches"):
        recorded = verify_rebind(config(["a"]), odd, "vLLM X", "M", strict=False)
    assert recorded["status"] == NOT_PROVEN and recorded["detail"].startswith("views: ValueError")
    assert "upstream layout not proven for M on vLLM X after extend_kv_cache" in caplog.text
    with pytest.raises(LayoutRefused, match=r"KDA_PATCHES_STRICT=1 refuses an unproven layout"):
        verify_rebind(config(["a"]), odd, "vLLM X", "M", strict=True)


def test_bound_views_are_the_grouped_layers_bound_caches() -> None:
    first, second = twin_storages()
    layers = {"a": SimpleNamespace(kv_cache=first), "b": SimpleNamespace(kv_cache=(second[:, :8], second[:, 8:])),
              "unbound": SimpleNamespace(), "shared": SimpleNamespace(kv_cache=first)}
    runner = SimpleNamespace(kv_cache_config=config(["a", "unbound"], ["b"]),
                             compilation_config=SimpleNamespace(static_forward_context=layers))
    kv_config, views = bound_views(runner)
    assert kv_config is runner.kv_cache_config and list(views) == ["a", "b"]
    assert views["a"] is first and isinstance(views["b"], list) and len(views["b"]) == 2
