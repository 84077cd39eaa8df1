"""releases.source and releases.shapes on small source trees written by each test (each with its own target)."""

from __future__ import annotations

import pathlib
import sys
import textwrap

import pytest

from kda_patches.registry import Target
from kda_patches.releases.shapes import (
    SHAPES,
    ShapeContext,
    check_shape,
    class_attribute,
    clears_by_mask,
    gathers,
    module_exists,
)
from kda_patches.releases.source import ReleaseSource


def write_tree(root: pathlib.Path, files: dict[str, str]) -> ReleaseSource:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return ReleaseSource(root)


def _noop(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def shape_of(source: ReleaseSource, name: str, module: str, qualname: str) -> tuple[bool, str]:
    target = Target(module, qualname, _noop, shapes=(name,))
    result = check_shape(name, source, target, source.resolve(module, qualname))
    return result.ok, result.evidence


def test_resolve_follows_imports_to_the_definition(tmp_path: pathlib.Path) -> None:
    source = write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/ops/__init__.py": "from .utils import clear as clear_states\n",
        "pkg/ops/utils.py": "def clear(ssm_states, has_initial_state):\n    pass\n",
        "pkg/layer.py": "from pkg.ops import clear_states\nimport pkg.ops.utils as u\n",
    })
    found = source.resolve("pkg.layer", "clear_states")
    assert found.kind == "function" and found.module == "pkg.ops.utils" and found.qualname == "clear"
    assert found.via == ("pkg.layer:clear_states", "pkg.ops:clear_states")
    assert found.relative_path == "pkg/ops/utils.py"
    assert source.parameters("pkg.layer", "clear_states") == ("ssm_states", "has_initial_state")
    assert source.resolve("pkg.layer", "u.clear").qualname == "clear"
    assert source.resolve("pkg.layer", "missing") is None
    assert source.resolve("pkg.absent", "x") is None
    assert "pkg" not in sys.modules


def test_methods_must_be_defined_by_the_class_itself(tmp_path: pathlib.Path) -> None:
    source = write_tree(tmp_path, {"m.py": """
        class Base:
            def _run_prefill(self, q, k):
                pass
        class Child(Base):
            flag = True
            @classmethod
            def make(cls, a, *rest, b=1, **extra):
                pass
        class Other(Base):
            def _run_prefill(self, q, k, v):
                pass
    """})
    assert source.resolve("m", "Child._run_prefill") is None  # inherited only, as registry.resolve_attribute
    assert source.parameters("m", "Other._run_prefill") == ("self", "q", "k", "v")
    assert source.parameters("m", "Child.make") == ("a", "rest", "b", "extra")  # bound classmethod: no cls
    assert [(c.name, c.bases) for c in source.classes_defining("m", "_run_prefill")] == [
        ("Base", ()), ("Other", ("Base",))]
    assert source.resolve("m", "Child.flag").kind == "assignment"


def test_first_binding_wins_as_in_static_check(tmp_path: pathlib.Path) -> None:
    source = write_tree(tmp_path, {"m.py": """
        try:
            from fast import f
        except ImportError:
            def f(a):
                pass
        if True:
            def g(y, z):
                pass
        def g(w):
            pass
    """})
    assert source.resolve("m", "f") is None and source.parameters("m", "f") is None  # ``fast`` is not shipped
    assert source.parameters("m", "g") == ("y", "z")
    assert [a.arg for a in source.resolve("m", "g").node.args.args] == ["y", "z"]


KIMI_LIKE = {"layer.py": """
    from utils import clear_ssm_states

    class Layer:
        def _run_prefill(self, recurrent_state, state_indices, has_initial_state):
            keep = state_indices >= 0
            state_indices = state_indices[keep]
            initial = recurrent_state[state_indices].contiguous()
            clear_ssm_states(initial, has_initial_state)
            recurrent_state[state_indices] = initial.to(recurrent_state.dtype)

        def _forward(self, x):
            conv_state, recurrent_state = self.kv_cache[:2]
            initial = gather_initial_states(recurrent_state, x, None)
            recurrent_state[x] = initial

        def _fork_native(self, recurrent_state, state_indices, has_initial_state):
            packed = self._copy.gather(recurrent_state, state_indices, has_initial_state)
            self._copy.scatter(recurrent_state, packed, state_indices)
""", "utils.py": "def clear_ssm_states(ssm_states, has_initial_state):\n    pass\n"}


@pytest.mark.parametrize(("shape", "qualname", "ok"), [
    ("gather:recurrent_state[state_indices]", "Layer._run_prefill", True),
    ("gather:recurrent_state[state_indices]", "Layer._fork_native", False),
    ("gather:recurrent_state[state_indices]", "Layer._forward", False),
    ("clear:clear_ssm_states(_, has_initial_state)", "Layer._run_prefill", True),
    ("clear:clear_ssm_states(_, has_initial_state)", "Layer._fork_native", False),
    ("scatter:recurrent_state[state_indices]=", "Layer._run_prefill", True),
    ("scatter:recurrent_state[state_indices]=", "Layer._forward", False),
    ("scatter:recurrent_state[...]=", "Layer._forward", True),
    ("scatter:recurrent_state[...]=", "Layer._fork_native", False),
    ("read:self.kv_cache", "Layer._forward", True),
    ("read:self.kv_cache", "Layer._run_prefill", False),
    ("gather:gather_initial_states(recurrent_state, ...)", "Layer._forward", True),
    ("gather:gather_initial_states(recurrent_state, ...)", "Layer._run_prefill", False),
])
def test_body_shapes(tmp_path: pathlib.Path, shape: str, qualname: str, ok: bool) -> None:
    source = write_tree(tmp_path, KIMI_LIKE)
    found, evidence = shape_of(source, shape, "layer", qualname)
    assert found is ok, evidence
    if ok:
        assert evidence.startswith("layer.py:")
    else:
        assert qualname in evidence


def test_gather_ignores_other_containers_and_stores(tmp_path: pathlib.Path) -> None:
    source = write_tree(tmp_path, {"m.py": """
        def f(recurrent_state, state_indices, other):
            other[state_indices]
            recurrent_state[state_indices] = 0
    """})
    context = ShapeContext(source, None, source.resolve("m", "f"))
    assert not gathers("recurrent_state", "state_indices")(context).ok
    assert gathers("other", "state_indices")(context).ok


def test_native_mask_clear(tmp_path: pathlib.Path) -> None:
    source = write_tree(tmp_path, {"m.py": """
        def native(ssm_state, idx, flags):
            initial_state = ssm_state[idx]
            initial_state[~flags, ...] = 0
        def not_negated(ssm_state, idx, flags):
            initial_state = ssm_state[idx]
            initial_state[flags, ...] = 0
        def other_value(ssm_state, idx, flags):
            initial_state = ssm_state[idx]
            initial_state[~flags] = 1
    """})
    check = clears_by_mask("initial_state", "flags")
    results = {q: check(ShapeContext(source, None, source.resolve("m", q))) for q in
               ("native", "not_negated", "other_value")}
    assert results["native"].ok and results["native"].evidence.endswith("initial_state[~flags, ...] = 0")
    assert not results["not_negated"].ok and not results["other_value"].ok


def test_shape_on_a_missing_target_is_missing(tmp_path: pathlib.Path) -> None:
    source = write_tree(tmp_path, KIMI_LIKE)
    ok, evidence = shape_of(source, "gather:recurrent_state[state_indices]", "layer", "Layer.absent")
    assert not ok and "layer:Layer.absent is not a function" in evidence


def test_release_level_shapes(tmp_path: pathlib.Path) -> None:
    source = write_tree(tmp_path, {"pkg/__init__.py": "", "pkg/plan.py": "", "pkg/k.py": """
        class A:
            _requires_kda_state_copy = True
        class B:
            _requires_kda_state_copy = False
    """})
    context = ShapeContext(source, None, None)
    assert module_exists("pkg.plan")(context).ok and not module_exists("pkg.nope")(context).ok
    assert class_attribute("pkg.k", "_requires_kda_state_copy", True)(context).evidence == \
        "pkg.k.A._requires_kda_state_copy = True"
    assert not class_attribute("pkg.k", "_requires_kda_state_copy", 1.5)(context).ok


def test_fork_plan_shape_needs_every_part(tmp_path: pathlib.Path) -> None:
    files = {
        "vllm_ascend/__init__.py": "", "vllm_ascend/ops/__init__.py": "",
        "vllm_ascend/ops/kda_state_copy_plan.py": "def initialize_kda_state_copy(ctx, n):\n    pass\n",
        "vllm_ascend/ops/kimi_kda.py": "class L:\n    _requires_kda_state_copy = True\n",
        "vllm_ascend/worker/__init__.py": "", "vllm_ascend/worker/v2/__init__.py": "",
        "vllm_ascend/worker/model_runner_v1.py":
            "class NPUModelRunner:\n    def initialize_kv_cache(self, c):\n        initialize_kda_state_copy(1, 2)\n",
        "vllm_ascend/worker/v2/model_runner.py":
            "class NPUModelRunner:\n    def initialize_kv_cache(self, c):\n        initialize_kda_state_copy(1, 2)\n",
    }
    assert check_shape("fork:kda_state_copy_plan", write_tree(tmp_path / "all", files)).ok
    without_v2_call = {**files, "vllm_ascend/worker/v2/model_runner.py":
                       "class NPUModelRunner:\n    def initialize_kv_cache(self, c):\n        pass\n"}
    result = check_shape("fork:kda_state_copy_plan", write_tree(tmp_path / "v2", without_v2_call))
    assert not result.ok and "initialize_kda_state_copy" in result.evidence


def test_unknown_shape_name_lists_the_known_ones(tmp_path: pathlib.Path) -> None:
    with pytest.raises(KeyError, match="unknown code shape 'nope'"):
        check_shape("nope", ReleaseSource(tmp_path))
    assert all(name == shape.name for name, shape in SHAPES.items())
