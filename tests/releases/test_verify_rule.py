"""The *verifies* verdict: decided by its rule alone on synthetic reports, and reached on the released forks.

``judge_patch`` (``kda_patches/releases/conformance.py``): a patch *verifies* only when EVERY wrapped platform
target declares a ``verify:`` shape that holds; a verifier beside a target that changes something makes the patch
*work*, and a ``verify:`` shape that is missing where the target would be wrapped makes it *broken*. On vllm-ascend
0.26-0.30, ``kv_cache_layout`` is such a verifier (``verify:npu_reshape_views_bound``).
"""

from __future__ import annotations

import pytest

from kda_patches.patches.kv_cache_layout import ASCEND_VERIFY_SHAPE
from kda_patches.registry import Patch, Target
from kda_patches.releases.conformance import check_stack, judge_patch
from kda_patches.releases.fetch import release_dir
from kda_patches.releases.matrix import DEFAULT_ASCEND, build_stack
from kda_patches.releases.shapes import SHAPES, check_shape
from kda_patches.releases.source import ReleaseSource


def _noop(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


PATCH = Patch("t_verify", "test record", (Target("m", "f", _noop),))


def report(key: str, verify: bool | None = True, stack: str = "vllm-ascend") -> dict:
    """A wrapped target's report: a holding verify: shape (True), a missing one (None), or a plain shape (False)."""
    shapes = {ASCEND_VERIFY_SHAPE: {"ok": verify is True, "evidence": "runner.py:7 bind_kv_cache(...)"}} \
        if verify is not False else {"gather:s[i]": {"ok": True, "evidence": "line 1"}}
    return {"key": key, "stack": stack, "group": None, "runtime": "ok", "runtime_reason": "version 0.29.0rc1",
            "shapes": shapes, "aliases": None, "stands_aside": False, "package_in_stack": True, "hint": None}


def test_every_wrapped_target_a_verifier_verifies_with_what_it_proves() -> None:
    verdict, reason = judge_patch(PATCH, [report("m:reshape")], "vllm-ascend")
    assert verdict == "verifies", reason
    assert "upstream layout proven" in reason and "runner.py:7 bind_kv_cache(...)" in reason


def test_a_verifier_beside_a_target_that_changes_something_works() -> None:
    verdict, reason = judge_patch(PATCH, [report("m:reshape"), report("m:seam", verify=False)], "vllm-ascend")
    assert verdict == "works" and "m:seam" in reason


def test_a_verifier_whose_shape_is_missing_is_broken() -> None:
    verdict, reason = judge_patch(PATCH, [report("m:reshape", verify=None)], "vllm-ascend")
    assert verdict == "broken" and ASCEND_VERIFY_SHAPE in reason


def test_only_platform_targets_decide() -> None:
    """Upstream targets also wrapped on an Ascend stack do not turn a verifier into *works*."""
    verdict, reason = judge_patch(PATCH, [report("m:reshape"), report("u:allocate", verify=False, stack="vllm")],
                                  "vllm-ascend")
    assert verdict == "verifies" and "also wrapped" in reason and "u:allocate" in reason


@pytest.mark.parametrize("version", DEFAULT_ASCEND)
def test_kv_cache_layout_verifies_on_every_fork_release(version: str) -> None:
    source = ReleaseSource(release_dir("vllm-ascend", version))
    result = check_shape(ASCEND_VERIFY_SHAPE, source)
    assert result.ok and "self._reshape_kv_cache_tensors(" in result.evidence and "bind_kv_cache(" in result.evidence
    entry = check_stack(build_stack(f"vllm-ascend=={version}"))["patches"]["kv_cache_layout"]
    assert entry["verdict"] == "verifies", entry["reason"]
    assert SHAPES[ASCEND_VERIFY_SHAPE].description in entry["reason"]


def test_verify_shape_fails_where_the_runner_does_not_bind_the_reshapes_views() -> None:
    """vLLM's own runner module is no fork runner: the shape names what is absent (no false *verifies*)."""
    result = check_shape(ASCEND_VERIFY_SHAPE, ReleaseSource(release_dir("vllm", "0.29.0")))
    assert not result.ok and "NPUModelRunner.initialize_kv_cache_tensors is absent" in result.evidence
