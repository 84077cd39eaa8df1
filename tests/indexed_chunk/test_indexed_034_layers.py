"""No copy on vLLM 0.34.0's own Qwen, Olmo hybrid, Kimi Linear and Kimi K3 layers: ``KDA_PATCHES_STATE_IO=indexed``
against ``KDA_PATCHES=0``, on the CPU.

:mod:`upstream034_child` (tests/released) twice, ``:indexed`` cases only: each layer's chunk call reaches the
release's own chunk rule -- the vendored FLA ``chunk_gated_delta_rule`` (Qwen, Olmo), Kimi K3's
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
from batch_plan import PREFILL_CALLS
from released_pages import page_problems

RELEASE = "0.34.0"
# BF16 and FP32 caches, both conv layouts, every 0.34 seam once (each case costs the interpreter's chunk rule twice)
CASES = ("qwen:bfloat16:DS:indexed", "linear:float32:DS:indexed", "k3:bfloat16:SD:indexed", "olmo:float32:SD:indexed")
SIDES = (("baseline", released_ab.Side(False)),
         ("indexed", released_ab.Side(True, (("KDA_PATCHES_STATE_IO", "indexed"), ("KDA_PATCHES_GDN_OPS", "overlay")))))
SECTION = {"qwen": "gdn_state_copy", "linear": "gdn_state_copy", "k3": "kimi_prefill", "olmo": "gdn_state_copy"}
# upstream's copy kernels each layer launches per batch plan in the baseline (Kimi K3 scatters by index)
BASELINE_LAUNCHES = {"qwen": (PREFILL_CALLS, PREFILL_CALLS), "linear": (PREFILL_CALLS, PREFILL_CALLS),
                     "k3": (PREFILL_CALLS, 0), "olmo": (0, 0)}  # Olmo copies by indexing
HOST_KEY = "vllm.third_party.flash_linear_attention.ops.chunk_delta_h:chunk_gated_delta_rule_fwd_h"
COPY_KERNELS = ("_gather_initial_states_kernel", "_scatter_states_kernel")


@pytest.fixture(scope="module")
def runs() -> released_ab.BatchRun:
    from kda_patches.releases.fetch import release_dir

    batch = released_ab.Batch(f"vLLM {RELEASE}'s Qwen layer, no copy (upstream034_child.py)", "upstream034_child.py",
                              (str(release_dir("vllm", RELEASE)),), CASES, SIDES)
    return released_ab.run_batch(batch)


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
