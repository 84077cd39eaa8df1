"""No copy on vLLM 0.34.0's own Qwen, Olmo hybrid, Kimi Linear and Kimi K3 layers: ``KDA_PATCHES_STATE_IO=indexed``
against ``KDA_PATCHES=0``, on the CPU.

:mod:`upstream034_child` (tests/released), ``:indexed`` cases on two sides of the batch that tests/released's 0.34
layer A/B runs (:func:`released_batches.upstream034`: its baseline process runs both files' cases, the ``indexed``
process these only; xdist runs both files on one worker, ``tests/xdist_scheduling.py``): each layer's chunk call
reaches the release's own chunk rule -- the vendored FLA ``chunk_gated_delta_rule`` (Qwen, Olmo), Kimi K3's
``chunk_kda_with_fused_gate`` (Kimi Linear and Kimi K3, per-key gates) -- executed, its Triton kernels run by the
interpreter, so

- ``baseline`` (``KDA_PATCHES=0``, STRICT): upstream's ``gather_initial_states`` copies the initial states out,
  the release's chunk-state kernel reads and writes dense states, ``scatter_states`` (Kimi K3: an index
  assignment) copies the final states back (Olmo gathers and scatters by indexing);
- ``indexed`` (``KDA_PATCHES=1``, STRICT, ``KDA_PATCHES_STATE_IO=indexed``, ``KDA_PATCHES_GDN_OPS=overlay`` so that
  Kimi Linear's seam is routed too): each seam is routed, its gather only binds the rows, and the indexed twin --
  derived when the overlay wrapped the release's ``chunk_delta_h`` -- reads and stores the cache rows itself: no
  state copy at all.

Per case, through the shared batch plan (fresh prefills, mixed decode + prefill with cached states, decode-only,
continued prefills; INT32 and INT64 indices): the outputs and every byte of every page equal the baseline's
(NaN-poisoned gaps checked), every prefill call is routed *and* indexed, and upstream's copy kernels never launch.
"""

from __future__ import annotations

import pytest
import released_ab
import released_batches
from batch_plan import PREFILL_CALLS
from released_pages import page_problems

RELEASE = "0.34.0"
CASES = released_batches.UPSTREAM034_INDEXED_CASES
SECTION = {"qwen": "gdn_state_copy", "linear": "gdn_state_copy", "k3": "kimi_prefill", "olmo": "gdn_state_copy"}
# upstream's copy kernels each layer launches per batch plan in the baseline (Kimi K3 scatters by index)
BASELINE_LAUNCHES = {"qwen": (PREFILL_CALLS, PREFILL_CALLS), "linear": (PREFILL_CALLS, PREFILL_CALLS),
                     "k3": (PREFILL_CALLS, 0), "olmo": (0, 0)}  # Olmo copies by indexing
HOST_KEY = "vllm.third_party.flash_linear_attention.ops.chunk_delta_h:chunk_gated_delta_rule_fwd_h"
COPY_KERNELS = ("_gather_initial_states_kernel", "_scatter_states_kernel")


@pytest.fixture(scope="module")
def runs() -> released_ab.BatchRun:
    """The batch of tests/released's 0.34 layer A/B too (its baseline process runs these cases as well)."""
    from kda_patches.releases.fetch import release_dir

    return released_ab.run_batch(released_batches.upstream034(str(release_dir("vllm", RELEASE))))


@pytest.mark.parametrize("case", CASES)
def test_indexed_equals_baseline_and_copies_nothing(runs: released_ab.BatchRun, case: str) -> None:
    kind, cache_dtype, conv_layout, _ = case.split(":")
    baseline, indexed = runs.case(case, "baseline"), runs.case(case, "indexed")
    context = f"{runs.context(case)}\nstatus:\n{indexed['status']}"
    problems = page_problems(baseline, indexed, cache_dtype, conv_layout)
    assert not problems, context + "\n" + "\n".join(problems)
    assert baseline["launches"] == dict(zip(COPY_KERNELS, BASELINE_LAUNCHES[kind], strict=True)), context
    assert indexed["launches"] == {kernel: 0 for kernel in COPY_KERNELS}, context + f"\n{indexed['launches']}"
    seen = indexed["counters"].get(SECTION[kind], {})
    assert seen.get("calls_seen") == seen.get("calls_routed") == seen.get("calls_indexed") == PREFILL_CALLS, (
        context + f"\nledger: {seen}")
    assert not seen.get("calls_bypassed"), context + f"\nledger: {seen}"


def test_the_twin_is_in_the_ledger(runs: released_ab.BatchRun) -> None:
    """The indexed side records that the twin was derived from the release's kernel; the baseline wraps nothing."""
    indexed = runs.process("indexed")["ledger"]
    fact = indexed["facts"]["indexed_chunk"][HOST_KEY]
    assert fact["decision"] == "indexed" and fact["kernel"].endswith("chunk_gated_delta_rule_fwd_kernel_h_blockdim64")
    target = indexed["patches"]["gdn_state_copy"]["targets"][HOST_KEY]
    assert target["state"] == "applied", target
    assert indexed["switches"]["KDA_PATCHES_STATE_IO"] == "indexed"
    for section in ("gdn_state_copy", "kimi_prefill"):
        calls = sum(PREFILL_CALLS for case in CASES if SECTION[case.split(":")[0]] == section)
        line = next(line for line in runs.process("indexed")["status"].splitlines() if f"{section}: prefill" in line)
        assert f"routed {calls}" in line and f"indexed {calls}" in line, line
    assert runs.process("baseline")["ledger"]["patches"]["gdn_state_copy"]["state"] == "disabled"
