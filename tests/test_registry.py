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


def test_version_outside_range_is_skipped(tmp_path, monkeypatch):
    name = make_module(tmp_path, monkeypatch, ENGINE, version="0.9.1")
    patch = make_patch(name, min_version="1.0", max_version="2.0")
    registry.register_patch(patch)
    module = importlib.import_module(name)
    assert module.Engine().step(1) == 10
    state, reason = get_ledger().patch_state(patch.name)
    assert state == "skipped" and "0.9.1" in reason and ">=1.0,<2.0" in reason


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


def test_parse_version_handles_local_suffixes():
    assert registry.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert registry.parse_version("v0.13.0rc1") == (0, 13, 0)
    with pytest.raises(ValueError, match="cannot parse"):
        registry.parse_version("unknown")
