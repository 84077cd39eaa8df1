"""gdn_host_flags on the real vLLM 0.32 GDN metadata builder (CPU tensors)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import vllm_stack

vllm_stack.import_vllm("vllm")

from vllm.config import ModelConfig, VllmConfig  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends import gdn_attn  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

from kda_patches import registry  # noqa: E402
from kda_patches.ledger import get_ledger  # noqa: E402
from kda_patches.patches import gdn_host_flags  # noqa: E402

BLOCKS_PER_REQUEST = 64  # covers seq_len // block_size in vLLM's "align" mamba cache mode


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    """A real GDNAttentionMetadataBuilder for a tiny Qwen3-Next config, with the patch applied."""
    from transformers import Qwen3NextConfig

    model_dir = tmp_path_factory.mktemp("tiny_qwen3_next")
    Qwen3NextConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                    linear_value_head_dim=64, intermediate_size=512, moe_intermediate_size=128, num_experts=4,
                    num_experts_per_tok=2, vocab_size=1024, full_attention_interval=2).save_pretrained(model_dir)
    config = VllmConfig(model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                                                 max_model_len=512))
    spec = MambaSpec(block_size=16, shapes=((3, 256), (4, 64, 64)), dtypes=(torch.bfloat16, torch.float32))
    registry.register_patch(gdn_host_flags.PATCH)
    target = gdn_host_flags.PATCH.targets[0]
    registry.apply_target(gdn_host_flags.PATCH, target, gdn_attn)
    assert registry.is_applied(gdn_host_flags.PATCH, target)
    return gdn_attn.GDNAttentionMetadataBuilder(spec, ["model.layers.0.linear_attn"], config, torch.device("cpu"))


def make_batch(decode_lens: list[int], prefill: list[tuple[int, int]], padding: int = 0,
               device_tensor=None) -> CommonAttentionMetadata:
    """Build CommonAttentionMetadata: decodes first (1 token, prior state), then (query_len, computed) prefills.

    ``device_tensor`` converts the device-side fields (default: CPU tensors, like vLLM's CPU build).
    """
    to_device = device_tensor or (lambda t: t)
    query_lens = [1] * len(decode_lens) + [q for q, _ in prefill] + [0] * padding
    seq_lens = list(decode_lens) + [q + c for q, c in prefill] + [0] * padding
    is_prefilling = [False] * len(decode_lens) + [c == 0 for _, c in prefill] + [False] * padding
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    num_reqs = len(query_lens)
    query_start = torch.tensor(starts, dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=to_device(query_start.clone()), query_start_loc_cpu=query_start,
        seq_lens=to_device(seq.clone()), num_reqs=num_reqs, num_actual_tokens=starts[-1],
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=to_device(torch.randperm(num_reqs * BLOCKS_PER_REQUEST, dtype=torch.int32)
                                     .view(num_reqs, BLOCKS_PER_REQUEST)),
        slot_mapping=to_device(torch.arange(starts[-1], dtype=torch.int64)),
        seq_lens_cpu_upper_bound=seq.clone(), is_prefilling=torch.tensor(is_prefilling))


BATCHES = {
    "fresh_prefills": ([], [(5, 0), (70, 0), (129, 0)], 0),
    "chunked_continuations": ([], [(64, 64), (3, 200), (1, 0)], 0),
    "mixed_decode_and_prefill": ([9, 17], [(7, 0), (65, 31)], 0),
    "trailing_padding": ([4], [(40, 0)], 2),
}


def assert_same(mine, theirs, where: str) -> None:
    """Recursive equality: tensors with torch.equal, containers element-wise, dataclasses field-wise."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(mine, torch.Tensor) and torch.equal(mine, theirs), where
    elif isinstance(theirs, dict):
        assert mine.keys() == theirs.keys(), where
        for key in theirs:
            assert_same(mine[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(mine) == len(theirs), where
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    elif dataclasses.is_dataclass(theirs):
        for field in dataclasses.fields(theirs):
            assert_same(getattr(mine, field.name), getattr(theirs, field.name), f"{where}.{field.name}")
    else:
        assert mine == theirs, where


def compare_fields(patched, baseline) -> None:
    for field in dataclasses.fields(baseline):
        assert_same(getattr(patched, field.name), getattr(baseline, field.name), field.name)


@pytest.mark.parametrize("batch_name", sorted(BATCHES))
def test_patched_build_equals_original_and_flags_match_device_fields(builder, batch_name):
    decodes, prefills, padding = BATCHES[batch_name]
    common = make_batch(decodes, prefills, padding)
    original_build = type(builder).build.__wrapped__
    baseline = original_build(builder, 0, common)
    seen_before = get_ledger().counters("gdn_host_flags")
    patched = builder.build(0, common)
    compare_fields(patched, baseline)
    assert not hasattr(baseline, "cu_seqlens_host")

    assert patched.num_prefills > 0
    assert patched.cu_seqlens_host == tuple(baseline.prefill_query_start_loc.tolist())
    assert patched.has_initial_state_host == tuple(baseline.prefill_has_initial_state.tolist())
    assert patched.any_initial_state_cpu == bool(baseline.prefill_has_initial_state.any())
    lengths = [b - a for a, b in zip(patched.cu_seqlens_host, patched.cu_seqlens_host[1:], strict=False)]
    for size in (64, 128):
        assert patched.prefill_chunk_totals[size] == sum((n + size - 1) // size for n in lengths)
    seen_after = get_ledger().counters("gdn_host_flags")
    assert seen_after["builds_seen"] == seen_before.get("builds_seen", 0) + 1
    assert seen_after["builds_flagged"] == seen_before.get("builds_flagged", 0) + 1


def test_decode_only_batch_gets_no_flags(builder):
    before = get_ledger().counters("gdn_host_flags")
    metadata = builder.build(0, make_batch([5, 8, 13], []))
    assert metadata.num_prefills == 0 and not hasattr(metadata, "any_initial_state_cpu")
    after = get_ledger().counters("gdn_host_flags")
    assert after["builds_seen"] == before.get("builds_seen", 0) + 1
    assert after.get("builds_flagged", 0) == before.get("builds_flagged", 0)


def hand_flags(prefills: list[tuple[int, int]]) -> tuple[tuple[int, ...], tuple[bool, ...], dict[int, int]]:
    """The expected flags written out from the batch's own inputs: (query_len, computed) per prefill row."""
    cu_seqlens = [0]
    for query_len, _ in prefills:
        cu_seqlens.append(cu_seqlens[-1] + query_len)
    has_initial = tuple(computed > 0 for _, computed in prefills)
    totals = {size: sum((query_len + size - 1) // size for query_len, _ in prefills) for size in (64, 128)}
    return tuple(cu_seqlens), has_initial, totals


def test_added_work_reads_no_device_tensor(builder):
    """Device-side fields become meta tensors (reading a value raises); the flags still equal what the builder's
    own device fields say and what the batch's inputs say by hand."""
    meta_probe = torch.zeros(3, device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        meta_probe.tolist()
    rng = random.Random()
    for _ in range(10):
        decodes = [rng.randint(2, 300) for _ in range(rng.randint(0, 4))]
        # query_len >= 2: a one-token row with prior state is a decode, and decodes must come first
        prefills = [(rng.randint(2, 300), rng.choice([0, 0, rng.randint(1, 500)])) for _ in range(rng.randint(1, 6))]
        real = make_batch(decodes, prefills)
        built = type(builder).build.__wrapped__(builder, 0, real)  # the unpatched builder: its own fields only
        on_meta = dataclasses.replace(real, query_start_loc=real.query_start_loc.to("meta"),
                                      seq_lens=real.seq_lens.to("meta"),
                                      block_table_tensor=real.block_table_tensor.to("meta"),
                                      slot_mapping=real.slot_mapping.to("meta"))
        flags = gdn_host_flags.compute_host_flags(on_meta, built)
        cu_seqlens, has_initial, totals = hand_flags(prefills)
        assert flags.cu_seqlens_host == tuple(built.prefill_query_start_loc.tolist()) == cu_seqlens, (decodes, prefills)
        assert flags.has_initial_state_host == tuple(built.prefill_has_initial_state.tolist()) == has_initial
        assert flags.any_initial_state_cpu == any(has_initial)
        assert flags.prefill_chunk_totals == totals


class UnpaddingBuilder(gdn_attn.GDNAttentionMetadataBuilder):
    """The vllm-ascend 0.29+ build signature (``+ num_actual_reqs``) over the real builder: like the fork, it
    drops the graph-padding rows past ``num_actual_reqs`` (``CommonAttentionMetadata.unpadded``) before building."""

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False, num_actual_reqs=None):
        if num_actual_reqs is not None and num_actual_reqs < common_attn_metadata.num_reqs:
            real_tokens = int(common_attn_metadata.query_start_loc_cpu[num_actual_reqs])
            common_attn_metadata = common_attn_metadata.unpadded(real_tokens, num_actual_reqs)
        return super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens,
                             num_decode_draft_tokens_cpu, fast_build)


@pytest.mark.parametrize("as_keyword", [True, False])
def test_num_actual_reqs_limits_the_flags_to_real_rows(builder, as_keyword):
    """Padding rows past ``num_actual_reqs`` carry tokens here (a full-width graph dummy): counting them would
    add a prefill row the builder does not have."""
    import wrapt

    assert tuple(registry.signature_parameters(UnpaddingBuilder.build)) == gdn_host_flags.ASCEND_029_BUILD_PARAMETERS
    padded_class = type("PaddedBuilder", (UnpaddingBuilder,), {})
    wrapt.wrap_function_wrapper(padded_class, "build", gdn_host_flags.wrap_build)
    child = object.__new__(padded_class)
    child.__dict__.update(builder.__dict__)
    prefills = [(9, 0), (70, 12)]
    common = make_batch([5], [*prefills, (3, 0), (4, 0)])  # the last two rows play graph padding
    num_actual = 3
    metadata = (child.build(0, common, num_actual_reqs=num_actual) if as_keyword
                else child.build(0, common, None, None, False, num_actual))
    cu_seqlens, has_initial, totals = hand_flags(prefills)
    assert tuple(metadata.prefill_query_start_loc.tolist()) == cu_seqlens  # the builder dropped the padding
    assert metadata.cu_seqlens_host == cu_seqlens
    assert metadata.has_initial_state_host == has_initial
    assert metadata.prefill_chunk_totals == totals


def test_host_list_refuses_device_tensors():
    with pytest.raises(ValueError, match="only reads host metadata"):
        gdn_host_flags._host_list(torch.zeros(2, device="meta"))


def test_super_build_from_a_wrapped_subclass_is_flagged_once(builder):
    """A subclass override that calls super().build() is wrapped too, but each batch is counted once."""

    class ChildBuilder(gdn_attn.GDNAttentionMetadataBuilder):
        def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
                  num_decode_draft_tokens_cpu=None, fast_build=False):
            return super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens,
                                 num_decode_draft_tokens_cpu, fast_build)

    import wrapt

    wrapt.wrap_function_wrapper(ChildBuilder, "build", gdn_host_flags.wrap_build)
    child = object.__new__(ChildBuilder)
    child.__dict__.update(builder.__dict__)
    before = get_ledger().counters("gdn_host_flags").get("builds_seen", 0)
    metadata = child.build(0, make_batch([], [(10, 0)]))
    assert metadata.cu_seqlens_host == (0, 10)
    assert get_ledger().counters("gdn_host_flags")["builds_seen"] == before + 1
