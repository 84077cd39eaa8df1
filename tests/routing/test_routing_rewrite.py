"""The rewritten twin of a seam function (issue 19): what the rewrite accepts, what it refuses, and the direct
route's run-time checks -- each decided by a body (``rewrite_dummies``) that differs from a valid one in the
one place the rule looks at.
"""

from __future__ import annotations

import functools
import importlib
import sys

import pytest
import torch

from kda_patches.ledger import get_ledger
from kda_patches.registry import Patch, Target, register_patch, revert_patch
from kda_patches.routing.proof import PLAN_ATTRIBUTE, PlanNotPublished, StateCopyBypassed
from kda_patches.routing.rewrite import RewriteRefused, rewrite_seam_function
from kda_patches.routing.seams import (
    CLEAR_FUNCTION,
    CLEAR_NATIVE,
    Argument,
    FinalFrom,
    KVCacheSlot,
    Seam,
    capture_section,
)
from kda_patches.routing.wrappers import SeamWrapper

pytestmark = pytest.mark.rewrite_mechanism

SECTION = "rewrite_tests"
SEAM = Seam("rewrite test seam", SECTION, state=KVCacheSlot(1), indices=Argument(0, "indices"),
            flags=Argument(1, "flags"), clear=CLEAR_NATIVE, final=FinalFrom(1, function="chunk"))
MODULE = "rewrite_dummies"


class ContractPlan:
    """A plan stand-in that holds the route to the real plans' contract: flags are None or a 1-D bool vector
    with one flag per index on the cache's device; a scatter source has a prepared dtype."""

    final_dtypes = (torch.float32,)

    def __init__(self) -> None:
        self.sources: list[torch.Tensor] = []
        self.gathered: list[torch.Tensor] = []

    def gather(self, state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
        if flags is not None:
            assert isinstance(flags, torch.Tensor) and flags.dtype is torch.bool and flags.dim() == 1
            assert flags.shape == indices.shape and flags.device == state.device
        self.gathered.append(state)
        packed = torch.Tensor.__getitem__(state, indices).clone()
        if flags is not None:
            packed[~flags] = 0
        return packed

    def scatter(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor) -> None:
        assert packed.dtype is state.dtype or packed.dtype in self.final_dtypes
        self.sources.append(packed)
        torch.Tensor.__setitem__(state, indices, packed.to(state.dtype))


FUNCTION_SEAM = Seam("rewrite test function-clear seam", SECTION, state=KVCacheSlot(1), indices=Argument(0, "indices"),
                     flags=Argument(1, "flags"), clear=CLEAR_FUNCTION, clear_function="clear_rows",
                     final=FinalFrom(1, function="chunk"))
# vllm-ascend 0.30's form: the fork's own gather/scatter kernels by name, and a CPU branch that indexes
KERNEL_SEAM = Seam("rewrite test kernel seam", SECTION, state=KVCacheSlot(1), indices=Argument(0, "indices"),
                   flags=Argument(1, "flags"), clear=CLEAR_FUNCTION, clear_function="clear_rows",
                   gather_function="gather_rows", scatter_function="scatter_rows")
SEAM_OF = {"FunctionClear": FUNCTION_SEAM, "KernelCopies": KERNEL_SEAM, "KernelCopiesOtherKeyword": KERNEL_SEAM}


def load(cls: str | None) -> tuple[object, Patch | None]:
    """Import :mod:`rewrite_dummies` afresh, with ``cls.forward`` wrapped under its seam when given."""
    sys.modules.pop(MODULE, None)
    patch = None
    if cls is not None:
        seam = SEAM_OF.get(cls, SEAM)
        patch = Patch(f"rewrite_{cls}", "rewrite test record", (Target(MODULE, f"{cls}.forward", SeamWrapper(seam)),))
        register_patch(patch)
    return importlib.import_module(MODULE), patch


@pytest.fixture
def world():
    """Return ``make(cls, patched, dtype)`` -> ``(module, layer, plan)``; every record is reverted afterwards."""
    patches: list[Patch] = []

    def make(cls: str, patched: bool, dtype: torch.dtype = torch.bfloat16, publish: bool = True):
        while patches:  # one world at a time: a record of the same name would find itself applied already
            revert_patch(patches.pop())
        module, patch = load(cls if patched else None)
        if patch is not None:
            patches.append(patch)
        layer = getattr(module, cls)()
        cache = torch.randn(6, 2, 4, 4, generator=torch.Generator().manual_seed(3)).to(dtype)
        layer.kv_cache = (torch.zeros(6, 3, dtype=torch.bfloat16), cache)
        plan = ContractPlan()
        if patched and publish:
            setattr(layer, PLAN_ATTRIBUTE, plan)
        return module, layer, plan

    yield make
    for patch in reversed(patches):
        revert_patch(patch)
    sys.modules.pop(MODULE, None)


def batch(count: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    indices = torch.tensor([4, 1, 3, 0, 5][:count])
    flags = torch.tensor([True, False, True, False, True][:count])
    return indices, flags


def outcome(layer, indices, flags) -> tuple:
    """``(output, cache)`` of one call, or ``(exception type, cache)`` when it raised."""
    try:
        result = layer.forward(indices, flags)
    except Exception as error:  # the exception type is the outcome compared
        result = type(error)
    return result, layer.kv_cache[1].clone()


def same(a: tuple, b: tuple) -> bool:
    equal = a[0] is b[0] if isinstance(a[0], type) else isinstance(b[0], torch.Tensor) and torch.equal(a[0], b[0])
    return equal and torch.equal(a[1], b[1])


def counted() -> dict[str, int]:
    return dict(get_ledger().counters(SECTION))


def delta(before: dict[str, int]) -> dict[str, int]:
    after = counted()
    return {key: after.get(key, 0) - before.get(key, 0) for key in after if after.get(key, 0) != before.get(key, 0)}


def mechanism(cls: str) -> dict:
    return get_ledger().snapshot()["facts"][SECTION][f"routing {MODULE}:{cls}.forward"]


def ab(world, cls: str, dtype: torch.dtype, indices, flags) -> tuple[tuple, tuple, dict[str, int], ContractPlan]:
    _, layer, _ = world(cls, False, dtype)
    baseline = outcome(layer, indices, flags)
    _, layer, plan = world(cls, True, dtype)
    before = counted()
    patched = outcome(layer, indices, flags)
    return baseline, patched, delta(before), plan


@pytest.mark.parametrize("cls", ["Valid", "TransposedLastTwo", "PassthroughDecorated"])
def test_a_declared_body_runs_its_twin_exactly(world, strict, cls):
    baseline, patched, counts, plan = ab(world, cls, torch.bfloat16, *batch())
    assert same(baseline, patched)
    assert mechanism(cls)["mechanism"] == "rewrite", mechanism(cls)
    folded = cls != "TransposedLastTwo"  # that one casts a transposed copy: an expression, left as written
    assert counts == {"calls_seen": 1, "calls_routed": 1, **({"casts_folded": 1} if folded else {})}
    assert [source.dtype for source in plan.sources] == [torch.float32 if folded else torch.bfloat16]


def test_the_twin_replaces_the_copy_lines_and_nothing_else():
    module, _ = load(None)
    replaced = rewrite_seam_function(vars(module.Valid)["forward"], SEAM).replaced
    first = module.Valid.forward.__code__.co_firstlineno
    assert replaced == [f"line {first + 3}: gather with the clear folded",
                        f"line {first + 4}: clear removed (folded into the gather)",
                        f"line {first + 6}: scatter with the cast to the cache dtype folded"]


REFUSALS = [
    ("ClearWithOne", "not directly followed by the declared clear"),
    ("ClearNotNext", "not directly followed by the declared clear"),
    ("ClearReadsGathered", "not directly followed by the declared clear"),
    ("ReadsARow", "also indexed as ssm_state[0]"),
    ("TransposedOtherAxes", "no one name is both"),
    ("SlicedGather", "not one index vector"),
    ("NoScatter", "no one name is both"),
    ("InPlaceOperator", "updated in place with an operator"),
    ("UsesSuper", "closes over __class__"),
    ("WrapperDecorated", "wrapped by a decorator"),
    ("NameMangled", "__scale is name-mangled"),
    ("TakesRouteName", "already has a parameter named _kda_route"),
]


@pytest.mark.parametrize(("cls", "reason"), REFUSALS, ids=[cls for cls, _ in REFUSALS])
def test_a_body_that_is_not_the_declared_seam_is_refused_with_the_reason(world, cls, reason):
    module, _ = load(None)
    with pytest.raises(RewriteRefused, match=reason.replace("[", r"\[").replace("]", r"\]")):
        rewrite_seam_function(vars(getattr(module, cls))["forward"], SEAM)
    world(cls, True)  # wrapped: the seam routes through the alias, and the ledger says why
    assert mechanism(cls)["mechanism"] == "alias" and reason in mechanism(cls)["reason"], mechanism(cls)


def test_a_clear_with_another_value_runs_as_the_fork_wrote_it(world, lenient):
    baseline, patched, _, _ = ab(world, "ClearWithOne", torch.float32, *batch())
    assert same(baseline, patched)  # rows without an initial state hold ones, as the fork wrote


@pytest.mark.parametrize(("cls", "dtype"), [("CastToOther", torch.float32), ("CastToOtherTensorsDtype", torch.float32),
                                            ("CastToDevice", torch.bfloat16)])
def test_a_cast_to_anything_but_the_cache_dtype_is_not_folded(world, lenient, cls, dtype):
    """Storing a source of another dtype makes torch's index_put raise; folding the cast would hide that."""
    baseline, patched, _, plan = ab(world, cls, dtype, *batch())
    assert baseline[0] is RuntimeError and same(baseline, patched)
    assert not plan.sources
    assert "folded" not in mechanism(cls)["replaced"][-1]


def test_a_cast_of_an_expression_stays_as_written(world, strict):
    baseline, patched, counts, plan = ab(world, "CastOfAnExpression", torch.bfloat16, *batch())
    assert same(baseline, patched)
    assert counts == {"calls_seen": 1, "calls_routed": 1} and plan.sources[0].dtype is torch.bfloat16


def test_another_tensor_under_the_cache_name_is_copied_natively_and_reported(world, lenient):
    baseline, patched, counts, plan = ab(world, "RebindsTheCache", torch.bfloat16, *batch(3))
    assert same(baseline, patched)
    assert counts == {"calls_seen": 1, "calls_bypassed": 1} and not plan.sources and not plan.gathered
    _, layer, _ = world("RebindsTheCache", True)
    before = counted()
    layer.forward(*batch(2))  # the cache itself under that name: routed
    assert delta(before) == {"calls_seen": 1, "calls_routed": 1, "casts_folded": 1}


def test_another_tensor_under_the_cache_name_raises_under_strict(world, strict):
    _, layer, _ = world("RebindsTheCache", True)
    with pytest.raises(StateCopyBypassed, match="rewritten seam"):
        layer.forward(*batch(3))


FLAGS = {
    "a numpy mask": lambda flags: flags.numpy(),
    "an int64 tensor": lambda flags: flags.long(),
    "a 2-D mask": lambda flags: flags[:, None].expand(-1, 2).contiguous(),
    "one flag too many": lambda flags: torch.cat([flags, flags[:1]]),
}


@pytest.mark.parametrize("name", FLAGS)
def test_flags_the_plan_cannot_take_are_cleared_as_the_fork_wrote(world, lenient, name):
    indices, flags = batch()
    baseline, patched, counts, _ = ab(world, "Valid", torch.float32, indices, FLAGS[name](flags))
    assert same(baseline, patched), (baseline[0], patched[0])
    if baseline[0] is not IndexError:
        assert counts == {"calls_seen": 1, "calls_routed": 1}, counts


def test_a_nested_seam_call_runs_as_written_and_the_outer_call_routes(world, strict):
    baseline, patched, counts, plan = ab(world, "CallsItselfFirst", torch.bfloat16, *batch())
    assert same(baseline, patched)
    assert counts == {"calls_seen": 1, "calls_routed": 1, "casts_folded": 1}
    assert len(plan.gathered) == len(plan.sources) == 1  # the nested call's copies were torch's own


def test_a_call_that_copies_nothing_is_bypassed(world, lenient):
    _, layer, _ = world("PrefillBranch", True)
    before = counted()
    layer.forward(batch()[0], None)
    assert delta(before) == {"calls_seen": 1, "calls_bypassed": 1}
    assert "0 gather(s) and 0 scatter(s)" in get_ledger().snapshot()["facts"][SECTION]["last_bypass"]["reason"]


def test_a_call_without_a_plan_is_refused_before_any_of_it_runs(world, strict):
    module, layer, _ = world("Valid", True, publish=False)
    runs, cache, before = module.BODY_RUNS["count"], layer.kv_cache[1].clone(), counted()
    with pytest.raises(PlanNotPublished, match="no published state-copy plan"):
        layer.forward(*batch())
    assert module.BODY_RUNS["count"] == runs and torch.equal(layer.kv_cache[1], cache)
    assert delta(before) == {"calls_seen": 1, "calls_refused": 1}


def test_a_failing_call_is_counted_failed_and_raises(world, strict):
    _, layer, _ = world("Raises", True)
    before = counted()
    with pytest.raises(ValueError, match="chunk kernel failed"):
        layer.forward(*batch())
    assert delta(before) == {"calls_seen": 1, "calls_failed": 1}


def test_a_call_through_the_class_runs_the_twin(world, strict):
    module, layer, plan = world("Valid", True)
    before = counted()
    module.Valid.forward(layer, *batch())
    assert delta(before) == {"calls_seen": 1, "calls_routed": 1, "casts_folded": 1} and plan.sources


def test_revert_forgets_the_twin_and_a_new_registration_reuses_it_only_for_the_same_code():
    """A/B switching in one process re-wraps the same function: its twin (warm) is reused, unless the function's
    code object was replaced since (then the twin is built again from the source)."""
    module, patch = load("Valid")
    wrapper = patch.targets[0].wrapper
    original = vars(module.Valid)["forward"].__wrapped__
    try:
        assert list(wrapper.rewrites) == [original]
        first = wrapper.rewrites[original]
    finally:
        revert_patch(patch)
    assert wrapper.rewrites == {}
    register_patch(patch)
    try:
        assert wrapper.rewrites == {original: first}
    finally:
        revert_patch(patch)
    original.__code__ = original.__code__.replace()  # an equal but new code object: not what the twin came from
    register_patch(patch)
    try:
        assert list(wrapper.rewrites) == [original] and wrapper.rewrites[original] is not first
    finally:
        revert_patch(patch)
        sys.modules.pop(MODULE, None)


@pytest.mark.alias_mechanism
def test_routing_alias_keeps_every_seam_on_the_alias(world, strict):
    baseline, patched, counts, _ = ab(world, "Valid", torch.bfloat16, *batch())
    assert same(baseline, patched)
    assert mechanism("Valid") == {"seam": SEAM.name, "mechanism": "alias", "reason": "KDA_PATCHES_ROUTING=alias"}
    assert counts == {"calls_seen": 1, "calls_routed": 1}


@pytest.mark.both_mechanisms
def test_a_clear_after_a_transpose_of_the_row_axis_is_never_taken_for_the_folded_one(world, strict):
    """``S[I].transpose(0, 1)`` moves the rows: its ``[~flags, ...] = 0`` clears heads. The rewrite refuses the
    body; the alias must not elide that clear (it keeps its tag only through a swap of the last two axes)."""
    _, layer, _ = world("TransposedOtherAxes", True, torch.float32)
    with pytest.raises(StateCopyBypassed, match="clear"):
        layer.forward(*batch(2))  # two rows, two heads: the clear's mask fits either axis


def test_a_function_clear_with_flags_the_plan_cannot_take_runs_the_forks_function(world, strict):
    """Non-foldable flags: the removed ``clear_rows(initial, flags)`` runs through the fork's own name."""
    indices, flags = batch()
    module, layer, _ = world("FunctionClear", False, torch.float32)
    runs = module.CLEAR_ROWS["count"]
    baseline = outcome(layer, indices, flags.long())
    assert module.CLEAR_ROWS["count"] == runs + 1
    module, layer, _ = world("FunctionClear", True, torch.float32)
    before, runs = counted(), module.CLEAR_ROWS["count"]
    patched = outcome(layer, indices, flags.long())  # int flags: ~flags would index rows, not mask them
    assert same(baseline, patched) and module.CLEAR_ROWS["count"] == runs + 1
    assert delta(before) == {"calls_seen": 1, "calls_routed": 1}
    layer.forward(indices, flags)  # bool flags: folded, the function is not called
    assert module.CLEAR_ROWS["count"] == runs + 1


def test_without_a_declared_final_the_cast_stays_as_written():
    module, _ = load(None)
    seam = Seam("no final", SECTION, state=KVCacheSlot(1), clear=CLEAR_NATIVE)
    replaced = rewrite_seam_function(vars(module.Valid)["forward"], seam).replaced
    assert replaced[-1].endswith(": scatter"), replaced


def test_a_function_without_source_or_not_plain_is_refused():
    namespace: dict = {}
    exec("def forward(self, indices, flags):\n    return None\n", namespace)  # a function with no file
    with pytest.raises(RewriteRefused, match="no source"):
        rewrite_seam_function(namespace["forward"], SEAM)
    module, patch = load("Valid")
    try:
        with pytest.raises(RewriteRefused, match="not a plain function"):
            rewrite_seam_function(vars(module.Valid)["forward"], SEAM)  # the wrapt proxy, not the function
    finally:
        revert_patch(patch)
        sys.modules.pop(MODULE, None)


def test_a_rewrite_error_leaves_the_seam_on_the_alias_and_says_so(world, strict, monkeypatch):
    from kda_patches.routing import rewrite

    def broken(function, seam):
        raise KeyError("a rewrite bug")

    monkeypatch.setattr(rewrite, "rewrite_seam_function", broken)
    baseline, patched, counts, _ = ab(world, "Valid", torch.bfloat16, *batch())
    assert same(baseline, patched) and counts == {"calls_seen": 1, "calls_routed": 1}
    assert mechanism("Valid")["mechanism"] == "alias"
    assert mechanism("Valid")["reason"] == "rewrite failed: KeyError: 'a rewrite bug'"


def test_conformance_predicts_the_mechanism_from_a_releases_source():
    """The static half, on a file's ``def`` node (as conformance reads a release): same verdicts, node unchanged."""
    import ast
    import inspect

    from kda_patches.routing.rewrite import predict_mechanism

    module, _ = load(None)
    tree = ast.parse(inspect.getsource(module))
    nodes = {node.name: next(item for item in node.body if isinstance(item, ast.FunctionDef))
             for node in tree.body if isinstance(node, ast.ClassDef) and node.name in ("Valid", "ClearWithOne")}
    before = ast.dump(nodes["Valid"])
    valid = predict_mechanism(nodes["Valid"], SEAM, "Valid.forward")
    assert valid["mechanism"] == "rewrite" and valid["replaced"][0].startswith(f"line {nodes['Valid'].lineno + 3}:")
    assert ast.dump(nodes["Valid"]) == before
    refused = predict_mechanism(nodes["ClearWithOne"], SEAM, "ClearWithOne.forward")
    assert refused["mechanism"] == "alias" and "declared clear" in refused["reason"]
    assert predict_mechanism(tree.body[0], SEAM, "x")["mechanism"] == "alias"


def test_a_source_file_changed_after_import_is_refused(tmp_path):
    """The twin is compiled from the file; when the file no longer compiles to the loaded bytecode it would not
    be the function that runs."""
    import importlib.util
    import inspect
    import os

    module, _ = load(None)
    source = inspect.getsource(module)
    path = tmp_path / "changed_layer.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("changed_layer", path)
    changed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(changed)
    function = vars(changed.Valid)["forward"]
    assert rewrite_seam_function(function, SEAM).replaced  # unchanged file: rewritten
    path.write_text(source.replace("final = initial.float() * 0.5 + 1\n        ssm_state[indices] = final.to(ssm_"
                                   "state.dtype)\n        return initial.float()\n\n\nclass ClearWithOne",
                                   "final = initial.float() * 0.25 + 1\n        ssm_state[indices] = final.to(ssm_"
                                   "state.dtype)\n        return initial.float()\n\n\nclass ClearWithOne", 1))
    stat = path.stat()
    os.utime(path, (stat.st_atime, stat.st_mtime + 5))  # linecache re-reads a file whose mtime changed
    with pytest.raises(RewriteRefused, match="does not compile to the loaded function"):
        rewrite_seam_function(function, SEAM)


@pytest.mark.parametrize("cls", ["ClearNotNext", "ClearReadsGathered"])
def test_a_clear_the_rewrite_cannot_fold_is_the_forks_under_the_alias_too(world, strict, cls):
    """Refused because the clear is not the folded form: the alias must not fold it speculatively either."""
    baseline, patched, counts, _ = ab(world, cls, torch.float32, *batch())
    assert same(baseline, patched)
    assert counts == {"calls_seen": 1, "calls_routed": 1}
    assert mechanism(cls)["clear_folded"] is False


class CPUGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` (the one CUDA call of a breakable capture): nothing to record on the
    CPU, so a graph segment replays nothing and only the eager breaks run again."""

    def capture_begin(self, pool=None) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def replay(self) -> None:
        pass


@pytest.fixture
def breakable(tmp_path, monkeypatch):
    """vLLM's own (installed) ``breakable_cudagraph`` turned on, its CUDA-graph calls stood in, and
    :mod:`rewrite_dummies` copied as ``decorated_dummies`` with ``Valid.forward`` under ``@eager_break_during_capture``.
    Returns ``(breakable_cudagraph module, decorated module name)``."""
    from vllm.compilation import breakable_cudagraph

    monkeypatch.setattr(breakable_cudagraph, "is_breakable_cudagraph_enabled", lambda *args: True)
    monkeypatch.setattr(breakable_cudagraph, "weak_ref_tensor", lambda tensor: tensor)  # a CUDA op: the tensor
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CPUGraph)
    module, _ = load(None)
    decorator_import = "from vllm.compilation.breakable_cudagraph import eager_break_during_capture\n"
    text = inspect_source(module).replace("from __future__ import annotations\n",
                                          f"from __future__ import annotations\n\n{decorator_import}", 1)
    body = "    def forward(self, indices, flags):\n        BODY_RUNS"
    (tmp_path / "decorated_dummies.py").write_text(text.replace(body, f"    @eager_break_during_capture\n{body}", 1))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield breakable_cudagraph, "decorated_dummies"
    sys.modules.pop("decorated_dummies", None)


def capture_and_replay(breakable_module, name: str, patched: bool, dtype: torch.dtype, replays: int) -> tuple:
    """Capture one ``Valid.forward`` call under vLLM's breakable capture, replay it ``replays`` times; return
    ``(capture-time output, cache after each replay, counters grown, capture counters grown, wrapper)``."""
    sys.modules.pop(name, None)
    patch = Patch(f"rewrite_breakable_{patched}", "rewrite test record",
                  (Target(name, "Valid.forward", SeamWrapper(SEAM)),))
    if patched:
        register_patch(patch)
    try:
        module = importlib.import_module(name)
        layer = module.Valid()
        cache = torch.randn(6, 2, 4, 4, generator=torch.Generator().manual_seed(5)).to(dtype)
        layer.kv_cache = (torch.zeros(6, 3, dtype=torch.bfloat16), cache)
        if patched:
            setattr(layer, PLAN_ATTRIBUTE, ContractPlan())
        before = get_ledger().counters(SECTION)
        captured_before = get_ledger().counters(capture_section(SECTION))
        indices, flags = batch()
        with breakable_module.BreakableCUDAGraphCapture() as capture:
            first = layer.forward(indices, flags)
        assert capture.num_eager_breaks == 1, capture
        caches = []
        for _ in range(replays):
            capture.replay()
            caches.append(layer.kv_cache[1].clone())
        grew_by = {key: get_ledger().counters(SECTION).get(key, 0) - before.get(key, 0)
                   for key in ("calls_seen", "calls_routed", "calls_bypassed")}
        captured = {key: get_ledger().counters(capture_section(SECTION)).get(key, 0) - captured_before.get(key, 0)
                    for key in ("calls_seen", "calls_routed", "calls_bypassed")}
        return first, caches, grew_by, captured, vars(module.Valid)["forward"]
    finally:
        if patched:
            revert_patch(patch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_seam_under_vllms_eager_break_is_routed_at_capture_and_in_every_replay(breakable, strict, dtype):
    """vLLM wraps the Kimi ``_forward`` seams with ``eager_break_during_capture``: a capture records a closure over
    the undecorated function and replays *that*. The seam's wrapper re-applies the decorator to its routed entry,
    so the capture records the routed call: the capture-time run is routed and counted in the capture section, and
    each replay is routed and counted as a call -- with the unpatched function's outputs and cache bytes."""
    breakable_module, name = breakable
    base = capture_and_replay(breakable_module, name, False, dtype, replays=3)
    patched = capture_and_replay(breakable_module, name, True, dtype, replays=3)
    assert torch.equal(base[0], patched[0])
    assert all(torch.equal(a, b) for a, b in zip(base[1], patched[1], strict=True))
    assert patched[2] == {"calls_seen": 3, "calls_routed": 3, "calls_bypassed": 0}  # the three replays
    assert patched[3] == {"calls_seen": 1, "calls_routed": 1, "calls_bypassed": 0}  # the capture-time run
    routing = get_ledger().snapshot()["facts"][SECTION][f"routing {name}:Valid.forward"]
    assert routing["mechanism"] == "rewrite" and "eager_break_during_capture re-applied" in routing["eager_break"]


def test_the_eager_break_is_read_from_the_function_object(breakable):
    """:func:`find_eager_break` names the decorator, its module and the undecorated function only for a wrapper
    the declared decorator made; the decorated wrapper itself is never rewritten (it closes over ``fn``)."""
    from kda_patches.routing.rewrite import find_eager_break

    breakable_module, name = breakable
    sys.modules.pop(name, None)
    module = importlib.import_module(name)
    wrapper = vars(module.Valid)["forward"]
    found = find_eager_break(wrapper)
    assert found is not None and found.decorator is breakable_module.eager_break_during_capture
    assert found.inner is wrapper.__wrapped__ and found.name.endswith("breakable_cudagraph.eager_break_during_capture")
    with pytest.raises(RewriteRefused, match="closes over"):
        rewrite_seam_function(wrapper, SEAM)
    assert find_eager_break(wrapper.__wrapped__) is None  # the plain function
    impostor = functools.wraps(wrapper.__wrapped__)(lambda *args, **kwargs: None)
    assert find_eager_break(impostor) is None  # same __wrapped__, but not the decorator's wrapper
    # the declared wrapper's code, but its closure calls another function than its __wrapped__
    forged = breakable_module.eager_break_during_capture(lambda *args: None)
    forged.__wrapped__ = wrapper.__wrapped__
    assert find_eager_break(forged) is None


def inspect_source(module) -> str:
    import inspect

    return inspect.getsource(module)


def kernel_outcome(world, patched: bool, dtype: torch.dtype, branch: str, **options) -> tuple:
    """``(outcome, counters delta, plan, fork kernel runs)`` of one ``KernelCopies.forward`` call."""
    module, layer, plan = world("KernelCopies", patched, dtype)
    if "final_dtypes" in options:
        plan.final_dtypes = options.pop("final_dtypes")
    runs, before = dict(module.KERNEL_RUNS), counted()
    indices, flags = batch()
    try:
        result = layer.forward(indices, flags, branch, **options)
    except Exception as error:  # the exception type is the outcome compared
        result = type(error)
    ran = {key: module.KERNEL_RUNS[key] - runs[key] for key in runs}
    return (result, layer.kv_cache[1].clone()), delta(before), plan, ran


@pytest.mark.parametrize(("branch", "options", "folded"), [
    ("store_cast", {}, 1), ("gather_dtype", {"gather_dtype": torch.bfloat16}, 0),
    ("gather_dtype", {"gather_dtype": None}, 0), ("index", {}, 0)])
def test_the_forks_kernel_calls_and_its_indexing_branch_go_through_the_plan(world, strict, branch, options, folded):
    """Every branch of the 0.30 form is routed: the kernels' calls by name, the CPU branch's index copies."""
    baseline, _, _, ran = kernel_outcome(world, False, torch.bfloat16, branch, **options)
    assert ran == ({"gather": 0, "scatter": 0} if branch == "index" else {"gather": 1, "scatter": 1})
    patched, counts, plan, ran = kernel_outcome(world, True, torch.bfloat16, branch, **options)
    assert same(baseline, patched)
    assert ran == {"gather": 0, "scatter": 0}, "a fork kernel ran although the call was routed"
    assert counts == {"calls_seen": 1, "calls_routed": 1, **({"casts_folded": 1} if folded else {})}
    assert len(plan.gathered) == 1 and len(plan.sources) == 1
    assert mechanism("KernelCopies")["mechanism"] == "rewrite", mechanism("KernelCopies")


def test_a_kernel_gather_into_another_dtype_runs_the_forks_kernel_and_is_bypassed(world, lenient):
    """``output_dtype`` other than the cache's: the plan gathers in the cache dtype only, so the fork's runs."""
    baseline, _, _, _ = kernel_outcome(world, False, torch.bfloat16, "gather_dtype", gather_dtype=torch.float32)
    patched, counts, plan, ran = kernel_outcome(world, True, torch.bfloat16, "gather_dtype",
                                                gather_dtype=torch.float32)
    assert same(baseline, patched) and ran["gather"] == 1 and not plan.gathered
    assert counts == {"calls_seen": 1, "calls_bypassed": 1}


def test_a_kernel_scatter_of_an_unprepared_dtype_runs_the_forks_kernel_and_is_bypassed(world, lenient):
    baseline, _, _, _ = kernel_outcome(world, False, torch.bfloat16, "store_cast")
    patched, counts, plan, ran = kernel_outcome(world, True, torch.bfloat16, "store_cast", final_dtypes=())
    assert same(baseline, patched) and ran == {"gather": 0, "scatter": 1} and not plan.sources
    assert counts == {"calls_seen": 1, "calls_bypassed": 1}


def test_a_kernel_gather_with_another_keyword_is_not_the_declared_form():
    module, _ = load(None)
    with pytest.raises(RewriteRefused, match=r"found 0 gather\(s\) and 1 scatter\(s\)"):
        rewrite_seam_function(vars(module.KernelCopiesOtherKeyword)["forward"], KERNEL_SEAM)


def test_a_gather_function_seam_without_a_scatter_function_leaves_index_gathers_to_the_refusal():
    """Kimi Linear's form (a gather function, index scatter): an index gather there is not one of its lines."""
    module, _ = load(None)
    seam = Seam("gather function only", SECTION, state=KVCacheSlot(1), clear=CLEAR_FUNCTION,
                clear_function="clear_rows", gather_function="gather_rows")
    with pytest.raises(RewriteRefused, match=r"also indexed as ssm_state\[indices\]"):
        rewrite_seam_function(vars(module.KernelCopies)["forward"], seam)
    replaced = rewrite_seam_function(vars(module.KernelCopies)["forward"], KERNEL_SEAM).replaced
    assert [line.split(": ", 1)[1] for line in replaced] == [
        "gather_rows call", "scatter_rows call", "gather_rows call (output_dtype= checked per call)",
        "scatter_rows call", "gather with the clear folded", "clear removed (folded into the gather)", "scatter"]


def test_a_kernel_seam_on_the_alias_is_reported_bypassed_and_its_routing_fact_warns(world, lenient, monkeypatch):
    """No alias routes the fork's kernel calls: where the rewrite is refused (a release whose source is not the
    declared shape, simulated here), every prefill runs them and is reported bypassed, and the fact warns."""
    from kda_patches.routing import rewrite

    def refused(original, seam):
        raise RewriteRefused("simulated: the source is not the declared seam")

    monkeypatch.setattr(rewrite, "build_twin", refused)
    baseline, _, _, _ = kernel_outcome(world, False, torch.bfloat16, "store_cast")
    patched, counts, plan, ran = kernel_outcome(world, True, torch.bfloat16, "store_cast")
    assert same(baseline, patched) and ran == {"gather": 1, "scatter": 1} and not plan.sources
    assert counts == {"calls_seen": 1, "calls_bypassed": 1}
    fact = mechanism("KernelCopies")
    assert fact["mechanism"] == "alias" and "reported bypassed" in fact["warning"], fact


@pytest.mark.alias_mechanism
def test_alias_routing_is_refused_only_where_no_alias_routes_the_declared_scatter_function(world, strict, routing):
    """``KDA_PATCHES_ROUTING=alias`` on a seam declaring a scatter function (vLLM 0.34's ``scatter_states``): the
    alias cannot route it (upstream's warmed ops would get its tensor subclass, every call bypassed), so the twin
    routes it and the fact says alias was refused; a seam without one keeps the alias that was asked for."""
    assert routing == "alias"
    baseline, _, _, _ = kernel_outcome(world, False, torch.bfloat16, "store_cast")
    patched, counts, _, ran = kernel_outcome(world, True, torch.bfloat16, "store_cast")
    assert same(baseline, patched) and ran == {"gather": 0, "scatter": 0}
    assert counts == {"calls_seen": 1, "calls_routed": 1, "casts_folded": 1}
    fact = mechanism("KernelCopies")
    assert fact["mechanism"] == "rewrite" and "KDA_PATCHES_ROUTING=alias refused" in fact["alias_refused"]
    world("Valid", True)
    fact = mechanism("Valid")
    assert fact["mechanism"] == "alias" and "alias_refused" not in fact
