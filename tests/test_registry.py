"""Registry behaviour on dummy targets: apply, double apply, revert, drift, failure, strict."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid

import pytest

from kda_patches import registry
from kda_patches.ledger import get_ledger


def make_module(tmp_path, monkeypatch, body: str, version: str = "1.2.0") -> str:
    """Write a uniquely named dummy module (not imported yet) and return its name."""
    name = f"dummy_target_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(f"__version__ = {version!r}\n" + textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def add_one(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1


def make_patch(module: str, qualname: str = "Engine.step", wrapper=add_one, **target_options) -> registry.Patch:
    target = registry.Target(module=module, qualname=qualname, wrapper=wrapper, distribution=module, **target_options)
    return registry.Patch(name=f"p_{uuid.uuid4().hex[:8]}", summary="test patch", targets=(target,))


ENGINE = """
class Engine:
    def step(self, value):
        return value * 10
"""


def test_patch_applies_when_module_is_imported_later(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE)
    patch = make_patch(name, parameters=("self", "value"))
    registry.register_patch(patch)
    assert get_ledger().patch_state(patch.name)[0] == "pending"
    module = importlib.import_module(name)
    assert module.Engine().step(2) == 21
    assert get_ledger().patch_state(patch.name)[0] == "applied"
    registry.revert_patch(patch)


def test_double_apply_wraps_once_and_revert_restores_identity(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE)
    module = importlib.import_module(name)
    original = vars(module.Engine)["step"]
    patch = make_patch(name)
    registry.register_patch(patch)
    registry.register_patch(patch)
    assert registry.apply_target(patch, patch.targets[0], module) == "applied"
    assert module.Engine().step(1) == 11  # one wrapper, not two
    assert registry.revert_patch(patch) == 1
    assert vars(module.Engine)["step"] is original
    assert module.Engine().step(1) == 10
    assert get_ledger().patch_state(patch.name)[0] == "disabled"


def test_revert_restores_staticmethod_object(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, """
        class Engine:
            @staticmethod
            def step(value):
                return value * 10
    """)
    module = importlib.import_module(name)
    original = vars(module.Engine)["step"]
    patch = make_patch(name)
    registry.register_patch(patch)
    assert module.Engine.step(1) == 11
    registry.revert_patch(patch)
    assert vars(module.Engine)["step"] is original


def test_signature_drift_is_skipped_with_one_warning(tmp_path, monkeypatch, caplog):
    name = make_module(tmp_path, monkeypatch, """
        class Engine:
            def step(self, value, extra=None):
                return value * 10
    """)
    patch = make_patch(name, parameters=("self", "value"))
    registry.register_patch(patch)
    with caplog.at_level("WARNING", logger="kda_patches"):
        module = importlib.import_module(name)
    assert module.Engine().step(1) == 10  # original code runs
    state, reason = get_ledger().patch_state(patch.name)
    assert state == "skipped"
    assert "found (self, value, extra)" in reason and "expected (self, value)" in reason
    warnings = [r for r in caplog.records if patch.name in r.getMessage()]
    assert len(warnings) == 1 and "1.2.0" in warnings[0].getMessage()


def test_version_older_than_range_is_not_applicable(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE, version="0.9.1")
    patch = make_patch(name, min_version="1.0", max_version="2.0")
    registry.register_patch(patch, strict=True)  # not drift: no error under STRICT
    module = importlib.import_module(name)
    assert module.Engine().step(1) == 10
    state, reason = get_ledger().patch_state(patch.name)
    assert state == "not-applicable" and reason == f"declared for {name}>=1.0,<2.0, found 0.9.1"


def test_version_newer_than_every_range_is_skipped(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE, version="2.0.1")
    patch = make_patch(name, min_version="1.0", max_version="2.0")
    registry.register_patch(patch)
    module = importlib.import_module(name)
    assert module.Engine().step(1) == 10
    state, reason = get_ledger().patch_state(patch.name)
    assert state == "skipped" and "2.0.1" in reason and "newer than every range" in reason


def test_missing_target_is_not_applicable(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, "class Other:\n    pass\n")
    patch = make_patch(name)
    registry.register_patch(patch)
    importlib.import_module(name)
    assert get_ledger().patch_state(patch.name)[0] == "not-applicable"


def test_inherited_method_is_not_wrapped_on_the_subclass(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE + "\nclass Child(Engine):\n    pass\n")
    patch = make_patch(name, qualname="Child.step")
    registry.register_patch(patch)
    module = importlib.import_module(name)
    assert "step" not in vars(module.Child)
    assert get_ledger().patch_state(patch.name)[0] == "not-applicable"


READ_ONLY_ENGINE = """
class Frozen(type):
    def __setattr__(cls, name, value):
        raise TypeError(f"cannot set {name!r}: {cls.__name__} is read-only")

class Engine(metaclass=Frozen):
    def step(self, value):
        return value * 10
"""


def test_failing_patch_is_recorded_and_target_still_imports(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, READ_ONLY_ENGINE)
    patch = make_patch(name)
    registry.register_patch(patch)
    module = importlib.import_module(name)
    assert module.Engine().step(1) == 10
    state, reason = get_ledger().patch_state(patch.name)
    assert state == "failed" and "read-only" in reason


def test_strict_turns_drift_into_import_error(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE)
    patch = make_patch(name, parameters=("self",))
    registry.register_patch(patch, strict=True)
    with pytest.raises(ImportError, match="KDA_PATCHES_STRICT=1"):
        importlib.import_module(name)
    sys.modules.pop(name, None)


def test_strict_turns_failure_into_import_error(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, READ_ONLY_ENGINE)
    patch = make_patch(name)
    registry.register_patch(patch, strict=True)
    with pytest.raises(ImportError, match=patch.name):
        importlib.import_module(name)
    sys.modules.pop(name, None)


def test_strict_raises_on_a_release_newer_than_every_range(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE, version="3.1")
    patch = make_patch(name, min_version="1.0", max_version="2.0")
    registry.register_patch(patch, strict=True)
    with pytest.raises(ImportError, match="newer than every range"):
        importlib.import_module(name)
    sys.modules.pop(name, None)


def test_parse_version_handles_local_suffixes():
    assert registry.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert registry.parse_version("v0.13.0rc1") == (0, 13, 0)
    with pytest.raises(ValueError, match="cannot parse"):
        registry.parse_version("unknown")


# -- sibling targets (one key, disjoint version ranges) ------------------------------------------

def times_100(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * 100


def sibling_patch(name: str) -> registry.Patch:
    """``Engine.step`` declared twice: ``(self, value)`` for <1.0 (adds one), ``(self, value, scale)`` for 1.x."""
    old = registry.Target(name, "Engine.step", add_one, distribution=name, min_version="0.5", max_version="1.0",
                          parameters=("self", "value"))
    new = registry.Target(name, "Engine.step", times_100, distribution=name, min_version="1.0",
                          max_version="2.0", parameters=("self", "value", "scale"))
    return registry.Patch(name=f"p_{uuid.uuid4().hex[:8]}", summary="siblings", targets=(old, new))


SCALED_ENGINE = """
class Engine:
    def step(self, value, scale=1):
        return value * 10 * scale
"""


@pytest.mark.parametrize(("version", "body", "expected", "index"), [
    ("0.7.0", ENGINE, 21, 0),
    ("1.3.0", SCALED_ENGINE, 2000, 1),
])
def test_the_sibling_in_range_is_applied_and_shown(tmp_path, monkeypatch, version, body, expected, index):
    name = make_module(tmp_path, monkeypatch, body, version=version)
    patch = sibling_patch(name)
    registry.register_patch(patch, strict=True)  # the out-of-range sibling is no error
    module = importlib.import_module(name)
    assert module.Engine().step(2) == expected
    assert registry.is_applied(patch, patch.targets[index])
    assert not registry.is_applied(patch, patch.targets[1 - index])
    state, reason = get_ledger().snapshot()["patches"][patch.name]["targets"][f"{name}:Engine.step"].values()
    assert state == "applied" and version in reason
    registry.revert_patch(patch)
    assert module.Engine().step(2) == expected // (21 if index == 0 else 100) * (20 if index == 0 else 1)


def test_sibling_in_range_with_drift_is_an_error_under_strict(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE, version="1.3.0")  # 1.x declares (self, value, scale)
    patch = sibling_patch(name)
    registry.register_patch(patch, strict=True)
    with pytest.raises(ImportError, match=r"signature drifted: found \(self, value\)"):
        importlib.import_module(name)
    sys.modules.pop(name, None)


def test_version_between_sibling_ranges_is_not_applicable(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE, version="0.3")
    patch = sibling_patch(name)
    registry.register_patch(patch, strict=True)
    importlib.import_module(name)
    state, reason = get_ledger().patch_state(patch.name)
    assert state == "not-applicable"
    assert reason == f"declared for {name}>=0.5,<1.0 or {name}>=1.0,<2.0, found 0.3"


def test_overlapping_sibling_ranges_are_refused():
    first = registry.Target("m", "f", add_one, min_version="1.0", max_version="2.0")
    second = registry.Target("m", "f", add_one, min_version="1.5")
    with pytest.raises(ValueError, match="overlapping version ranges"):
        registry.Patch("p", "s", (first, second))
    assert registry.Patch("p", "s", (first, registry.Target("m", "f", add_one, min_version="2.0")))


# -- coupled targets ------------------------------------------------------------------------------

LAYER = """
class Layer:
    def _run_prefill(self, q, state):
        return q + 1
"""
RUNNER_027 = """
class Runner:
    def initialize_kv_cache(self, kv_cache_config):
        return "bound"
"""
RUNNER_028 = """
class Runner:
    def initialize_kv_cache(self, kv_cache_config, kv_cache_allocation_context):
        return "bound"
"""


def mark(wrapped, instance, args, kwargs):
    return ("wrapped", wrapped(*args, **kwargs))


def seam_patch(layer: str, runner: str, runner_parameters=("self", "kv_cache_config"), **runner_range):
    """A seam and its startup hook in one group (the kimi_prefill shape), on stand-in modules."""
    seam = registry.Target(layer, "Layer._run_prefill", mark, distribution=layer,
                           parameters=("self", "q", "state"), group="seam")
    hook = registry.Target(runner, "Runner.initialize_kv_cache", mark, distribution=runner,
                           parameters=runner_parameters, group="seam", **runner_range)
    return registry.Patch(name=f"p_{uuid.uuid4().hex[:8]}", summary="seam + startup", targets=(seam, hook))


def make_named(tmp_path, monkeypatch, prefix: str, body: str, version: str = "1.2.0") -> str:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(f"__version__ = {version!r}\n" + textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def group_warnings(caplog, patch):
    return [r for r in caplog.records if patch.name in r.getMessage() and r.levelname == "WARNING"]


@pytest.mark.parametrize("layer_first", [True, False])
def test_group_applies_together_in_either_import_order(tmp_path, monkeypatch, layer_first):
    layer = make_named(tmp_path, monkeypatch, "layer", LAYER)
    runner = make_named(tmp_path, monkeypatch, "runner", RUNNER_027)
    patch = seam_patch(layer, runner)
    registry.register_patch(patch, strict=True)
    order = [layer, runner] if layer_first else [runner, layer]
    first = importlib.import_module(order[0])
    assert sys.modules.get(order[1]) is None  # the static check did not import the other member
    assert registry.is_applied(patch, patch.targets[0 if layer_first else 1])
    importlib.import_module(order[1])
    assert sys.modules[layer].Layer()._run_prefill(1, None) == ("wrapped", 2)
    assert sys.modules[runner].Runner().initialize_kv_cache(None) == ("wrapped", "bound")
    assert get_ledger().patch_state(patch.name)[0] == "applied"
    assert first is sys.modules[order[0]]
    registry.revert_patch(patch)


@pytest.mark.parametrize("layer_first", [True, False])
def test_runner_with_the_028_signature_leaves_the_seam_unwrapped(tmp_path, monkeypatch, caplog, layer_first):
    layer = make_named(tmp_path, monkeypatch, "layer", LAYER)
    runner = make_named(tmp_path, monkeypatch, "runner", RUNNER_028)
    patch = seam_patch(layer, runner)  # declares the 0.27 fingerprint (self, kv_cache_config)
    registry.register_patch(patch)
    with caplog.at_level("WARNING", logger="kda_patches"):
        for name in ([layer, runner] if layer_first else [runner, layer]):
            importlib.import_module(name)
    assert sys.modules[layer].Layer()._run_prefill(1, None) == 2  # the seam runs unwrapped
    assert sys.modules[runner].Runner().initialize_kv_cache(None, None) == "bound"
    targets = get_ledger().snapshot()["patches"][patch.name]["targets"]
    for key in (f"{layer}:Layer._run_prefill", f"{runner}:Runner.initialize_kv_cache"):
        assert targets[key]["state"] == "skipped"
        assert f"member {runner}:Runner.initialize_kv_cache" in targets[key]["reason"]
        assert "kv_cache_allocation_context" in targets[key]["reason"]
    assert len(group_warnings(caplog, patch)) == 1


def test_group_failure_is_an_error_under_strict(tmp_path, monkeypatch):
    layer = make_named(tmp_path, monkeypatch, "layer", LAYER)
    runner = make_named(tmp_path, monkeypatch, "runner", RUNNER_028)
    patch = seam_patch(layer, runner)
    registry.register_patch(patch, strict=True)
    with pytest.raises(ImportError, match="group 'seam'"):
        importlib.import_module(layer)
    sys.modules.pop(layer, None)
    assert not registry.is_applied(patch, patch.targets[0])


def test_group_member_missing_leaves_the_others_unapplied(tmp_path, monkeypatch, caplog):
    layer = make_named(tmp_path, monkeypatch, "layer", LAYER)
    runner = make_named(tmp_path, monkeypatch, "runner", "class Runner:\n    pass\n")
    patch = seam_patch(layer, runner)
    registry.register_patch(patch)
    with caplog.at_level("WARNING", logger="kda_patches"):
        importlib.import_module(layer)
    assert sys.modules[layer].Layer()._run_prefill(1, None) == 2
    state, reason = get_ledger().patch_state(patch.name)
    assert state == "skipped" and "Runner.initialize_kv_cache is not defined" in reason
    assert len(group_warnings(caplog, patch)) == 1


def test_group_wholly_absent_is_not_applicable_without_warning(tmp_path, monkeypatch, caplog):
    layer = make_named(tmp_path, monkeypatch, "layer", LAYER, version="0.9")
    runner = make_named(tmp_path, monkeypatch, "runner", RUNNER_027, version="0.9")
    seam = registry.Target(layer, "Layer._run_prefill", mark, distribution=layer, min_version="1.0",
                           parameters=("self", "q", "state"), group="seam")
    hook = registry.Target(runner, "Runner.initialize_kv_cache", mark, distribution=runner, min_version="1.0",
                           max_version="1.5", parameters=("self", "kv_cache_config"), group="seam")
    patch = registry.Patch(name=f"p_{uuid.uuid4().hex[:8]}", summary="old stack", targets=(seam, hook))
    registry.register_patch(patch, strict=True)
    with caplog.at_level("WARNING", logger="kda_patches"):
        importlib.import_module(layer)
        importlib.import_module(runner)
    assert get_ledger().patch_state(patch.name)[0] == "not-applicable"
    assert group_warnings(caplog, patch) == []


def test_imported_member_is_checked_by_its_real_object(tmp_path, monkeypatch):
    layer = make_named(tmp_path, monkeypatch, "layer", LAYER)
    runner = make_named(tmp_path, monkeypatch, "runner", RUNNER_027)
    runner_module = importlib.import_module(runner)

    def initialize_kv_cache(self, kv_cache_config, kv_cache_allocation_context):
        return "replaced"

    monkeypatch.setattr(runner_module.Runner, "initialize_kv_cache", initialize_kv_cache)  # source says 0.27
    patch = seam_patch(layer, runner)
    registry.register_patch(patch)
    importlib.import_module(layer)
    assert sys.modules[layer].Layer()._run_prefill(1, None) == 2
    assert "kv_cache_allocation_context" in get_ledger().patch_state(patch.name)[1]


RUNNER_REDEFINED_AT_IMPORT = RUNNER_027 + """

def _initialize(self, kv_cache_config, kv_cache_allocation_context):
    return "bound"

Runner.initialize_kv_cache = _initialize  # the source's def says (self, kv_cache_config); the import differs
"""


def test_member_failing_its_runtime_check_reverts_the_applied_ones(tmp_path, monkeypatch, caplog):
    layer = make_named(tmp_path, monkeypatch, "layer", LAYER)
    runner = make_named(tmp_path, monkeypatch, "runner", RUNNER_REDEFINED_AT_IMPORT)
    patch = seam_patch(layer, runner)
    registry.register_patch(patch)
    layer_module = importlib.import_module(layer)
    original = vars(layer_module.Layer)["_run_prefill"].__wrapped__
    assert registry.is_applied(patch, patch.targets[0])  # the static check passed
    with caplog.at_level("WARNING", logger="kda_patches"):
        importlib.import_module(runner)
    assert vars(layer_module.Layer)["_run_prefill"] is original
    assert layer_module.Layer()._run_prefill(1, None) == 2
    targets = get_ledger().snapshot()["patches"][patch.name]["targets"]
    seam = targets[f"{layer}:Layer._run_prefill"]
    assert seam["state"] == "skipped" and f"reverted {layer}:Layer._run_prefill" in seam["reason"]
    assert targets[f"{runner}:Runner.initialize_kv_cache"]["state"] == "skipped"
    assert "kv_cache_allocation_context" in targets[f"{runner}:Runner.initialize_kv_cache"]["reason"]
    assert len(group_warnings(caplog, patch)) == 1


def test_group_verdict_is_computed_once(tmp_path, monkeypatch):
    layer = make_named(tmp_path, monkeypatch, "layer", LAYER)
    runners = [make_named(tmp_path, monkeypatch, "runner", RUNNER_027) for _ in range(2)]
    targets = [registry.Target(layer, "Layer._run_prefill", mark, distribution=layer, group="g")]
    targets += [registry.Target(r, "Runner.initialize_kv_cache", mark, distribution=r, group="g") for r in runners]
    patch = registry.Patch(name=f"p_{uuid.uuid4().hex[:8]}", summary="three members", targets=tuple(targets))
    reads = []
    real_read = registry.read_static_parameters
    monkeypatch.setattr(registry, "read_static_parameters", lambda t: reads.append(t.key) or real_read(t))
    registry.register_patch(patch)
    for name in (layer, *runners):
        importlib.import_module(name)
    assert sorted(reads) == sorted(f"{r}:Runner.initialize_kv_cache" for r in runners)
    assert all(registry.is_applied(patch, t) for t in patch.targets)
    registry.revert_patch(patch)


def test_public_predicates_on_plain_data():
    target = registry.Target("m", "C.f", add_one, distribution="d", min_version="0.28", max_version="0.30",
                             parameters=("self", "a"))
    patch = registry.Patch("p", "s", (target,))
    assert registry.version_in_range(target, "0.29.0rc1") and not registry.version_in_range(target, "0.30.0")
    assert registry.newer_than_all(patch, "d", "0.30.0rc2") and not registry.newer_than_all(patch, "d", "0.27")
    assert registry.fingerprint_matches(target, ("self", "a")) and not registry.fingerprint_matches(target, None)
    assert registry.check_key(patch, "m:C.f", "0.28.0", ("self", "a")).ok
    assert registry.check_key(patch, "m:C.f", "0.28.0", ("self", "a", "b")).state == "skipped"
    assert registry.check_key(patch, "m:C.f", "0.28.0", registry.ABSENT).state == "not-applicable"
    assert registry.check_key(patch, "m:C.f", "0.26.0", ("self",)).state == "not-applicable"


def test_inert_range_is_declared_not_applicable_and_never_wrapped(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE, version="0.27.0")
    live = registry.Target(name, "Engine.step", add_one, distribution=name, min_version="0.13", max_version="0.14",
                           parameters=("self", "value"))
    gap = registry.Target(name, "Engine.step", None, distribution=name, min_version="0.26", max_version="0.30",
                          inert="no adapter for this era")
    patch = registry.Patch(name=f"p_{uuid.uuid4().hex[:8]}", summary="declared gap", targets=(live, gap))
    registry.register_patch(patch, strict=True)  # without the gap, 0.27 would be newer than every range
    module = importlib.import_module(name)
    assert module.Engine().step(1) == 10
    state, reason = get_ledger().patch_state(patch.name)
    assert state == "not-applicable" and reason.startswith("inert: no adapter for this era")
    with pytest.raises(ValueError, match="declare it inert"):
        registry.Target(name, "Engine.step", None)


@pytest.mark.parametrize("choice", ["fork", "overlay"])
def test_a_target_chosen_by_a_switch_is_wrapped_only_when_chosen(tmp_path, monkeypatch, choice):
    """``chosen_by``: inert with its text unless the switch has the chosen value (where the fork does the job)."""
    import kda_patches
    from kda_patches.flags import Flags

    monkeypatch.setattr(kda_patches, "_FLAGS", Flags(strict=True, gdn_plan=choice))
    name = make_module(tmp_path, monkeypatch, ENGINE, version="0.30.0")
    target = registry.Target(name, "Engine.step", add_one, distribution=name, min_version="0.30",
                             max_version="0.40", parameters=("self", "value"), inert="the fork copies itself",
                             chosen_by=("gdn_plan", "overlay"))
    patch = registry.Patch(name=f"p_{uuid.uuid4().hex[:8]}", summary="chosen era", targets=(target,))
    registry.register_patch(patch, strict=True)
    module = importlib.import_module(name)
    state, reason = get_ledger().patch_state(patch.name)
    if choice == "overlay":
        assert module.Engine().step(1) == 11 and state == "applied", reason
    else:
        assert module.Engine().step(1) == 10
        assert state == "not-applicable" and reason.startswith("inert: the fork copies itself"), reason
    registry.revert_patch(patch)


@pytest.mark.parametrize(("choice", "wrapped"), [("measured", True), ("overlay", True), ("upstream", False)])
def test_a_target_chosen_by_several_values_is_wrapped_under_each_of_them(tmp_path, monkeypatch, choice, wrapped):
    """``chosen_by=(switch, (value, ...))``: live under any listed value (vLLM 0.34's Qwen seam: the measured
    default and overlay), inert with its text under any other."""
    import kda_patches
    from kda_patches.flags import Flags

    monkeypatch.setattr(kda_patches, "_FLAGS", Flags(strict=True, gdn_ops=choice))
    name = make_module(tmp_path, monkeypatch, ENGINE, version="0.34.0")
    target = registry.Target(name, "Engine.step", add_one, distribution=name, min_version="0.34",
                             max_version="0.35", parameters=("self", "value"), inert="upstream copies itself",
                             chosen_by=("gdn_ops", ("measured", "overlay")))
    assert target.chosen_by == ("gdn_ops", ("measured", "overlay"))
    patch = registry.Patch(name=f"p_{uuid.uuid4().hex[:8]}", summary="chosen by two values", targets=(target,))
    registry.register_patch(patch, strict=True)
    module = importlib.import_module(name)
    state, reason = get_ledger().patch_state(patch.name)
    assert module.Engine().step(1) == (11 if wrapped else 10)
    assert (state == "applied") == wrapped, reason
    assert wrapped or reason.startswith("inert: upstream copies itself"), reason
    registry.revert_patch(patch)


def test_a_chosen_target_needs_a_wrapper_and_the_text_of_what_stands_aside():
    with pytest.raises(ValueError, match="needs a wrapper"):
        registry.Target("m", "f", None, inert="aside", chosen_by=("gdn_plan", "overlay"))
    with pytest.raises(ValueError, match="an inert text"):
        registry.Target("m", "f", add_one, chosen_by=("gdn_plan", "overlay"))


def test_hook_out_of_range_imported_first_keeps_the_seam_unwrapped(tmp_path, monkeypatch, caplog):
    layer = make_named(tmp_path, monkeypatch, "layer", LAYER)
    runner = make_named(tmp_path, monkeypatch, "runner", RUNNER_027, version="0.9")
    patch = seam_patch(layer, runner, min_version="1.0", max_version="1.5")
    registry.register_patch(patch)
    with caplog.at_level("WARNING", logger="kda_patches"):
        importlib.import_module(runner)
        importlib.import_module(layer)
    assert sys.modules[layer].Layer()._run_prefill(1, None) == 2
    targets = get_ledger().snapshot()["patches"][patch.name]["targets"]
    assert targets[f"{runner}:Runner.initialize_kv_cache"]["state"] == "not-applicable"
    assert targets[f"{layer}:Layer._run_prefill"]["state"] == "skipped"
    assert "found 0.9" in targets[f"{layer}:Layer._run_prefill"]["reason"]
    assert len(group_warnings(caplog, patch)) == 1


ALLOCATOR = """
class Runner:
    def _reshape(self, raw):
        return raw
"""
BINDER = """
class Layer:
    def bind(self, kv_cache):
        return kv_cache
"""


@pytest.mark.parametrize(("version", "applied"), [("0.28", {"_reshape", "bind"}), ("0.31", {"allocate", "bind"})])
def test_a_key_joins_the_group_of_its_in_range_sibling(tmp_path, monkeypatch, version, applied):
    """bind is coupled to the reshape seam in one era and to the allocator in the next (siblings, two groups)."""
    runner = make_named(tmp_path, monkeypatch, "runner", ALLOCATOR + (
        "\ndef allocate(config):\n    return config\n" if version == "0.31" else ""), version=version)
    binder = make_named(tmp_path, monkeypatch, "binder", BINDER, version=version)
    opts = {"distribution": "stack"}
    monkeypatch.setattr(registry, "find_version", lambda target, module=None: version)
    targets = (
        registry.Target(runner, "Runner._reshape", mark, min_version="0.27", max_version="0.30", group="a", **opts),
        registry.Target(runner, "allocate", mark, min_version="0.30", max_version="0.34", group="b", **opts),
        registry.Target(binder, "Layer.bind", mark, min_version="0.27", max_version="0.30", group="a", **opts),
        registry.Target(binder, "Layer.bind", mark, min_version="0.30", max_version="0.34", group="b", **opts),
    )
    patch = registry.Patch(name=f"p_{uuid.uuid4().hex[:8]}", summary="two eras", targets=targets)
    registry.register_patch(patch, strict=True)
    importlib.import_module(binder)
    importlib.import_module(runner)
    wrapped = {t.qualname.split(".")[-1] for t in patch.targets if registry.is_applied(patch, t)}
    assert wrapped == applied
    registry.revert_patch(patch)


def test_absent_member_of_an_uninstalled_distribution_is_not_applicable():
    """No version and nothing there (the fork is not installed): not-applicable, not 'version unknown'."""
    seam = registry.Target("not_installed_fork_x.ops", "Layer._run_prefill", mark, distribution="not-installed-fork-x",
                           min_version="0.26", group="g")
    patch = registry.Patch("p", "s", (seam,))
    verdict = registry.group_verdict(patch, "g", lambda target: None, lambda target: registry.ABSENT)
    assert verdict.state == "not-applicable", verdict
    present = registry.group_verdict(patch, "g", lambda target: None, lambda target: ("self",))
    assert present.state == "skipped" and "version of not-installed-fork-x unknown" in present.reason


def test_member_still_importing_is_read_from_source(tmp_path, monkeypatch):
    """The runner module imports the layer module before defining its class: when the layer's hook fires, the
    runner is in sys.modules but half-executed, so its class must be read from source, not looked up (absent)."""
    layer = make_named(tmp_path, monkeypatch, "layer", LAYER)
    runner = make_named(tmp_path, monkeypatch, "runner", f"import {layer}\n" + textwrap.dedent(RUNNER_027))
    patch = seam_patch(layer, runner)
    registry.register_patch(patch, strict=True)
    importlib.import_module(runner)
    assert sys.modules[layer].Layer()._run_prefill(1, None) == ("wrapped", 2)
    assert sys.modules[runner].Runner().initialize_kv_cache(None) == ("wrapped", "bound")
    registry.revert_patch(patch)


def times_two(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * 2


@pytest.mark.parametrize("first_reverted", ["inner", "outer"])
def test_reverting_one_of_two_stacked_patches_keeps_the_other(tmp_path, monkeypatch, first_reverted):
    # kimi_prefill and gdn_state_copy both wrap the runners' initialize_kv_cache: reverting the patch that
    # wrapped first must not silently drop the one stacked on top of it
    name = make_module(tmp_path, monkeypatch, ENGINE)
    module = importlib.import_module(name)
    original = vars(module.Engine)["step"]
    inner, outer = make_patch(name), make_patch(name, wrapper=times_two)
    registry.register_patch(inner)
    registry.register_patch(outer)
    assert module.Engine().step(1) == (10 + 1) * 2
    if first_reverted == "inner":
        assert registry.revert_patch(inner) == 1
        assert module.Engine().step(1) == 10 * 2  # outer still wraps, inner is gone
        assert registry.revert_patch(outer) == 1
    else:
        assert registry.revert_patch(outer) == 1
        assert module.Engine().step(1) == 10 + 1
        assert registry.revert_patch(inner) == 1
    assert vars(module.Engine)["step"] is original
    assert module.Engine().step(1) == 10


def test_reverting_a_wrapper_someone_replaced_leaves_the_replacement(tmp_path, monkeypatch, caplog):
    name = make_module(tmp_path, monkeypatch, ENGINE)
    module = importlib.import_module(name)
    patch = make_patch(name)
    registry.register_patch(patch)

    def replacement(self, value):
        return -value

    module.Engine.step = replacement
    with caplog.at_level("WARNING", logger="kda_patches"):
        assert registry.revert_patch(patch) == 0
    assert vars(module.Engine)["step"] is replacement
    assert "replaced by someone else" in caplog.text


TWO_SEAMS = """
class Plain:
    def step(self, value):
        return value * 10


class Upstream:
    def step(self, value):
        return value * 100
"""


@pytest.mark.parametrize("choice", ["upstream", "overlay"])
def test_an_opt_in_member_standing_aside_leaves_the_rest_of_its_group_applied(tmp_path, monkeypatch, choice):
    """vLLM 0.34's shape: one group of a plain seam and a seam upstream copies itself (opt-in). Standing aside, the
    opt-in member is no member (the plain seam applies, STRICT holds); chosen, it joins and both apply."""
    import kda_patches
    from kda_patches.flags import Flags

    monkeypatch.setattr(kda_patches, "_FLAGS", Flags(strict=True, gdn_ops=choice))
    name = make_module(tmp_path, monkeypatch, TWO_SEAMS, version="0.34.0")
    plain = registry.Target(name, "Plain.step", add_one, distribution=name, min_version="0.34", max_version="0.35",
                            parameters=("self", "value"), group="g")
    upstream = registry.Target(name, "Upstream.step", add_one, distribution=name, min_version="0.34",
                               max_version="0.35", parameters=("self", "value"), group="g",
                               inert="upstream copies itself", chosen_by=("gdn_ops", "overlay"))
    patch = registry.Patch(name=f"p_{uuid.uuid4().hex[:8]}", summary="opt-in member", targets=(plain, upstream))
    registry.register_patch(patch, strict=True)
    module = importlib.import_module(name)
    assert module.Plain().step(1) == 11
    entries = get_ledger().snapshot()["patches"][patch.name]["targets"]
    if choice == "overlay":
        assert module.Upstream().step(1) == 101
        assert entries[f"{name}:Upstream.step"]["state"] == "applied"
    else:
        assert module.Upstream().step(1) == 100
        assert entries[f"{name}:Upstream.step"]["state"] == "not-applicable"
        assert entries[f"{name}:Upstream.step"]["reason"].startswith("inert: upstream copies itself")
    verdict = registry.group_verdict(patch, "g", lambda target: "0.34.0", lambda target: ("self", "value"))
    assert verdict.ok and (f"{name}:Upstream.step" in verdict.members) == (choice == "overlay")
    registry.revert_patch(patch)


def test_a_group_whose_every_member_stands_aside_is_not_applicable_with_their_reasons(monkeypatch):
    import kda_patches
    from kda_patches.flags import Flags

    monkeypatch.setattr(kda_patches, "_FLAGS", Flags(gdn_ops="upstream"))
    members = tuple(registry.Target("m", f"C.{method}", add_one, distribution="d", min_version="0.34",
                                    max_version="0.35", group="g", inert="upstream copies itself",
                                    chosen_by=("gdn_ops", "overlay")) for method in ("f", "g"))
    verdict = registry.group_verdict(registry.Patch("p", "s", members), "g", lambda t: "0.34.0", lambda t: ("x",))
    assert verdict.state == "not-applicable" and "inert: upstream copies itself" in verdict.reason
