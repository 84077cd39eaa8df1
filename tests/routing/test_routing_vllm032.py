"""``gdn_state_copy`` applies to the installed vLLM 0.32 ``QwenGatedDeltaNetAttention._forward_core`` and routes it.

The real record is registered through the registry, the real module imported, and the real ``_forward_core``
called on a prefill-only batch under a real forward context with a real ``GDNAttentionMetadata``. Stood in
(the CPU cannot run them; they are not the copies under test): the module-level ``causal_conv1d_fn`` and
``fused_post_conv_prep`` and the layer's ``chunk_gated_delta_rule`` (final = 0.5 * initial + 1). Expected
values come from the same installed function unwrapped (``__wrapped__``) on a copy of the cache.
Byte-exactness over many shapes of the released functions is the release-conformance suite's.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
import vllm_stack

from kda_patches.ledger import get_ledger
from kda_patches.patches import gdn_state_copy, kimi_prefill
from kda_patches.registry import find_version, is_applied, register_patch, revert_patch, select_target
from kda_patches.routing.rewrite import rewrite_seam_function
from kda_patches.routing.wrappers import SeamWrapper

QWEN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
HEADS, DIM, ROWS = 2, 4, 12


def standin_conv(x, weight, bias, activation=None, conv_states=None, has_initial_state=None, cache_indices=None,
                 query_start_loc=None, metadata=None):
    return x


def standin_prep(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim, apply_l2norm,
                 output_g_exp):
    tokens = conv_output.shape[0]
    q, k, v = conv_output.split([num_k_heads * head_k_dim, num_k_heads * head_k_dim, HEADS * head_v_dim], dim=-1)
    return (q.reshape(tokens, -1, head_k_dim), k.reshape(tokens, -1, head_k_dim), v.reshape(tokens, -1, head_v_dim),
            a.float(), b.float())


def standin_chunk(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, chunk_indices, chunk_offsets,
                  use_qk_l2norm_in_kernel, aiter_prefill_metadata):
    final = initial_state.float() * 0.5 + 1.0
    out = v * final.sum(dim=(1, 2, 3)).repeat_interleave(torch.diff(cu_seqlens))[None, :, None, None]
    return out, final


@pytest.fixture
def qwen_module(monkeypatch):
    vllm_stack.import_vllm("vllm")
    revert_patch(gdn_state_copy.PATCH)  # activation may have wrapped it under other flags: wrap it under this test's
    register_patch(gdn_state_copy.PATCH)
    module = importlib.import_module(QWEN)
    monkeypatch.setattr(module, "causal_conv1d_fn", standin_conv)
    monkeypatch.setattr(module, "fused_post_conv_prep", standin_prep)
    return module


def make_layer(module):
    torch.nn.Module.__init__(layer := object.__new__(module.QwenGatedDeltaNetAttention))
    qkv = 3 * HEADS * DIM
    layer.__dict__.update(prefix="model.layers.0.linear_attn", enable_packed_recurrent_decode=False,
                          conv1d=SimpleNamespace(weight=torch.ones(qkv, 1, 4), bias=None), activation="silu",
                          A_log=torch.zeros(HEADS), dt_bias=torch.zeros(HEADS), num_k_heads=HEADS, tp_size=1,
                          head_k_dim=DIM, head_v_dim=DIM, key_dim=HEADS * DIM, value_dim=HEADS * DIM,
                          chunk_gated_delta_rule=standin_chunk)
    raw = torch.full((3 + ROWS * (HEADS * DIM * DIM + 5),), -7.5)
    state = raw.as_strided((ROWS, HEADS, DIM, DIM), (HEADS * DIM * DIM + 5, DIM * DIM, DIM, 1), 3)
    state.copy_(torch.randn(state.shape, generator=torch.Generator().manual_seed(5)))
    layer.kv_cache = (torch.zeros(ROWS, qkv, 3), state)
    return layer, raw


def run_forward_core(function, layer, indices, flags, lengths):
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    tokens = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    metadata = GDNAttentionMetadata(num_prefills=len(lengths), num_prefill_tokens=tokens, num_decodes=0,
                                    num_decode_tokens=0, num_spec_decodes=0, num_spec_decode_tokens=0,
                                    num_actual_tokens=tokens, has_initial_state=flags, non_spec_query_start_loc=offsets,
                                    non_spec_state_indices_tensor=indices, prefill_query_start_loc=offsets,
                                    prefill_state_indices=indices, prefill_has_initial_state=flags)
    generator = torch.Generator().manual_seed(9)
    mixed_qkv = torch.randn(tokens, 3 * HEADS * DIM, generator=generator)
    b, a = torch.randn(tokens, HEADS, generator=generator), torch.randn(tokens, HEADS, generator=generator)
    out = torch.zeros(tokens, HEADS, DIM)
    context = ForwardContext(no_compile_layers={layer.prefix: layer}, attn_metadata={layer.prefix: metadata},
                             slot_mapping={})
    with override_forward_context(context):
        function(layer, mixed_qkv, b, a, out)
    return out


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_installed_qwen_forward_core_is_wrapped_and_routed(qwen_module, strict, index_dtype):
    from kda_patches.state_copy.worker import initialize

    key = f"{QWEN}:QwenGatedDeltaNetAttention._forward_core"
    target = select_target(gdn_state_copy.PATCH, key, find_version(gdn_state_copy.PATCH.siblings(key)[0]))
    assert target is not None and is_applied(gdn_state_copy.PATCH, target)
    wrapped = vars(qwen_module.QwenGatedDeltaNetAttention)["_forward_core"]
    assert isinstance(wrapped._self_wrapper, SeamWrapper)

    layer, raw = make_layer(qwen_module)
    base_layer, base_raw = make_layer(qwen_module)
    layer._kda_state_copy_plan = initialize({layer.prefix: layer.kv_cache[1]}, 8)[layer.prefix]
    indices = torch.tensor([7, 1, 10], dtype=index_dtype)
    flags = torch.tensor([True, False, True])
    before = dict(get_ledger().counters(gdn_state_copy.LEDGER_PATH))
    out = run_forward_core(qwen_module.QwenGatedDeltaNetAttention._forward_core, layer, indices, flags, [3, 1, 4])
    expected = run_forward_core(wrapped.__wrapped__, base_layer, indices, flags, [3, 1, 4])
    after = get_ledger().counters(gdn_state_copy.LEDGER_PATH)
    seen = after.get("calls_seen", 0) - before.get("calls_seen", 0)
    routed = after.get("calls_routed", 0) - before.get("calls_routed", 0)
    assert seen == routed == 1
    assert torch.equal(out, expected)
    assert torch.equal(raw, base_raw)
    assert type(layer.kv_cache[1]) is torch.Tensor  # the alias was scoped to the call


INSTALLED_SEAMS = [
    (QWEN, "QwenGatedDeltaNetAttention._forward_core", gdn_state_copy.QWEN_SEAM, True),
    ("vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn", "OlmoHybridGatedDeltaNetAttention._forward_core",
     gdn_state_copy.OLMO_SEAM, True),
    ("vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn", "KimiGatedDeltaNetAttention._forward",
     gdn_state_copy.KIMI_GDN_SEAM, False),
    ("vllm.models.kimi_k3.nvidia.kda", "KimiK3DeltaAttention._forward", kimi_prefill.UPSTREAM_SEAM, False),
]


@pytest.mark.rewrite_mechanism
@pytest.mark.parametrize(("module_name", "qualname", "seam", "folds_clear"), INSTALLED_SEAMS,
                         ids=[qualname.split(".")[0] for _, qualname, _, _ in INSTALLED_SEAMS])
def test_every_installed_upstream_seam_rewrites(module_name, qualname, seam, folds_clear):
    """vLLM 0.32's own four seam functions have exactly the declared copy lines: each gets its twin."""
    vllm_stack.import_vllm("vllm")
    cls_name, method = qualname.split(".")
    function = vars(getattr(importlib.import_module(module_name), cls_name))[method]
    function = getattr(function, "__wrapped__", function)  # the released function under any applied wrapper
    replaced = rewrite_seam_function(function, seam).replaced
    kinds = [line.split(": ", 1)[1] for line in replaced]
    assert any(kind.startswith("gather") or kind.endswith("call") for kind in kinds), replaced
    assert any(kind.startswith("scatter") for kind in kinds), replaced
    assert ("clear removed (folded into the gather)" in kinds) is folds_clear, replaced
