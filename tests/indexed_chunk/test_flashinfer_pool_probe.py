"""The FlashInfer pool probe's judgement (``scripts/gpu/flashinfer_pool_probe.py``), on the CPU: both arms run with
stand-ins for the device calls only (vLLM's gather and scatter ops; FlashInfer's kernel as tests/released's stand-in,
fla-core's naive rule, packed for upstream's arm and with the documented pool semantics for the pool arm), so the
probe's plumbing and its comparison can be checked -- and shown to fail -- before it decides anything on a GPU."""

from __future__ import annotations

import types

import pytest
import torch
from gdn_standins import flashinfer_chunk_gated_delta_rule
from script_loader import load_script

probe = load_script("gpu/flashinfer_pool_probe.py", "flashinfer_pool_probe_under_test")
SHAPE = (2, 2, 8, 8)  # value heads, key heads (fla-core's naive rule: as many as value heads), K, V


def upstream_modules(pool_kernel):
    gather = types.SimpleNamespace(gather_initial_states=lambda cache, rows, flags: torch.where(
        flags[:, None, None, None], cache[rows.long()], torch.zeros((), dtype=cache.dtype)))

    def fi_chunk_gated_delta_rule(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                  use_qk_l2norm_in_kernel):
        out, final = flashinfer_chunk_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], initial_state.float(),
                                                       True, cu_seqlens)
        return out[None], final

    def scatter_states(cache, final, rows):
        cache[rows.long()] = final.to(cache.dtype)

    return {"gather": gather, "seam": types.SimpleNamespace(fi_chunk_gated_delta_rule=fi_chunk_gated_delta_rule),
            "scatter": types.SimpleNamespace(scatter_states=scatter_states),
            "flashinfer": types.SimpleNamespace(chunk_gated_delta_rule=pool_kernel)}


def pool_kernel(read_flags=True, extra_row=None):
    """FlashInfer's pool call as documented: read id -1 a zero state, write ids the rows stored (cast to the pool)."""

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, output_state, output_final_state, cu_seqlens,
                               state_indices, output_state_indices, **unused):
        reads = state_indices if read_flags else output_state_indices
        initial = torch.where((reads >= 0)[:, None, None, None], initial_state[reads.clamp(min=0).long()].float(),
                              torch.zeros(()))
        out, final = flashinfer_chunk_gated_delta_rule(q, k, v, g, beta, initial, True, cu_seqlens)
        output_state[output_state_indices.long()] = final.to(output_state.dtype)
        if extra_row is not None:
            output_state[extra_row] = 0
        return out, output_state

    return chunk_gated_delta_rule


def judge(kernel, dtype=torch.float32):
    inputs = probe.draw_inputs(SHAPE, sequences=5, tokens=3, torch=torch, device="cpu")
    while bool(inputs["flags"].all()):  # the flags rule needs a sequence without an initial state
        inputs["flags"][0] = False
    arms = probe.arms_of(upstream_modules(kernel), inputs, torch)
    return probe.compare_arms(arms, inputs["cache"].to(dtype), inputs["rows"], torch), inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pool_call_with_the_documented_semantics_is_judged_equal(dtype):
    row, _ = judge(pool_kernel(), dtype)
    assert row["outputs_equal"] and row["cache_equal"] and row["other_rows_untouched"] and row["arms"] == {}


def test_a_pool_call_that_reads_rows_without_an_initial_state_is_judged_different():
    row, _ = judge(pool_kernel(read_flags=False))
    assert not row["outputs_equal"] and not row["cache_equal"] and row["cache_rows_differing"] >= 1


def test_a_pool_call_that_writes_another_row_is_caught_by_the_untouched_rows():
    inputs = probe.draw_inputs(SHAPE, sequences=5, tokens=3, torch=torch, device="cpu")
    spare = next(row for row in range(probe.ROWS) if row not in set(inputs["rows"].tolist()))
    row, _ = judge(pool_kernel(extra_row=spare))
    assert row["outputs_equal"] and not row["other_rows_untouched"] and not row["cache_equal"]


def test_an_arm_that_raises_is_the_row_s_finding_not_the_probe_s_end():
    def refused(**kwargs):
        raise ValueError("output_state_indices requires state_indices")

    row, _ = judge(refused)
    assert row["arms"]["pool"]["error"].startswith("ValueError") and "outputs_equal" not in row
