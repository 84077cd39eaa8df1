"""The *stands down* verdict decided by its rule alone, on synthetic per-target reports (no release read).

``judge_patch`` (``kda_patches/releases/conformance.py``): a patch stands down only when EVERY wrapped platform
target is fork-native (its ``fork:`` shape holds) -- or when nothing is wrapped and a target stands aside by
choice (``Target.chosen_by``: vllm-ascend 0.30's GDN kernels, vLLM 0.34's own GDN ops). One plain seam wrapped
beside a fork-native one makes the patch *work*. Loosening "every" to "any" changes the first two tests.
"""

from __future__ import annotations

from kda_patches.registry import Patch, Target
from kda_patches.releases.conformance import judge_patch


def _noop(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


PATCH = Patch("t_stand", "test record", (Target("m", "f", _noop),))


def report(key: str, runtime: str = "ok", fork: bool = False, stands_aside: bool = False, group: str | None = None,
           reason: str = "version 0.34.0") -> dict:
    shapes = {"fork:own_plan": {"ok": True, "evidence": "the fork ships its own plan"}} if fork else \
        {"gather:s[i]": {"ok": True, "evidence": "line 1"}}
    return {"key": key, "stack": "vllm", "group": group, "runtime": runtime, "runtime_reason": reason,
            "shapes": shapes, "aliases": None, "stands_aside": stands_aside, "package_in_stack": True, "hint": None}


def test_one_fork_native_seam_beside_a_plain_seam_does_not_stand_down() -> None:
    verdict, reason = judge_patch(PATCH, [report("m:fork_native", fork=True), report("m:plain")])
    assert verdict == "works", reason
    assert "m:fork_native" in reason and "m:plain" in reason


def test_every_wrapped_seam_fork_native_stands_down() -> None:
    verdict, reason = judge_patch(PATCH, [report("m:fork_a", fork=True), report("m:fork_b", fork=True)])
    assert verdict == "stands down" and "the fork ships its own plan" in reason


def test_a_seam_standing_aside_beside_a_wrapped_plain_seam_works_and_names_the_stand_down() -> None:
    aside = report("m:qwen", runtime="not-applicable", stands_aside=True, group="g",
                   reason="inert: upstream copies these states itself")
    verdict, reason = judge_patch(PATCH, [aside, report("m:olmo", group="g")])
    assert verdict == "works", reason  # the group is not "wrapped without" its standing-aside member
    assert "stands down on m:qwen (opt-in)" in reason


def test_only_seams_standing_aside_stand_down_with_their_reason() -> None:
    aside = report("m:qwen", runtime="not-applicable", stands_aside=True,
                   reason="inert: upstream copies these states itself")
    verdict, reason = judge_patch(PATCH, [aside, report("m:other", runtime="absent", reason="not shipped")])
    assert verdict == "stands down" and "upstream copies these states itself" in reason


def test_a_declared_gap_that_is_no_choice_stays_inert() -> None:
    gap = report("m:old", runtime="not-applicable", reason="inert: no adapter for this era")
    assert judge_patch(PATCH, [gap])[0] == "inert"


def test_a_group_member_left_unwrapped_without_standing_aside_is_broken() -> None:
    left = report("m:hook", runtime="not-applicable", group="g", reason="hook is not defined in m")
    verdict, reason = judge_patch(PATCH, [left, report("m:seam", group="g")])
    assert verdict == "broken" and "would be wrapped without m:hook" in reason
