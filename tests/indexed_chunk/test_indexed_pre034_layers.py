"""No copy on vLLM 0.33.0's own Qwen, Kimi Linear and Kimi K3 layers: ``KDA_PATCHES_STATE_IO=indexed`` against
``KDA_PATCHES=0``, on the CPU.

:mod:`upstream_child` (tests/released) twice, ``:indexed`` cases only: the release's layer files on the installed
vLLM 0.32 (``vllm.__version__`` reports 0.33.0, so the overlay picks the 0.30-0.34 era and, from 0.32, its
chunk-state host), each layer's chunk call reaching the release's own chunk rule -- the vendored FLA
``chunk_gated_delta_rule`` (Qwen's Triton branch), Kimi K3's ``chunk_kda_with_fused_gate`` (Kimi Linear and Kimi
K3, per-key gates) -- executed, its Triton kernels run by the interpreter, so

- ``baseline`` (``KDA_PATCHES=0``, STRICT): the pre-0.34 seams' own copies -- Qwen's ``ssm_state[idx]`` gather, its
  ``initial_state[~flags, ...] = 0`` clear and ``ssm_state[idx] = last.to(ssm_state.dtype)``; the Kimi layers'
  ``gather_initial_states`` (stood in by its torch form) and ``recurrent_state[idx] = last`` (K3: ``.to(dtype)``)
  -- around the release's chunk-state kernel on dense states;
- ``indexed`` (``KDA_PATCHES=1``, STRICT, ``KDA_PATCHES_STATE_IO=indexed``): each seam is routed, its gather only
  binds the rows (Qwen's folded clear and folded cast included), and the indexed twin -- derived when the overlay
  wrapped the release's ``chunk_delta_h`` -- reads and stores the cache rows itself.

Per case, through the shared batch plan (fresh prefills, mixed decode + prefill with cached states, decode-only,
continued prefills; INT32 and INT64 indices): the outputs and every byte of every page equal the baseline's
(NaN-poisoned gaps checked), every prefill call is routed *and* indexed, and the release's chunk rule ran on both
sides. A Kimi Linear layer on a BF16 cache (its seam scatters the FP32 final states uncast, which vLLM's own
``index_put`` refuses) raises the release's own error on both sides: the twin stands aside and the plan copies,
counted (``calls_copied``) and explained (the layer's fact).
"""

from __future__ import annotations

import pytest
import released_ab
from batch_plan import PREFILL_CALLS
from released_pages import page_problems

RELEASE = "0.33.0"
# the fold (BF16 Qwen: the cast folded into the twin's store), the uncast scatter (FP32 Kimi Linear), Kimi K3's
# `.to(dtype)` into BF16; both conv layouts
CASES = ("qwen:bfloat16:DS:indexed", "linear:float32:SD:indexed", "k3:bfloat16:SD:indexed")
UNCAST_BF16 = "linear:bfloat16:DS:indexed"  # vLLM's own seam raises here: so must the routed one
SIDES = (("baseline", released_ab.Side(False)),
         ("indexed", released_ab.Side(True, (("KDA_PATCHES_STATE_IO", "indexed"),))))
SECTION = {"qwen": "gdn_state_copy", "linear": "gdn_state_copy", "k3": "kimi_prefill"}
HOST_KEY = "vllm.third_party.flash_linear_attention.ops.chunk_delta_h:chunk_gated_delta_rule_fwd_h"
RULES = {"qwen": "vllm.third_party.flash_linear_attention.ops.chunk",
         "linear": "vllm.models.kimi_k3.nvidia.ops.third_party.kda.chunk",
         "k3": "vllm.models.kimi_k3.nvidia.ops.third_party.kda.chunk"}


@pytest.fixture(scope="module")
def runs() -> released_ab.BatchRun:
    batch = released_ab.Batch(f"vLLM {RELEASE}'s layer files on the installed 0.32, no copy (upstream_child.py)",
                              "upstream_child.py", (RELEASE,), (*CASES, UNCAST_BF16), SIDES)
    return released_ab.run_batch(batch)


@pytest.mark.parametrize("case", CASES)
def test_indexed_equals_baseline_and_copies_nothing(runs: released_ab.BatchRun, case: str) -> None:
    kind, cache_dtype, conv_layout, _ = case.split(":")
    baseline, indexed = runs.case(case, "baseline"), runs.case(case, "indexed")
    context = runs.context(case)
    for side in (baseline, indexed):  # whose code ran: the release's layer file and its own chunk rule
        assert "site-packages" not in side["layer_file"] and side["chunk_rule"] == RULES[kind], context
    assert indexed["wrapped"] != "function", context
    problems = page_problems(baseline, indexed, cache_dtype, conv_layout)
    assert not problems, context + "\n" + "\n".join(problems)
    seen = indexed["counters"].get(SECTION[kind], {})
    assert seen.get("calls_seen") == seen.get("calls_routed") == seen.get("calls_indexed") == PREFILL_CALLS, (
        context + f"\nledger: {seen}")
    assert not seen.get("calls_bypassed") and not seen.get("casts_folded"), context + f"\nledger: {seen}"
    assert not indexed["counters"].get("indexed_chunk", {}).get("calls_copied"), context


def test_an_uncast_scatter_into_another_dtype_copies_and_raises_as_the_release(runs: released_ab.BatchRun) -> None:
    """Kimi Linear's ``recurrent_state[idx] = last`` into a BF16 cache: vLLM's own ``index_put`` raises; the routed
    call copies through the plan (the twin would have stored a cast), counted and explained, and raises the same."""
    errors = {side: runs.process(side)["cases"][UNCAST_BF16].get("error") or "" for side, _ in SIDES}
    for side, error in errors.items():
        assert "Index put requires the source and destination dtypes match" in error, f"{side}:\n{error}"
    assert "IndexedStateLost" not in errors["indexed"]
    indexed = runs.process("indexed")["cases"][UNCAST_BF16]
    assert indexed["counters"].get("indexed_chunk", {}).get("calls_copied") == 1, indexed["counters"]
    assert not indexed["counters"].get("gdn_state_copy", {}).get("calls_indexed"), indexed["counters"]
    facts = indexed["ledger"]["facts"]["indexed_chunk"]
    reasons = [fact["reason"] for key, fact in facts.items() if key.startswith("copies model.layers.")]
    assert reasons and all("bfloat16" in reason and "without a cast" in reason for reason in reasons), facts


def test_the_twin_is_derived_from_the_release_and_applied_in_both_records(runs: released_ab.BatchRun) -> None:
    """The indexed side derived the twin from 0.33's kernel (masked pointers) and applied the era's host target in
    both records; the baseline wraps nothing."""
    indexed = runs.process("indexed")["ledger"]
    fact = indexed["facts"]["indexed_chunk"][HOST_KEY]
    assert fact["decision"] == "indexed" and fact["kernel"].endswith("chunk_gated_delta_rule_fwd_kernel_h_blockdim64")
    for section in ("gdn_state_copy", "kimi_prefill"):
        target = indexed["patches"][section]["targets"][HOST_KEY]
        assert target["state"] == "applied", (section, target)
    assert indexed["switches"]["KDA_PATCHES_STATE_IO"] == "indexed"
    assert runs.process("baseline")["ledger"]["patches"]["gdn_state_copy"]["state"] == "disabled"
