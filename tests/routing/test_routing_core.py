"""The shared routing core on dummy seams: clear folding (native, function, transposed), gather functions,
prefill gating, the per-call proof (including issue 12's two surviving mutants), the shared startup.

Baseline = :mod:`routing_dummies` imported with no record; patched = the same module imported afresh with the
record registered (post-import hooks), plans published by the dummy runner's startup hook. Outputs and every
byte of the page-gapped caches (gaps and offset poisoned) must be equal.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from kda_patches.ledger import get_ledger
from kda_patches.patches import gdn_state_copy, kimi_prefill
from kda_patches.registry import Patch, Target
from kda_patches.routing.alias import PackedStates
from kda_patches.routing.proof import PLAN_ATTRIBUTE, StateCopyBypassed
from kda_patches.routing.seams import capture_section
from kda_patches.routing.wrappers import SeamWrapper, wrap_clear, wrap_gather

KIMI, GDN = kimi_prefill.LEDGER_PATH, gdn_state_copy.LEDGER_PATH
SEAMS = {  # class -> (method, seam declaration)
    "FunctionClearLayer": ("_run_prefill", kimi_prefill.ASCEND_SEAM),
    "NoClearLayer": ("_run_prefill", kimi_prefill.ASCEND_SEAM),
    "OtherIndexLayer": ("_run_prefill", kimi_prefill.ASCEND_SEAM),
    "NativeClearLayer": ("_forward_core", gdn_state_copy.QWEN_SEAM),
    "ContiguousNativeClearLayer": ("_forward_core", gdn_state_copy.OLMO_SEAM),
    "TransposeLayer": ("_forward_core", gdn_state_copy.ASCEND_SEAM),
    "GatherFunctionLayer": ("_forward", gdn_state_copy.KIMI_GDN_SEAM),
}


def record(name: str, classes: tuple[str, ...], startup: object = kimi_prefill.wrap_initialize_kv_cache) -> Patch:
    """A record wrapping the dummy classes' seams, the dummy clear/gather functions and the runner's startup."""
    targets = [Target("routing_dummies", f"{cls}.{SEAMS[cls][0]}", SeamWrapper(SEAMS[cls][1])) for cls in classes]
    targets += [Target("routing_dummies", "clear_ssm_states", wrap_clear),
                Target("routing_dummies", "gather_initial_states", wrap_gather),
                Target("routing_dummies", "Runner.initialize_kv_cache", startup)]
    return Patch(name, "routing-core test record", tuple(targets))


def batch(rows: int, count: int, index_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(rows, generator=generator)[:count].to(index_dtype)
    flags = torch.rand(count, generator=generator) < 0.5
    flags[0], flags[-1] = True, False  # both kinds in every batch
    return indices, flags


def call(module, layer, indices: torch.Tensor, flags: torch.Tensor, num_prefills: int = 1) -> torch.Tensor:
    """Run one call of the layer's seam the way its fork is called; return its output."""
    if hasattr(layer, "_run_prefill"):
        return layer._run_prefill(None, None, None, None, None, layer.kv_cache[1], indices, flags, None)
    from vllm.forward_context import ForwardContext, override_forward_context

    metadata = module.Metadata(num_prefills=num_prefills, num_decodes=0 if num_prefills else 2,
                               prefill_state_indices=indices, prefill_has_initial_state=flags,
                               non_spec_state_indices_tensor=indices, has_initial_state=flags)
    out = torch.zeros(indices.shape[0])
    context = ForwardContext(no_compile_layers={layer.prefix: layer}, attn_metadata={layer.prefix: metadata},
                             slot_mapping={})
    method = layer._forward_core if hasattr(layer, "_forward_core") else layer._forward
    with override_forward_context(context):
        method(None, None, None, None, out) if method.__name__ == "_forward" else method(None, None, None, out)
    return out


def run(module, cls: str, dtype: torch.dtype, index_dtype: torch.dtype, calls: int = 3):
    """Start a one-layer world of ``cls`` and run ``calls`` calls; return (outputs, raw cache bits, layer)."""
    layer = getattr(module, cls)("model.layers.0.attn")
    runner = module.Runner({layer.prefix: layer}, max_num_seqs=8, dtype=dtype)
    runner.initialize_kv_cache(None)
    outputs = [call(module, layer, *batch(24, 5, index_dtype, seed)) for seed in range(calls)]
    raw = runner.raw[layer.prefix]
    return outputs, raw.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).clone(), layer


def counters(section: str) -> dict[str, int]:
    return dict(get_ledger().counters(section))


def grew(before: dict[str, int], section: str) -> dict[str, int]:
    after = counters(section)
    return {key: after.get(key, 0) - before.get(key, 0) for key in ("calls_seen", "calls_routed", "calls_bypassed")}


@pytest.mark.parametrize("cls", ["FunctionClearLayer", "NativeClearLayer", "ContiguousNativeClearLayer",
                                 "TransposeLayer", "GatherFunctionLayer"])
@pytest.mark.parametrize(("dtype", "index_dtype"), [(torch.float32, torch.int32), (torch.bfloat16, torch.int64)])
def test_every_seam_kind_is_routed_and_exact(load_dummies, strict, cls, dtype, index_dtype):
    """Each declaration kind: outputs and every cache byte equal the unpatched fork's; every call routed."""
    module = load_dummies()
    base_outputs, base_raw, _ = run(module, cls, dtype, index_dtype)
    module = load_dummies(record(f"routing_{cls}", (cls,)))
    section = SEAMS[cls][1].section
    before, clears = counters(section), module.CLEARS["count"]
    outputs, raw, layer = run(module, cls, dtype, index_dtype)
    assert all(torch.equal(a, b) for a, b in zip(outputs, base_outputs, strict=True))
    assert torch.equal(raw, base_raw)
    assert grew(before, section) == {"calls_seen": 3, "calls_routed": 3, "calls_bypassed": 0}
    assert module.CLEARS["count"] == clears  # folded into the plan's flagged gather, never run
    assert getattr(layer, PLAN_ATTRIBUTE) is not None


@pytest.mark.alias_mechanism
def test_the_native_clear_is_elided_only_for_the_calls_own_flags(load_dummies, strict, monkeypatch):
    """``initial[~flags, ...] = 0`` reaches the packed tensor's ``__setitem__`` with the tagged ``~flags``: elided."""
    module = load_dummies(record("routing_native", ("NativeClearLayer",)))
    seen = []
    original = PackedStates.__setitem__

    def spy(self, key, value):
        seen.append((type(key[0]).__name__, value))
        return original(self, key, value)

    monkeypatch.setattr(PackedStates, "__setitem__", spy)
    run(module, "NativeClearLayer", torch.float32, torch.int32, calls=1)
    assert seen == [("InvertedFlags", 0)]


def test_decode_only_and_context_free_calls_pass_through_uncounted(load_dummies, strict):
    module = load_dummies(record("routing_decode", ("NativeClearLayer",)))
    layer = module.NativeClearLayer("model.layers.0.attn")
    runner = module.Runner({layer.prefix: layer}, max_num_seqs=8)
    runner.initialize_kv_cache(None)
    before, snapshot = counters(GDN), runner.raw[layer.prefix].clone()
    indices, flags = batch(24, 2, torch.int32, 0)
    call(module, layer, indices, flags, num_prefills=0)  # decode-only batch
    layer._forward_core(None, None, None, torch.zeros(2))  # no forward context at all
    assert grew(before, GDN) == {"calls_seen": 0, "calls_routed": 0, "calls_bypassed": 0}
    assert layer.seen_state_types == [torch.Tensor, torch.Tensor]  # the plain cache, not the routed alias
    assert torch.equal(runner.raw[layer.prefix], snapshot)


def run_under_capture(load_dummies, monkeypatch, capturing: bool, name: str) -> tuple:
    """One prefill call while a breakable capture is current (``capturing``: its segment recording, else closed
    for an eager break); return ``(equal to the unpatched run, requests' counters grown, capture counters grown,
    layer)``."""
    module = load_dummies()
    base_outputs, base_raw, _ = run(module, "NativeClearLayer", torch.float32, torch.int32, calls=1)
    capture = SimpleNamespace(_capturing=capturing)
    fake = SimpleNamespace(BreakableCUDAGraphCapture=SimpleNamespace(current=lambda: capture))
    monkeypatch.setitem(sys.modules, "vllm.compilation.breakable_cudagraph", fake)
    module = load_dummies(record(name, ("NativeClearLayer",)))
    before, captured_before = counters(GDN), counters(capture_section(GDN))
    outputs, raw, layer = run(module, "NativeClearLayer", torch.float32, torch.int32, calls=1)
    equal = torch.equal(outputs[0], base_outputs[0]) and torch.equal(raw, base_raw)
    return equal, grew(before, GDN), grew(captured_before, capture_section(GDN)), layer


def test_a_prefill_inside_a_recording_graph_segment_runs_as_written_and_is_reported(load_dummies, lenient,
                                                                                    monkeypatch):
    """A call recorded into a graph segment (not an eager break) replays without any wrapper: not routed."""
    equal, grown, captured, layer = run_under_capture(load_dummies, monkeypatch, True, "routing_breakable")
    assert equal
    assert grown == {"calls_seen": 1, "calls_routed": 0, "calls_bypassed": 1}
    assert captured == {"calls_seen": 0, "calls_routed": 0, "calls_bypassed": 0}
    assert "graph segment was recording" in get_ledger().snapshot()["facts"][GDN]["last_bypass"]["reason"]
    assert layer.seen_state_types == [torch.Tensor]  # the fork's own function ran on the plain cache


def test_a_prefill_run_eagerly_at_capture_is_routed_and_counted_apart(load_dummies, strict, monkeypatch):
    """The eager run a breakable capture makes of a break (its segment closed) is a dummy batch: routed through
    the plan, counted in the capture section only -- ``calls_seen`` stays the requests' prefill calls."""
    equal, grown, captured, _ = run_under_capture(load_dummies, monkeypatch, False, "routing_capture_eager")
    assert equal
    assert grown == {"calls_seen": 0, "calls_routed": 0, "calls_bypassed": 0}
    assert captured == {"calls_seen": 1, "calls_routed": 1, "calls_bypassed": 0}


def test_breakable_capture_is_read_per_thread_from_vllms_own_capture_class():
    """vLLM's ``BreakableCUDAGraphCapture`` keeps the active capture per thread (``_tls.active``): a capture on
    this thread is seen, one on another thread is not -- read as its ``current()`` reads it; between segments
    (``_capturing`` false) the call is the eager run of a break."""
    import threading

    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    from kda_patches.routing.calls import CAPTURE_EAGER, CAPTURE_RECORDING, NOT_CAPTURING, breakable_capture_phase

    tls = BreakableCUDAGraphCapture._tls
    assert BreakableCUDAGraphCapture.current() is None and breakable_capture_phase() == NOT_CAPTURING
    tls.active = SimpleNamespace(_capturing=True)
    try:
        seen_elsewhere = []
        other = threading.Thread(target=lambda: seen_elsewhere.append(breakable_capture_phase()))
        other.start()
        other.join()
        assert breakable_capture_phase() == CAPTURE_RECORDING and seen_elsewhere == [NOT_CAPTURING]
        tls.active._capturing = False  # between segments: the eager run of a break
        assert breakable_capture_phase() == CAPTURE_EAGER
    finally:
        del tls.active
    assert breakable_capture_phase() == NOT_CAPTURING


def test_a_same_shaped_other_index_tensor_never_folds_the_clear(load_dummies, strict):
    """Issue 12 mutant 1: folding keys on the index tensor's identity, not its shape (the clone has equal values).

    The fork gathers with ``state_indices.clone()`` and clears nothing: folding its flags would zero rows the
    fork reads as they are (outputs differ) and then fail the proof (folded 1, elided 0).
    """
    module = load_dummies()
    base_outputs, base_raw, _ = run(module, "OtherIndexLayer", torch.float32, torch.int32)
    module = load_dummies(record("routing_other_index", ("OtherIndexLayer",)))
    before = counters(KIMI)
    outputs, raw, _ = run(module, "OtherIndexLayer", torch.float32, torch.int32)
    assert all(torch.equal(a, b) for a, b in zip(outputs, base_outputs, strict=True))
    assert torch.equal(raw, base_raw)
    assert grew(before, KIMI) == {"calls_seen": 3, "calls_routed": 3, "calls_bypassed": 0}


@pytest.mark.alias_mechanism
def test_a_fork_that_stopped_clearing_after_a_folded_gather_is_bypassed(load_dummies, lenient):
    """Issue 12 mutant 2: folded != elided is a bypass (the fork no longer calls ``clear_ssm_states``).

    The alias's run-time proof; under the default routing the source shows the missing clear first (next test)."""
    module = load_dummies(record("routing_no_clear", ("NoClearLayer",)))
    before = counters(KIMI)
    run(module, "NoClearLayer", torch.float32, torch.int32, calls=2)
    assert grew(before, KIMI) == {"calls_seen": 2, "calls_routed": 0, "calls_bypassed": 2}
    reason = get_ledger().snapshot()["facts"][KIMI]["last_bypass"]["reason"]
    assert "folded" in reason and "clear_ssm_states" in reason


@pytest.mark.alias_mechanism
def test_a_fork_that_stopped_clearing_raises_under_strict(load_dummies, strict):
    module = load_dummies(record("routing_no_clear_strict", ("NoClearLayer",)))
    with pytest.raises(StateCopyBypassed, match="KDA_PATCHES_STRICT=1"):
        run(module, "NoClearLayer", torch.float32, torch.int32, calls=1)


@pytest.mark.rewrite_mechanism
def test_a_fork_that_stopped_clearing_is_routed_unfolded_when_its_source_says_so(load_dummies, strict):
    """The rewrite reads that no clear follows the gather: it refuses, and the alias then does not fold the flags
    into its gather (its fold is speculative), so the fork's bytes come out exactly and the call is routed."""
    module = load_dummies()
    base_outputs, base_raw, _ = run(module, "NoClearLayer", torch.float32, torch.int32, calls=2)
    module = load_dummies(record("routing_no_clear_unfolded", ("NoClearLayer",)))
    before = counters(KIMI)
    outputs, raw, _ = run(module, "NoClearLayer", torch.float32, torch.int32, calls=2)
    assert all(torch.equal(a, b) for a, b in zip(outputs, base_outputs, strict=True)) and torch.equal(raw, base_raw)
    assert grew(before, KIMI) == {"calls_seen": 2, "calls_routed": 2, "calls_bypassed": 0}
    fact = get_ledger().snapshot()["facts"][KIMI]["routing routing_dummies:NoClearLayer._run_prefill"]
    assert fact["mechanism"] == "alias" and fact["clear_folded"] is False, fact


def test_kimi_and_gdn_layers_share_one_startup_and_one_table(load_dummies, strict, monkeypatch):
    """Two records (two sections) stacked on one runner method: one initialize() call, shared compiled plan."""
    from kda_patches.state_copy import worker

    calls = []
    real = worker.initialize

    def recording(states, max_selected, *args, **kwargs):
        calls.append(sorted(states))
        return real(states, max_selected, *args, **kwargs)

    monkeypatch.setattr(worker, "initialize", recording)
    module = load_dummies(record("routing_kimi_side", ("FunctionClearLayer",)),
                          Patch("routing_gdn_side", "test", (
                              Target("routing_dummies", "NativeClearLayer._forward_core",
                                     SeamWrapper(gdn_state_copy.QWEN_SEAM)),
                              Target("routing_dummies", "Runner.initialize_kv_cache",
                                     gdn_state_copy.wrap_initialize_kv_cache))))
    kimi_layer, gdn_layer = module.FunctionClearLayer("kimi.0"), module.NativeClearLayer("gdn.0")
    runner = module.Runner({"kimi.0": kimi_layer, "gdn.0": gdn_layer}, max_num_seqs=8)
    runner.initialize_kv_cache(None)
    assert calls == [["gdn.0", "kimi.0"]]
    kimi_plan, gdn_plan = getattr(kimi_layer, PLAN_ATTRIBUTE), getattr(gdn_layer, PLAN_ATTRIBUTE)
    assert kimi_plan.plan is gdn_plan.plan  # same layout: one compiled table
    facts = get_ledger().snapshot()["facts"]
    assert facts[KIMI]["kimi.0"]["seam"] == kimi_prefill.ASCEND_SEAM.name
    assert facts[GDN]["gdn.0"]["seam"] == gdn_state_copy.QWEN_SEAM.name
    before_kimi, before_gdn = counters(KIMI), counters(GDN)
    call(module, kimi_layer, *batch(24, 3, torch.int32, 1))
    call(module, gdn_layer, *batch(24, 3, torch.int32, 2))
    assert grew(before_kimi, KIMI)["calls_routed"] == 1 and grew(before_gdn, GDN)["calls_routed"] == 1


def test_cpu_caches_without_the_interpreter_get_no_plan_and_refuse(load_dummies, strict, monkeypatch):
    """vLLM's CPU backend never calls these seams: without TRITON_INTERPRET=1 startup records and skips them."""
    from kda_patches.routing.proof import PlanNotPublished
    from kda_patches.state_copy import device

    monkeypatch.setattr(device, "interpreter_active", lambda: False)
    module = load_dummies(record("routing_cpu", ("NativeClearLayer",)))
    layer = module.NativeClearLayer("model.layers.0.attn")
    module.Runner({layer.prefix: layer}, max_num_seqs=8).initialize_kv_cache(None)  # does not abort
    assert getattr(layer, PLAN_ATTRIBUTE, None) is None
    facts = get_ledger().snapshot()["facts"][GDN]
    assert facts[layer.prefix]["decision"] == "not-prepared" and "TRITON_INTERPRET" in facts[layer.prefix]["reason"]
    with pytest.raises(PlanNotPublished, match=r"model\.layers\.0\.attn"):
        call(module, layer, *batch(24, 3, torch.int32, 0))


@pytest.mark.parametrize("pdl", ["off", "on", "auto"])
def test_the_pdl_switch_reaches_the_plans_compiled_at_startup(load_dummies, monkeypatch, pdl):
    """``KDA_PATCHES_PDL=1`` asks the startup's plans for programmatic dependent launch: on this CPU target it is
    dropped, and the layer's ledger fact says so; ``0`` asks nothing, and ``auto`` (the default) asks only where
    the target has it, so nothing is dropped here either."""
    import kda_patches
    from kda_patches.flags import Flags
    from kda_patches.state_copy.errors import LEDGER_SECTION

    monkeypatch.setattr(kda_patches, "_FLAGS", Flags(strict=True, pdl=pdl))
    module = load_dummies(record("routing_pdl", ("NativeClearLayer",)))
    _, _, layer = run(module, "NativeClearLayer", torch.float32, torch.int32, calls=1)
    fact = get_ledger().snapshot()["facts"][LEDGER_SECTION][layer.prefix]
    dropped = [hint for hint in fact["memory_hints"]["dropped"] if hint.startswith("pdl")]
    assert fact["pdl"] is False and bool(dropped) is (pdl == "on")
