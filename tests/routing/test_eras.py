"""``kda_patches.routing.eras``: a member's own release span inside an era, and the runners' members per signature."""

from __future__ import annotations

from kda_patches.routing import eras


def wrapper(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def ranges(targets) -> list[tuple[str, str | None, str | None, tuple[str, ...] | None, str]]:
    return [(t.key, t.min_version, t.max_version, t.parameters, t.group) for t in targets]


def test_member_without_a_span_takes_the_era_range() -> None:
    targets = eras.era("vllm", "0.27", "0.30", (("m", "f", wrapper, ("a",), ()),))
    assert ranges(targets) == [("m:f", "0.27", "0.30", ("a",), "vllm-0.27")]


def test_member_span_is_clipped_to_the_era_and_joins_its_group() -> None:
    members = (("m", "R.f", wrapper, ("old",), (), (None, "0.29")), ("m", "R.f", wrapper, ("new",), (), ("0.29", None)))
    assert ranges(eras.era("vllm", "0.27", "0.30", members)) == [
        ("m:R.f", "0.27", "0.29", ("old",), "vllm-0.27"), ("m:R.f", "0.29", "0.30", ("new",), "vllm-0.27")]


def test_member_whose_span_misses_the_era_is_not_declared() -> None:
    members = (("m", "R.f", wrapper, ("old",), (), (None, "0.29")), ("m", "R.f", wrapper, ("new",), (), ("0.29", None)))
    assert ranges(eras.era("vllm", "0.30", "0.34", members)) == [("m:R.f", "0.30", "0.34", ("new",), "vllm-0.30")]
    assert ranges(eras.era("vllm", "0.26", "0.27", members)) == [("m:R.f", "0.26", "0.27", ("old",), "vllm-0.26")]
    assert eras.era("vllm", "0.29", "0.30", (("m", "f", wrapper, (), (), ("0.26", "0.29")),)) == ()


def test_runner_members_follow_the_signature_tables() -> None:
    """One member per runner module and signature; era keeps those whose span meets it (0.27 era: both)."""
    members = eras.era("vllm", "0.27", "0.30", eras.upstream_runners(wrapper, "0.27"))
    assert ranges(members) == [
        (f"{eras.V1_RUNNER_MODULE}:GPUModelRunner.initialize_kv_cache", "0.27", "0.29",
         eras.VLLM_RUNNER_PARAMETERS_027, "vllm-0.27"),
        (f"{eras.V1_RUNNER_MODULE}:GPUModelRunner.initialize_kv_cache", "0.29", "0.30",
         eras.VLLM_RUNNER_PARAMETERS, "vllm-0.27"),
        (f"{eras.V2_RUNNER_MODULE}:GPUModelRunner.initialize_kv_cache", "0.27", "0.29",
         eras.VLLM_V2_RUNNER_PARAMETERS_027, "vllm-0.27"),
        (f"{eras.V2_RUNNER_MODULE}:GPUModelRunner.initialize_kv_cache", "0.29", "0.30",
         eras.VLLM_RUNNER_PARAMETERS, "vllm-0.27")]
    latest = eras.era("vllm", "0.34", "0.35", eras.upstream_runners(wrapper, "0.34", rebind=wrapper))
    assert [t.key for t in latest] == [f"{eras.V2_RUNNER_MODULE}:GPUModelRunner.initialize_kv_cache",
                                       "vllm.v1.worker.extensible_kv_cache:extend_kv_cache"]  # no V1 runner
    assert latest[0].parameters == eras.VLLM_V2_RUNNER_PARAMETERS_034
    ascend = eras.era("vllm-ascend", "0.27", "0.28", eras.ascend_runners(wrapper, "0.27"))
    assert {t.parameters for t in ascend} == {eras.ASCEND_RUNNER_PARAMETERS} and len(ascend) == 2
