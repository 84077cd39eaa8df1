"""The compile boundary: custom ops under torch.compile, fake implementations, forward-context lookup."""

from __future__ import annotations

import pytest
import torch
import vllm_stack
from state_copy_helpers import bits

from kda_patches.state_copy import naive
from kda_patches.state_copy.context import PLAN_ATTRIBUTE, use_plans
from kda_patches.state_copy.errors import LayoutError, StateCopyRefused
from kda_patches.state_copy.plan import initialize


def prefill_step(binding, state, indices, flags):
    """What the Kimi wrapper does around the (unchanged) chunk math."""
    initial = binding.gather(state, indices, flags)
    final = initial.float() * 2 + 1
    binding.scatter(state, final, indices)
    return initial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_fullgraph_dynamic_counts_without_recompiling(make_cache, device, dtype, no_compiler):
    # no size, stride or offset equals a selected count (Dynamo duck-sizes equal values together)
    cache = make_cache(dtype=dtype, num_rows=10, inner=(7, 9, 16), gap=11, offset=1)
    ref = cache.clone()
    bindings = initialize({"model.layers.0.kda": cache.state}, 6)
    binding = bindings["model.layers.0.kda"]
    no_compiler.arm()
    torch._dynamo.reset()
    frames = []

    def counting_eager(graph_module, example_inputs):
        frames.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(prefill_step, fullgraph=True, dynamic=True, backend=counting_eager)
    compiled_eager = torch.compile(prefill_step, fullgraph=True, dynamic=True, backend="eager")
    generator = torch.Generator().manual_seed(0)
    with use_plans(bindings):
        for count in (3, 5, 2, 6, 4):
            rows = torch.randperm(10, generator=generator)[:count]
            rows[0] = -1 if count > 2 else rows[0]
            indices = rows.to(device=device, dtype=torch.int32 if count % 2 else torch.int64)
            runner = compiled if count != 4 else compiled_eager
            flags = (torch.arange(count) % 3 != 1).to(device)
            out = runner(binding, cache.state, indices, flags)
            expected = naive.gather_states(ref.state, indices, flags)
            naive.scatter_states(ref.state, expected.float() * 2 + 1, indices)
            assert torch.equal(bits(out), bits(expected))
            assert torch.equal(bits(cache.backing), bits(ref.backing))
    assert no_compiler.entries == []
    graphs = [node.target for graph in frames for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.kda_patches.state_gather in graphs and torch.ops.kda_patches.state_scatter in graphs
    # one graph per index dtype (dtype is a guard), never one per selected count
    assert len(frames) == 2


def test_fake_implementations_touch_no_pointer_and_no_plan(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        backing = torch.empty(4 * 60, device=device)
        state = backing.as_strided((4, 2, 3, 8), (60, 24, 8, 1))
        indices = torch.empty(3, dtype=torch.int32, device=device)
        flags = torch.empty(3, dtype=torch.bool, device=device)
        out = torch.ops.kda_patches.state_gather(state, indices, flags, "no.such.layer")
        assert out.shape == (3, 2, 3, 8) and out.dtype == state.dtype
        torch.ops.kda_patches.state_scatter(state, torch.empty((3, 2, 3, 8), device=device), indices,
                                            "no.such.layer")
        with pytest.raises(LayoutError, match="dense"):
            torch.ops.kda_patches.state_gather(torch.empty((4, 2, 8, 3), device=device).transpose(2, 3),
                                               indices, None, "x")
        with pytest.raises(LayoutError, match=r"int32 or torch\.int64"):
            torch.ops.kda_patches.state_gather(state, indices.float(), None, "x")
        with pytest.raises(LayoutError, match="shape"):
            torch.ops.kda_patches.state_scatter(state, torch.empty((2, 2, 3, 8), device=device), indices, "x")
    assert mode is not None


def test_runtime_resolution_needs_a_context(make_cache, device):
    cache = make_cache()
    bindings = initialize({"layer.kda": cache.state}, 4)
    indices = torch.tensor([0, 3], device=device)
    with pytest.raises(StateCopyRefused, match="no forward context") as info:
        torch.ops.kda_patches.state_gather(cache.state, indices, None, "layer.kda")
    assert info.value.reason == "no_context"
    with use_plans(bindings):
        out = torch.ops.kda_patches.state_gather(cache.state, indices, None, "layer.kda")
        with pytest.raises(StateCopyRefused, match="no forward context"):
            torch.ops.kda_patches.state_gather(cache.state, indices, None, "other.kda")
    assert torch.equal(out, naive.gather_states(cache.state, indices))


def test_vllm_forward_context_resolves_the_layer_attribute(make_cache, device):
    forward_context = vllm_stack.import_vllm("vllm.forward_context")
    cache = make_cache()
    bindings = initialize({"model.layers.3.kda": cache.state}, 4)

    class Layer:
        pass

    published, unpublished = Layer(), Layer()
    setattr(published, PLAN_ATTRIBUTE, bindings["model.layers.3.kda"])
    context = forward_context.ForwardContext(
        no_compile_layers={"model.layers.3.kda": published, "model.layers.5.kda": unpublished},
        attn_metadata={}, slot_mapping={})
    indices = torch.tensor([2, -1], device=device)
    with forward_context.override_forward_context(context):
        out = torch.ops.kda_patches.state_gather(cache.state, indices, None, "model.layers.3.kda")
        with pytest.raises(StateCopyRefused, match="has no _kda_state_copy_plan"):
            torch.ops.kda_patches.state_gather(cache.state, indices, None, "model.layers.5.kda")
    assert torch.equal(out, naive.gather_states(cache.state, indices))
