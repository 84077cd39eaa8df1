"""Module-level aliases of a wrapped definition are rebound to the wrapper, recorded, and restored on revert.

Each test writes its own dummy modules: a definition module and users that did ``from M import f`` before
the patch was registered (the vLLM-plugin activation order), or after it was applied.
"""

from __future__ import annotations

import importlib
import textwrap
import uuid

from kda_patches import registry
from kda_patches.ledger import get_ledger


def write(tmp_path, monkeypatch, body: str, prefix: str = "alias_mod") -> str:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text("__version__ = '1.0.0'\n" + textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def add_hundred(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 100


def function_patch(module: str, qualname: str = "plan") -> registry.Patch:
    target = registry.Target(module=module, qualname=qualname, wrapper=add_hundred, distribution=module,
                             parameters=("value",))
    return registry.Patch(name=f"alias_{uuid.uuid4().hex[:8]}", summary="alias test", targets=(target,))


DEFINITION = """
def plan(value):
    return value * 2
"""


def test_aliases_imported_before_activation_are_rebound_and_recorded(tmp_path, monkeypatch):
    definition = write(tmp_path, monkeypatch, DEFINITION)
    user = importlib.import_module(write(tmp_path, monkeypatch, f"""
        from {definition} import plan
        from {definition} import plan as renamed

        def run(value):
            return plan(value)
    """))
    patch = function_patch(definition)
    registry.register_patch(patch)
    try:
        assert user.run(1) == 102 and user.renamed(1) == 102  # the wrapper runs through the user's own names
        fact = get_ledger().snapshot()["facts"][registry.ALIASES_SECTION][f"{patch.name} {definition}:plan"]
        assert fact == [f"{user.__name__}.plan", f"{user.__name__}.renamed"]
        assert "2 module-level aliases rebound" in get_ledger().snapshot()["patches"][patch.name]["targets"][
            f"{definition}:plan"]["reason"]
    finally:
        registry.revert_patch(patch)
    original = importlib.import_module(definition).plan
    assert user.plan is original and user.renamed is original and user.run(1) == 2


def test_a_module_imported_after_the_patch_gets_the_wrapper_and_revert_restores_it(tmp_path, monkeypatch):
    definition = write(tmp_path, monkeypatch, DEFINITION)
    module = importlib.import_module(definition)
    original = module.plan
    patch = function_patch(definition)
    registry.register_patch(patch)
    late = importlib.import_module(write(tmp_path, monkeypatch, f"from {definition} import plan\n"))
    assert late.plan(1) == 102
    registry.revert_patch(patch)
    assert late.plan is original and module.plan is original


def test_a_target_that_names_an_import_wraps_only_that_name(tmp_path, monkeypatch):
    definition = write(tmp_path, monkeypatch, DEFINITION)
    caller = write(tmp_path, monkeypatch, f"from {definition} import plan\n")
    bystander = importlib.import_module(write(tmp_path, monkeypatch, f"from {definition} import plan\n"))
    caller_module = importlib.import_module(caller)
    patch = function_patch(caller)  # "the name that module calls": defined elsewhere
    registry.register_patch(patch)
    try:
        assert caller_module.plan(1) == 102
        assert bystander.plan(1) == 2 and importlib.import_module(definition).plan(1) == 2
        assert f"{patch.name} {caller}:plan" not in get_ledger().snapshot()["facts"].get(registry.ALIASES_SECTION, {})
    finally:
        registry.revert_patch(patch)


def test_an_alias_rebound_by_someone_else_is_left_alone_on_revert(tmp_path, monkeypatch):
    definition = write(tmp_path, monkeypatch, DEFINITION)
    user = importlib.import_module(write(tmp_path, monkeypatch, f"from {definition} import plan\n"))
    patch = function_patch(definition)
    registry.register_patch(patch)

    def replacement(value):
        return -value

    user.plan = replacement
    registry.revert_patch(patch)
    assert user.plan is replacement


def test_a_method_target_scans_no_modules(tmp_path, monkeypatch):
    definition = write(tmp_path, monkeypatch, """
        class Runner:
            def plan(self, value):
                return value * 2

        bound_elsewhere = Runner.plan
    """)
    module = importlib.import_module(definition)
    target = registry.Target(module=definition, qualname="Runner.plan", wrapper=add_hundred, distribution=definition,
                             parameters=("self", "value"))
    patch = registry.Patch(name=f"alias_{uuid.uuid4().hex[:8]}", summary="alias test", targets=(target,))
    registry.register_patch(patch)
    try:
        assert module.Runner().plan(1) == 102
        assert module.bound_elsewhere(module.Runner(), 1) == 2  # a plain function object: not a module alias
    finally:
        registry.revert_patch(patch)
