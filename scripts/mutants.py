#!/usr/bin/env python3
"""Hand-picked mutants: does the suite notice when a known-critical line goes wrong?

Each :class:`Mutant` names one file, one exact snippet of its current code, the replacement that makes the
code wrong in a specific, realistic way, and the pytest node ids that should fail because of it. The script

1. copies the repository (``git archive HEAD``, or the working tree with ``--worktree``) into a temporary
   directory -- the tree this script lives in is never modified;
2. runs every listed test once on the unmutated copy (a test that already fails would "kill" anything);
3. for each mutant: checks that the snippet occurs exactly once (otherwise: ERROR, the code moved -- never
   counted as killed), applies it, runs its tests in the copy, and restores the file;
4. prints ``killed`` / ``survived`` / ``ERROR`` per mutant (with ``--repeat N``: how many of N runs killed it).

The tests run under ``.venv``'s interpreter (vLLM, torch, triton) with the copy first on ``sys.path``
(``PYTHONPATH`` and the working directory): ``.venv`` holds this package as an *editable* install pointing
at the original tree, so the runner checks that ``kda_patches`` and every ``kda_patches.*`` module it loaded
came from the copy, and reports an ERROR otherwise. Subprocesses that a test starts with ``PYTHONPATH``
scrubbed would see the original tree: a mutant's killing tests must fail in the pytest process itself.

Exit status: 0 when every mutant was killed in every run; 1 when any survived or errored; 2 on a
baseline failure. Slow (the state-copy tests run under the Triton interpreter): not part of ``make test``.

    .venv/bin/python scripts/mutants.py [--repeat N] [--only NAME ...] [--worktree] [--lock FILE] [--list] [--check]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = REPO / ".venv" / "bin" / "python"
TIMEOUT_S = 1800
WRONG_TREE = 97  # the runner's exit status when kda_patches did not come from the copy

# Runs inside the copy: refuses to report a result unless the package under test is the copy's.
RUNNER = r"""
import os, sys
copy = os.path.realpath(sys.argv[1]) + os.sep

def foreign():
    return sorted(f"{name} from {module.__file__}" for name, module in list(sys.modules.items())
                  if (name == "kda_patches" or name.startswith("kda_patches."))
                  and getattr(module, "__file__", None) and not os.path.realpath(module.__file__).startswith(copy))

import kda_patches
if foreign():
    print("mutants: kda_patches is not imported from the copy:", *foreign(), sep="\n  ", file=sys.stderr)
    sys.exit(WRONG_TREE)
import pytest
status = pytest.main(sys.argv[2:])
if foreign():
    print("mutants: modules loaded from outside the copy during the run:", *foreign(), sep="\n  ", file=sys.stderr)
    sys.exit(WRONG_TREE)
sys.exit(int(status))
""".replace("WRONG_TREE", str(WRONG_TREE))


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One named code change and the tests expected to fail on it.

    Attributes:
        name: short unique name (``--only`` selects by it).
        path: file relative to the repository root.
        original: exact snippet of the current code; must occur exactly once in ``path``.
        replacement: what the snippet becomes.
        tests: pytest node ids (``file::test``; a bare file or ``file::test[param]`` works too).
        owner: who owns the killing tests (named in the report when the mutant survives).
        why: the bug the mutant stands for.
    """

    name: str
    path: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    owner: str
    why: str


ROUTING_ALIAS = "kda_patches/routing/alias.py"
ROUTING_PROOF = "kda_patches/routing/proof.py"
ROUTING_TESTS = "tests/routing/test_routing_core.py"
FOLD_TESTS = "tests/routing/test_routing_folded_cast.py"
CHECKER = "kda_patches/kv_layout/checker.py"
KERNELS = "kda_patches/state_copy/kernels.py"
SEMANTICS = "tests/state_copy/test_state_copy_semantics.py"
PROPERTY = "tests/state_copy/test_state_copy_property.py"
KIMI_ROUTING_TESTS = "tests/kimi/test_kimi_prefill_routing.py"
KV_CHECKER_TESTS = "tests/kv_layout/test_kv_checker.py"
GDN_TESTS = "tests/patches/test_gdn_host_flags.py"
GATHER_FIXED = f"{SEMANTICS}::test_gather_gaps_offsets_invalid_flags_duplicates"
SCATTER_FIXED = f"{SEMANTICS}::test_scatter_skips_invalid_casts_and_keeps_gaps"

# Kernel snippets: the row-validity line of selected_row_mask, which all three kernels call.
VALID = "    valid = (cache_row >= 0) & (cache_row < num_rows.to(tl.int64))\n"
NEGATIVE_VALID = "    valid = (cache_row >= -1) & (cache_row < num_rows.to(tl.int64))\n"
INDEX_N_VALID = "    valid = (cache_row <= num_rows.to(tl.int64)) & (cache_row >= 0)\n"
FLAG_LINE = "        valid = valid & (flag != 0)\n    return valid, tl.where(valid, cache_row, 0)\n"
FLAG_LINE_INDEX_N = ("        valid = (valid | (cache_row == num_rows.to(tl.int64))) & (flag != 0)\n"
                     "    return valid, tl.where(valid, cache_row, 0)\n")


def against(mutant: Mutant, suffix: str, tests: tuple[str, ...], why: str) -> Mutant:
    """The same code change as ``mutant``, named ``<name>/<suffix>``, that ``tests`` alone must kill."""
    return dataclasses.replace(mutant, name=f"{mutant.name}/{suffix}", tests=tests, why=why)


BRUTE_FORCE_WHY = "the same mutant against the brute-force property test (its fixed @examples run first)"
CANDIDATE_FILTER = Mutant(
    "checker-candidate-filter", CHECKER,
    "touching = (lo[pi] < hi[pj]) & (lo[pj] < hi[pi])",
    "touching = (lo[pi] < hi[pj] - 1) & (lo[pj] < hi[pi])",
    (f"{KV_CHECKER_TESTS}::test_checker_boundary_cases",), "B (kv_layout)",
    "run pairs whose spans overlap by one byte are never examined (real overlaps accepted)")
EQUAL_STRIDE_K_HI = Mutant(
    "checker-equal-stride-k-hi", CHECKER,
    "k_hi = -np.floor_divide(-(a_i + l_i - a_j), safe_stride) - 1",
    "k_hi = -np.floor_divide(-(a_i + l_i - a_j), safe_stride) - 2",
    (f"{KV_CHECKER_TESTS}::test_checker_boundary_cases",), "B (kv_layout)",
    "equal-stride pairs: the last overlapping block offset k is missed (real overlaps accepted)")
GATHER_INDEX_N = Mutant("gather-index-n-valid", KERNELS, FLAG_LINE, FLAG_LINE_INDEX_N, (GATHER_FIXED,),
                        "D (state_copy)", "the gathers read row N (one past the cache) for a flagged index == N")


GUARD_TESTS = "tests/routing/test_routing_guards.py"

REWRITE = "kda_patches/routing/rewrite.py"
DIRECT = "kda_patches/routing/direct.py"
REWRITE_TESTS = "tests/routing/test_routing_rewrite.py"
DIRECT_TESTS = "tests/routing/test_routing_direct.py"
# the direct route's remembered-pair condition and its test (one case per part of the condition)
REMEMBERED = "flags is not None and indices is checked[0] and flags is checked[1] and state.device == checked[2]"
REMEMBERED_TEST = (f"{DIRECT_TESTS}::test_a_remembered_foldable_pair_is_folded_again_only_for_the_same_indices_"
                   "flags_and_device")

# tests/released: one process per side runs every case of a configuration (issue 28); the mutants killed there show
# that a shared batch still fails the one case the mutant breaks (the other cases of its batch share its processes)
RELEASED_UPSTREAM_GDN = ("tests/released/test_upstream_gdn_forward_core.py::"
                         "test_gdn_forward_core_patched_equals_baseline")
RELEASED_GDN030 = ("tests/released/test_ascend_gdn030_overlay.py::"
                   "test_gdn_plan_overlay_equals_the_forks_kernels_and_fork_stands_aside")
RELEASED_WHY = "the same mutant against the released-code A/B, one case of a batch sharing its processes"
CHOSEN_TARGET_ALWAYS_LIVE = Mutant(
    "chosen-target-always-live", "kda_patches/verdicts.py",
    "        if getattr(current_flags(), attribute) in values:\n            return None",
    "        return None",
    ("tests/test_registry.py::test_a_target_chosen_by_a_switch_is_wrapped_only_when_chosen",), "G (gdn_plan)",
    "a target chosen by a switch (vllm-ascend 0.30 GDN) is wrapped although the fork does the job")

INDEXED_DERIVE = "kda_patches/indexed_chunk/derive.py"
INDEXED_KERNEL_TESTS = "tests/indexed_chunk/test_indexed_chunk_kernel.py"
INDEXED_ROUTE_TESTS = "tests/indexed_chunk/test_indexed_route.py"


MUTANTS: tuple[Mutant, ...] = (
    # -- issue 51: no copy -- the indexed twin reads flagged rows only, stores valid rows only, never fails open --
    Mutant("indexed-read-ignores-the-flag", INDEXED_DERIVE,
           '        f"kda_read = kda_valid & (tl.load(kda_flags + {declaration.sequence}).to(tl.int32) != 0)\\n"\n',
           '        "kda_read = kda_valid\\n"\n',
           (f"{INDEXED_KERNEL_TESTS}::test_flag_decides_the_read",), "F (indexed_chunk)",
           "a sequence without a cached state starts from whatever its cache row holds"),
    Mutant("indexed-store-to-invalid-rows", INDEXED_DERIVE,
           '    for position, guard in ((load_at, "kda_read"), (store_at, "kda_valid")):\n',
           '    for position, guard in ((load_at, "kda_read"), (store_at, "True")):\n',
           (f"{INDEXED_KERNEL_TESTS}::test_twin_equals_gather_release_scatter",), "F (indexed_chunk)",
           "a padded (-1) or out-of-range row's final state is stored into cache row 0"),
    Mutant("indexed-scatter-without-the-twin", "kda_patches/indexed_chunk/route.py",
           "        if not self.consumed:\n",
           "        if False:\n",
           (f"{INDEXED_ROUTE_TESTS}::test_a_scatter_whose_binding_was_never_consumed_fails_closed",),
           "F (indexed_chunk)", "a bound prefill whose chunk call never read the cache rows is counted routed"),
    Mutant("auto-indexes-below-the-crossover", "kda_patches/indexed_chunk/route.py",
           "                or indices.shape[0] < self.min_sequences):\n",
           "                or False):\n",
           (f"{INDEXED_ROUTE_TESTS}::test_auto_binds_a_call_of_at_least_its_crossover_and_copies_a_smaller_one",),
           "F (indexed_chunk)", "KDA_PATCHES_STATE_IO=auto runs the twin on small batches (the plan measured faster)"),
    Mutant("warm-up-stores-into-the-cache", "kda_patches/indexed_chunk/route.py",
           "    rows = torch.full((sequences,), -1, dtype=index_dtype, device=cache.device)\n",
           "    rows = torch.full((sequences,), 0, dtype=index_dtype, device=cache.device)\n",
           (f"{INDEXED_ROUTE_TESTS}::test_a_copied_call_warms_the_twin_once_storing_nothing_and_runs_the_release",),
           "F (indexed_chunk)", "the twin's warm-up launch names a real cache row and stores into it"),
    Mutant("warm-up-inside-a-graph-capture", "kda_patches/indexed_chunk/route.py",
           "    if pair in LOOKED_AT or capturing(cache):  # a capture: looked at again after it\n",
           "    if pair in LOOKED_AT:\n",
           (f"{INDEXED_ROUTE_TESTS}::test_no_warm_up_on_the_cpu_inside_a_graph_capture_or_before_the_cache_was_gathered",),
           "F (indexed_chunk)", "the twin's warm-up launches while a CUDA graph records (replayed with every step)"),
    Mutant("warm-up-on-the-cpu", "kda_patches/indexed_chunk/route.py",
           '    return tensor.device.type != "cpu"\n',
           "    return True\n",
           (f"{INDEXED_ROUTE_TESTS}::test_no_warm_up_on_the_cpu_inside_a_graph_capture_or_before_the_cache_was_gathered",),
           "F (indexed_chunk)", "the twin's warm-up launches where nothing compiles (the CPU interpreter: pure cost)"),
    Mutant("measured-indexes-unmeasured-seams", "kda_patches/routing/direct.py",
           "    if ready is None or (ready.measured_only and not indexed.measured):\n",
           "    if ready is None:\n",
           (f"{INDEXED_ROUTE_TESTS}::test_the_default_runs_the_twin_only_in_seams_measured_faster_with_it",),
           "F (indexed_chunk)", "KDA_PATCHES_STATE_IO=measured (the default) runs the twin in a seam never measured "
           "with it (Olmo on vLLM 0.34)"),
    Mutant("uncast-final-indexed-on-any-cache", "kda_patches/routing/eras.py",
           "        return None if found == self.dtype else f\"recurrent-state cache dtype {found} (served: "
           "{self.dtype}): \" \\\n",
           "        return None if True else f\"recurrent-state cache dtype {found} (served: {self.dtype}): \" "
           "\\\n",
           ("tests/indexed_chunk/test_indexed_eras.py::test_the_uncast_gate_serves_only_the_hosts_final_dtype",),
           "F (indexed_chunk)", "pre-0.34 Kimi Linear's uncast FP32 scatter is indexed into a BF16 cache: the twin "
           "stores cast where vLLM's own index_put raises"),
    # -- issue 50: breakable CUDA graphs replay the routed call, and capture-time dummy batches are counted apart --
    Mutant("eager-break-replays-the-unwrapped-function", "kda_patches/routing/wrappers.py",
           "        self.breaks[original] = found.decorator(self.routed_entry(found.inner))\n",
           "",
           (f"{REWRITE_TESTS}::test_a_seam_under_vllms_eager_break_is_routed_at_capture_and_in_every_replay",),
           "E (routing)", "the capture records the undecorated function: replays copy states unseen, unrouted"),
    Mutant("capture-time-calls-counted-as-requests", DIRECT,
           "        seam = seam.at_capture  # a capture's dummy batch: routed, counted apart from the requests\n",
           "        pass\n",
           (f"{REWRITE_TESTS}::test_a_seam_under_vllms_eager_break_is_routed_at_capture_and_in_every_replay",),
           "E (routing)", "a breakable capture's eager run of a dummy batch is counted as a served prefill call"),
    Mutant("pdl-auto-failure-aborts-startup", "kda_patches/state_copy/worker.py",
           "                if pdl != PDL_WHERE_AVAILABLE:", "                if True:",
           ("tests/state_copy/test_state_copy_worker.py::"
            "test_a_pdl_plan_that_fails_under_auto_is_prepared_plain_and_says_why",),
           "D (state_copy)", "KDA_PATCHES_PDL=auto: a PDL compile or scratch-launch failure stops the worker"),
    Mutant("qwen-034-flashinfer-half-routed", "kda_patches/patches/gdn_state_copy.py",
           "**_UPSTREAM_OPS, backend=QWEN_FLASHINFER_GATE,", "**_UPSTREAM_OPS,",
           ("tests/released/test_upstream034_layers.py::test_patched_equals_baseline",),
           "E (routing)", "Qwen's FlashInfer branch gathers upstream's way while the seam's scatter goes to the plan"),
    # -- issue 53: the vllm-ascend verifier refuses an overlapping layout ---------------------------------------
    Mutant("ascend-overlap-not-refused", "kda_patches/kv_layout/ascend_verify.py",
           '    if verdict in REFUSED_VERDICTS:\n        return "refuse"\n',
           '    if verdict == "out of storage":\n        return "refuse"\n',
           ("tests/ascend_layout/test_ascend_verifier.py::"
            "test_overlap_refuses_to_start_kimi_k3_on_030_naming_witness_and_fix",),
           "B (kv_layout)", "vllm-ascend 0.30 + Kimi K3 starts with two requests' cache bytes colliding"),
    Mutant("rebind-overlap-not-refused", "kda_patches/kv_layout/ascend_verify.py",  # the verifiers' shared record
           '    if action == "refuse":\n        ledger.count(SECTION, "refusals")\n',
           '    if action == "refuse" and witness is None:\n        ledger.count(SECTION, "refusals")\n',
           ("tests/kv_layout/test_kv_rebind_verifier_034.py::test_a_rebind_that_overlaps_refuses_naming_the_witness",),
           "B (kv_layout)", "vLLM 0.34 serves after extend_kv_cache rebound views that let two requests' cache "
           "bytes collide"),
    Mutant("vllm-029-runner-fingerprint-from-030", "kda_patches/routing/eras.py",
           '((None, "0.29", VLLM_RUNNER_PARAMETERS_027), ("0.29", "0.34", VLLM_RUNNER_PARAMETERS))',
           '((None, "0.30", VLLM_RUNNER_PARAMETERS_027), ("0.30", "0.34", VLLM_RUNNER_PARAMETERS))',
           ("tests/releases/test_runner_signatures.py::test_every_declared_runner_fingerprint_is_the_releases",),
           "B (releases)", "on vLLM 0.29 the state-copy records expect the V1 runner without "
           "kv_cache_allocation_context and are skipped as drift"),
    Mutant("verifies-beside-a-plain-target", "kda_patches/releases/conformance.py",
           '    if all(any(name.startswith(VERIFY_SHAPE_PREFIX) for name in t["shapes"]) for t in here):',
           '    if any(any(name.startswith(VERIFY_SHAPE_PREFIX) for name in t["shapes"]) for t in here):',
           ("tests/releases/test_verify_rule.py::test_a_verifier_beside_a_target_that_changes_something_works",),
           "B (releases)", "conformance says a patch only verifies while another of its targets changes the code"),
    # -- issue 19: the rewritten twin's guards, and the alias's transpose tag -----------------------------
    Mutant("rewrite-fold-any-clear-value", REWRITE,
           "if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1 and _is_zero(statement.value)):",
           "if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):",
           (f"{REWRITE_TESTS}::test_a_clear_with_another_value_runs_as_the_fork_wrote_it",), "E (routing)",
           "packed[~flags, ...] = 1 right after the gather is removed from the twin as if it were the zero clear"),
    Mutant("rewrite-fold-cast-to-any-tensors-dtype", REWRITE,
           'and value.args[0].attr == "dtype" and _is_name(value.args[0].value, self.state)):',
           'and value.args[0].attr == "dtype"):',
           (f"{REWRITE_TESTS}::test_a_cast_to_anything_but_the_cache_dtype_is_not_folded",), "E (routing)",
           "S[J] = final.to(other.dtype) is folded into a scatter that casts to the cache's dtype"),
    Mutant("direct-route-any-cache-object", DIRECT,
           "        if state is not self.state:\n            return gather_as_written(",
           "        if False:\n            return gather_as_written(",
           (f"{REWRITE_TESTS}::test_another_tensor_under_the_cache_name_is_copied_natively_and_reported",),
           "E (routing)", "a gather from another tensor under the cache's name goes through the cache's plan"),
    Mutant("direct-fold-any-flags-shape", DIRECT,
           "flags.dtype is _BOOL and flags.dim() == 1\n            and flags.numel() == indices.numel()",
           "flags.dtype is _BOOL\n            and flags.shape[0] == indices.shape[0]",
           (f"{REWRITE_TESTS}::test_flags_the_plan_cannot_take_are_cleared_as_the_fork_wrote",), "E (routing)",
           "a 2-D clear mask is handed to the plan's gather as if it were one flag per row"),
    Mutant("direct-remembered-pair-any-indices", DIRECT,
           REMEMBERED, REMEMBERED.replace("indices is checked[0] and ", ""),
           (f"{REMEMBERED_TEST}[rewrite-the same flags with other indices]",), "E (routing)",
           "the remembered foldable flags are handed to the plan with another, longer index vector"),
    Mutant("direct-remembered-pair-any-flags", DIRECT,
           REMEMBERED, REMEMBERED.replace(" and flags is checked[1]", ""),
           (f"{REMEMBERED_TEST}[rewrite-the same indices with other flags]",), "E (routing)",
           "int64 flags beside a remembered index vector are handed to the plan's gather as if they were foldable"),
    Mutant("direct-remembered-pair-any-device", DIRECT,
           REMEMBERED, REMEMBERED.replace(" and state.device == checked[2]", ""),
           (f"{REMEMBERED_TEST}[rewrite-the same pair into a cache on another device]",), "E (routing)",
           "flags remembered for a CPU cache are folded into the gather from a cache on another device"),
    Mutant("direct-remembers-unfoldable-pairs", DIRECT,
           "    global _checked_pair\n    if (",
           "    global _checked_pair\n    _checked_pair = (indices, flags, flags.device if isinstance(flags, _Tensor) "
           "else None)\n    if (",
           (f"{DIRECT_TESTS}::test_a_pair_the_plan_cannot_take_is_never_remembered",), "E (routing)",
           "a pair is remembered before it is found foldable"),
    Mutant("direct-cast-scatter-checks-the-device", DIRECT,
           "        elif casts and value.dtype in getattr(self.plan, \"final_dtypes\", ()):",
           "        elif casts and value.dtype in getattr(self.plan, \"final_dtypes\", ()) "
           "and value.device == state.device:",
           (f"{DIRECT_TESTS}::test_a_cast_scatter_of_a_source_on_another_device_is_handed_to_the_plan",), "E (routing)",
           "a cast source on another device is cast by torch first, so the plan never sees the source it refuses"),
    Mutant("direct-routes-nested-calls", DIRECT,
           "    if getattr(active, \"route\", None) is not None:  # a nested seam call: the outer call routes",
           "    if False:  # a nested seam call: the outer call routes",
           (f"{REWRITE_TESTS}::test_a_nested_seam_call_runs_as_written_and_the_outer_call_routes",), "E (routing)",
           "a seam call nested in another routes (and counts) its own copies"),
    Mutant("alias-folds-what-the-source-shows-unfoldable", "kda_patches/routing/wrappers.py",
           "        fold = not self.unfolded or function not in self.unfolded",
           "        fold = True",
           (f"{REWRITE_TESTS}::test_a_clear_the_rewrite_cannot_fold_is_the_forks_under_the_alias_too",),
           "E (routing)", "a seam whose source has no foldable clear still gets the alias's speculative fold"),
    Mutant("alias-transpose-keeps-any-tag", ROUTING_ALIAS,
           "        if ndim >= 2 and {dim0 % ndim, dim1 % ndim} == {ndim - 1, ndim - 2}:",
           "        if ndim >= 2:",
           (f"{REWRITE_TESTS}::test_a_clear_after_a_transpose_of_the_row_axis_is_never_taken_for_the_folded_one",),
           "E (routing)", "a clear after a transpose that moves the row axis is elided as the folded clear"),
    # -- issue 19: the two alias guards that had no killing test ------------------------------------------
    Mutant("routing-elide-any-clear-value", ROUTING_ALIAS,
           'and mask.__dict__.get("_kda_route") is self and type(value) in (int, float) and value == 0):',
           'and mask.__dict__.get("_kda_route") is self):',
           (f"{GUARD_TESTS}::test_a_clear_with_another_value_runs_as_written_and_is_not_elided",), "E (routing)",
           "packed[~flags, ...] = 1 after a folded gather is elided as if it were the zero clear"),
    Mutant("routing-fold-cast-to-any-dtype", ROUTING_ALIAS,
           "return (self.open and dtype is self.state.dtype and final.dtype is not dtype",
           "return (self.open and final.dtype is not dtype",
           (f"{GUARD_TESTS}::test_a_cast_to_another_dtype_than_the_cache_is_torch_own_cast",), "E (routing)",
           "last.to(other dtype) becomes a pending cast the plan would fold (a double rounding the fork never did)"),
    # -- issue #12's table: survived or flaky before the issue --------------------------------------------
    Mutant("routing-fold-foreign-index", ROUTING_ALIAS,
           "flags = self.flags if indices is self.indices else None",
           "flags = self.flags if indices.shape == self.indices.shape else None",
           (f"{ROUTING_TESTS}::test_a_same_shaped_other_index_tensor_never_folds_the_clear",), "E (routing)",
           "gather_index folds has_initial_state into a gather whose index tensor is not the call's state_indices"),
    Mutant("settle-route-ignores-elision", ROUTING_PROOF,
           "if route.gathers == 1 and route.scatters == 1 and route.folded == route.elided:",
           "if route.gathers == 1 and route.scatters == 1:",
           (f"{ROUTING_TESTS}::test_a_fork_that_stopped_clearing_after_a_folded_gather_is_bypassed",), "E (routing)",
           "a fork that no longer calls clear_ssm_states after a folded gather is counted routed"),
    CANDIDATE_FILTER,
    against(CANDIDATE_FILTER, "brute-force", (f"{KV_CHECKER_TESTS}::test_checker_matches_brute_force",),
            BRUTE_FORCE_WHY),
    EQUAL_STRIDE_K_HI,
    against(EQUAL_STRIDE_K_HI, "brute-force", (f"{KV_CHECKER_TESTS}::test_checker_matches_brute_force",),
            BRUTE_FORCE_WHY),
    GATHER_INDEX_N,
    against(GATHER_INDEX_N, "property", (PROPERTY,),
            "the same mutant against the derandomized property test (its fixed @examples)"),
    # -- killed before the issue (kept so that they stay killed) -----------------------------------------
    Mutant("row-mask-negative-valid", KERNELS, VALID, NEGATIVE_VALID, (GATHER_FIXED, SCATTER_FIXED, PROPERTY),
           "D (state_copy)", "every kernel (gathers, scatters, the casting scatter) treats index -1 as a valid row"),
    Mutant("row-mask-index-n-valid", KERNELS, VALID, INDEX_N_VALID, (GATHER_FIXED, SCATTER_FIXED),
           "D (state_copy)", "every kernel treats index == N as a valid row"),
    Mutant("plan-signature-check", "kda_patches/state_copy/plan.py",
           "                or (state.stride() != self._strides"
           " and not layout.serves_signature(self.signature, state))\n",
           "",
           ("tests/state_copy/test_state_copy_lifecycle.py::test_signature_change_refused",), "D (state_copy)",
           "a sealed plan launches on a cache whose strides changed since prepare"),
    Mutant("plan-reenters-triton", "kda_patches/state_copy/variants.py",
           "self._executor(self._function, self._arg_names, grid, [])"
           "(cache, packed, indices, flags, rows, *self._args)",
           "self.kernel[grid](cache, packed, indices, flags, rows, *self._args)",
           ("tests/state_copy/test_state_copy_lifecycle.py::test_four_variants_reused_for_every_count",),
           "D (state_copy)",
           "serving launches through Triton's JIT entry (InterpretedFunction.__getitem__/run on the CPU) after seal"),
    Mutant("bypass-not-counted", ROUTING_PROOF,
           '    ledger.count(section, "calls_bypassed")\n',
           "",
           (f"{KIMI_ROUTING_TESTS}::test_a_fork_gathering_with_index_select_is_reported_bypassed",), "E (routing)",
           "a bypassed prefill call is not counted calls_bypassed"),
    Mutant("fold-cast-never-deferred", ROUTING_ALIAS,
           "        return (self.open and dtype is self.state.dtype and final.dtype is not dtype\n",
           "        return False and (self.open and dtype is self.state.dtype and final.dtype is not dtype\n",
           (f"{FOLD_TESTS}::test_the_cast_is_folded_and_bit_exact",), "E (routing)",
           "the final-state cast is never folded into the routed scatter (a separate cast kernel runs)"),
    Mutant("direct-cast-never-folded", DIRECT,
           '        elif casts and value.dtype in getattr(self.plan, "final_dtypes", ()):',
           '        elif False and casts and value.dtype in getattr(self.plan, "final_dtypes", ()):',
           (f"{RELEASED_UPSTREAM_GDN}[qwen-installed-bfloat16-DS]",), "E (routing)",
           "the rewritten seam never folds the final state's cast into the plan's scatter (torch casts first: a "
           "separate copy), seen only in the ledger's casts_folded"),
    Mutant("fold-cast-pending-never-computed", ROUTING_ALIAS,
           "                    materialize_pending(leaf)\n",
           "                    pass\n",
           (f"{FOLD_TESTS}::test_a_cast_used_before_the_scatter_is_computed_by_torch",), "E (routing)",
           "a pending cast used by something other than the scatter is never computed (its reader sees garbage)"),
    Mutant("registry-drift-ignored", "kda_patches/verdicts.py",
           "return target.parameters is None or (parameters is not None and tuple(parameters) == target.parameters)",
           "return target.parameters is None or parameters is not None",
           ("tests/test_registry.py::test_signature_drift_is_skipped_with_one_warning",
            "tests/test_registry.py::test_strict_turns_drift_into_import_error"), "B (registry)",
           "a target whose signature drifted is wrapped anyway"),
    Mutant("gdn-initial-state-off", "kda_patches/patches/gdn_host_flags.py",
           "has_initial = tuple(num_computed[row] > 0 for row in rows)",
           "has_initial = tuple(num_computed[row] >= 0 for row in rows)",
           (f"{GDN_TESTS}::test_patched_build_equals_original_and_flags_match_device_fields",), "B (gdn_host_flags)",
           "every prefill row claims an initial state (any_initial_state_cpu always true)"),
    Mutant("gdn-syncs-query-start", "kda_patches/patches/gdn_host_flags.py",
           "query_start = _host_list(common_attn_metadata.query_start_loc_cpu)",
           "query_start = _host_list(common_attn_metadata.query_start_loc.cpu())",
           (f"{GDN_TESTS}::test_added_work_reads_no_device_tensor",), "B (gdn_host_flags)",
           "the host flags copy the device query_start_loc to the host (one sync per layer per step)"),
    Mutant("gdn-syncs-seq-lens", "kda_patches/patches/gdn_host_flags.py",
           'seq_upper = getattr(common_attn_metadata, "seq_lens_cpu_upper_bound", None)',
           "seq_upper = common_attn_metadata.seq_lens.cpu()",
           (f"{GDN_TESTS}::test_added_work_reads_no_device_tensor",), "B (gdn_host_flags)",
           "the host flags copy the device seq_lens to the host (one sync per layer per step)"),
    Mutant("gdn-cu-seqlens-not-cumulative", "kda_patches/patches/gdn_host_flags.py",
           "cu_seqlens.append(cu_seqlens[-1] + query_lens[row])",
           "cu_seqlens.append(query_lens[row])",
           (f"{GDN_TESTS}::test_patched_build_equals_original_and_flags_match_device_fields",), "B (gdn_host_flags)",
           "cu_seqlens_host holds the lengths, not their running sum"),
    Mutant("direct-entry-any-release", "kda_patches/state_copy/variants.py",
           "if release not in DIRECT_ENTRY_RELEASES or type(launcher).__name__ != \"CudaLauncher\":",
           "if type(launcher).__name__ != \"CudaLauncher\":",
           ("tests/state_copy/test_state_copy_entry.py::test_undeclared_release_takes_the_launcher",), "D (state_copy)",
           "Triton's C launch entry is called with 3.5/3.6's argument order on a release whose order differs"),
    Mutant("direct-entry-ignores-scratch", "kda_patches/state_copy/variants.py",
           "    if launcher.global_scratch_size or launcher.profile_scratch_size:\n        return None\n",
           "",
           ("tests/state_copy/test_state_copy_entry.py::test_kernel_needing_scratch_takes_the_launcher",),
           "D (state_copy)", "a kernel that needs global or profile scratch is launched without it"),
    CHOSEN_TARGET_ALWAYS_LIVE,
    against(CHOSEN_TARGET_ALWAYS_LIVE, "released", (f"{RELEASED_GDN030}[0.30.0rc1-bfloat16]",), RELEASED_WHY),
    Mutant("chosen-value-read-as-characters", "kda_patches/registry.py",
           "(chosen_by[1],) if isinstance(chosen_by[1], str) else tuple(chosen_by[1])", "tuple(chosen_by[1])",
           ("tests/test_registry.py::test_a_target_chosen_by_a_switch_is_wrapped_only_when_chosen",), "G (gdn_plan)",
           "a switch value given as one string is split into its characters, so the chosen target is never live"),
    Mutant("qwen034-default-stands-aside", "kda_patches/patches/gdn_state_copy.py",
           'QWEN_034_ROUTED_BY = ("measured", "overlay")', 'QWEN_034_ROUTED_BY = ("overlay",)',
           ("tests/released/test_upstream034_layers.py::test_the_choice_is_in_the_ledger_and_status",), "I (vLLM 0.34)",
           "vLLM 0.34's Qwen seam stands aside by default although the H200 layer measurement says route"),
    Mutant("kimi-linear034-default-routed", "kda_patches/patches/gdn_state_copy.py",
           'KIMI_GDN_034_ROUTED_BY = ("overlay",)', 'KIMI_GDN_034_ROUTED_BY = ("measured", "overlay")',
           ("tests/released/test_upstream034_layers.py::test_the_choice_is_in_the_ledger_and_status",), "I (vLLM 0.34)",
           "vLLM 0.34's Kimi Linear seam is routed by default although the H200 layer measurement says stand aside"),
    Mutant("hardware-cast-unproven", "kda_patches/state_copy/plan.py",
           "differs = self._hardware_cast_differs(variant, key, cache)", "differs = None",
           ("tests/state_copy/test_state_copy_cast.py::"
            "test_a_declared_hardware_cast_that_differs_from_torch_keeps_the_bit_pattern_cast",),
           "D (state_copy)", "a declared hardware cast is kept without proving it against torch: a compiler that "
           "converts a BF16 subnormal wrongly writes wrong cache bits"),
    Mutant("tile-by-widest-item-ignored", "kda_patches/state_copy/plan.py",
           "if self.target.tile_by_widest_item else block", "if False else block",
           ("tests/state_copy/test_state_copy_targets.py::"
            "test_a_target_tiling_by_the_widest_item_gives_wider_finals_a_smaller_block",
            "tests/state_copy/test_state_copy_targets.py::test_a_plan_with_per_final_blocks_copies_exactly"),
           "D (state_copy)", "a CUDA PDL plan's cast scatter keeps the cache dtype's block: 8 KiB of FP32 finals "
           "per program, the launch shape the H200 probe measured 14-28 % slower at 1-2 rows"),
    Mutant("widened-scatter-warps-everywhere", "kda_patches/state_copy/plan.py",
           'if key[0] == "scatter" and self._widened_warps and self._blocks[key[2]] != self._block:',
           'if self._widened_warps:',
           ("tests/state_copy/test_state_copy_targets.py::"
            "test_only_a_scatter_whose_tile_was_narrowed_takes_the_widened_scatter_warps",),
           "D (state_copy)", "every variant of an SM90 plan takes 8 warps: the BF16 gathers and same-dtype scatters "
           "the H100 probe measured 5-10 % slower at 1-8 rows with 8 warps"),
    Mutant("widened-warps-without-pdl", "kda_patches/state_copy/plan.py",
           "measured_launch = self._pdl or not self.target.honours(PDL)",
           "measured_launch = True",
           ("tests/state_copy/test_state_copy_targets.py::"
            "test_a_pdl_target_widens_the_scatter_warps_only_of_plans_launched_with_pdl",),
           "D (state_copy)", "the default plain-launch plans on SM90 take the 8 warps measured only with PDL: the "
           "cast scatters 2-7 % slower at 64-256 rows (bench peer runs 2-3, H100; the plain probe, H200)"),
    Mutant("gather-warps-ignored", "kda_patches/state_copy/plan.py",
           'if key[0] == "gather" and self._gather_warps:', 'if False:',
           ("tests/state_copy/test_state_copy_targets.py::"
            "test_only_the_gathers_of_a_listed_cache_dtype_take_the_targets_gather_warps",),
           "D (state_copy)", "SM90 PDL plans gather FP32 caches with 4 warps: 0.985-0.999 of vLLM 0.34's kernels at "
           "8-256 rows on the H100 (launch-shape run 9, five captures), where 8 warps read 1.000-1.013"),
    Mutant("gather-warps-without-pdl", "kda_patches/state_copy/plan.py",
           "self._gather_warps = self.target.gather_warps.get(casts.dtype_name(self._dtype)) if target_warps else",
           "self._gather_warps = self.target.gather_warps.get(casts.dtype_name(self._dtype)) if not num_warps else",
           ("tests/state_copy/test_state_copy_targets.py::"
            "test_a_pdl_target_gives_the_gather_warps_only_to_plans_launched_with_pdl",),
           "D (state_copy)", "plain-launch plans (KDA_PATCHES_PDL=0) take gather warps measured only with PDL"),
    Mutant("gather-warps-every-dtype", "kda_patches/state_copy/plan.py",
           ".gather_warps.get(casts.dtype_name(self._dtype))",
           '.gather_warps.get("float32")',
           ("tests/state_copy/test_state_copy_targets.py::"
            "test_only_the_gathers_of_a_listed_cache_dtype_take_the_targets_gather_warps",),
           "D (state_copy)", "BF16 caches gather with the FP32 gathers' 8 warps: up to 5 % slower than 4 at 8-256 rows "
           "(Qwen3.6, 64 rows, H100 run 9)"),
    Mutant("bulk-scatter-threshold-off-by-one", "kda_patches/state_copy/plan.py",
           "if count >= self._bulk_min_rows and packed.dtype == self._dtype:",
           "if count > self._bulk_min_rows and packed.dtype == self._dtype:",
           ("tests/state_copy/test_state_copy_bulk.py::"
            "test_a_scatter_of_at_least_min_rows_launches_the_bulk_variant_and_copies_exactly",),
           "D (state_copy)", "a scatter of exactly min_rows rows keeps the small-count shape the declaration says "
           "it leaves"),
    Mutant("bulk-scatter-any-final-dtype", "kda_patches/state_copy/plan.py",
           "if count >= self._bulk_min_rows and packed.dtype == self._dtype:",
           "if count >= self._bulk_min_rows:",
           ("tests/state_copy/test_state_copy_bulk.py::test_finals_of_another_dtype_never_take_the_bulk_variant",),
           "D (state_copy)", "BF16 finals of many rows launch the FP32 same-dtype bulk variant: it reads them as "
           "FP32 and writes garbage into the cache"),
    Mutant("scatter-load-unpinned", "kda_patches/state_copy/device.py",
           "pinned_scatter_load=True, bulk_scatter=SM90_BULK_SCATTER,",
           "pinned_scatter_load=False, bulk_scatter=SM90_BULK_SCATTER,",
           ("tests/state_copy/test_state_copy_sass.py::"
            "test_every_sm90_scatter_loads_its_packed_row_before_any_early_exit",),
           "D (state_copy)", "SM90's ptxas sinks the 8-warp same-dtype scatter's packed load below the early exit "
           "(the bulk variant's load then waits for the index)"),
    Mutant("peer-against-the-plain-plan", "kda_patches/bench/gdn_report.py",
           "return next((name for name in PEER_REFERENCES if name in impls), \"plan\")",
           "return \"plan\"",
           ("tests/state_copy/test_state_copy_bench_peer.py::"
            "test_peers_are_compared_with_the_pdl_plan_where_the_run_measured_it",),
           "H (bench)", "`bench peer --pdl` judges upstream's kernels against the plain plan, which SM90+ never "
           "runs by default (run 6: 0.59-1.43x printed where the PDL plan reads 0.943-1.656x)"),
    Mutant("peer-behind-includes-parity", "kda_patches/bench/gdn_report.py",
           "        if ratio < 1:\n", "        if ratio <= 1:\n",
           ("tests/state_copy/test_state_copy_bench_peer.py::"
            "test_a_row_behind_a_peer_names_its_per_capture_ratios_and_parity_is_not_behind",),
           "H (bench)", "a row where the plan and the peer read the same is reported as the plan behind"),
    Mutant("engine-stop-sends-no-wake", "kda_patches/regress/engine_stop.py",
           "            send_abort([WAKE_REQUEST_ID])\n", "            pass\n",
           ("tests/regress/test_engine_stop.py::"
            "test_a_stalled_engine_core_is_woken_by_an_abort_of_no_request_then_the_client_shuts_down",),
           "H (bench)", "an engine core that missed vLLM's SIGTERM is left to the 30 s force-kill"),
    Mutant("kernel-gather-any-dtype", "kda_patches/routing/direct.py",
           "if state is not self.state or (wanted is not None and wanted is not state.dtype):",
           "if state is not self.state:",
           ("tests/routing/test_routing_rewrite.py::"
            "test_a_kernel_gather_into_another_dtype_runs_the_forks_kernel_and_is_bypassed",), "G (gdn_plan)",
           "a gather_ssm_states(..., output_dtype=) into another dtype is sent to the plan (cache dtype only)"),
    Mutant("kernel-scatter-any-dtype", "kda_patches/routing/direct.py",
           "        elif casts and value.dtype in getattr(self.plan, \"final_dtypes\", ()):",
           "        elif casts:",
           ("tests/routing/test_routing_rewrite.py::"
            "test_a_kernel_scatter_of_an_unprepared_dtype_runs_the_forks_kernel_and_is_bypassed",), "G (gdn_plan)",
           "a scatter_ssm_states_ of a final dtype the plan did not prepare is sent to the plan"),
    # -- issue 26: serve-ab measures the shape it was asked for, and continues across device calls ---------------
    Mutant("serve-ab-token-totals-unchecked", "kda_patches/bench/serve_ab.py",
           "        record[\"error\"] = check_token_totals(bench, log_text)",
           "        record[\"error\"] = None",
           ("tests/regress/test_token_totals.py::test_a_run_with_the_wrong_shape_is_a_failed_run",), "H (bench)",
           "a throughput run that ignored --input-len (vLLM 0.33, H200 run 4) is reported as a measurement"),
    Mutant("serve-ab-resume-redraws-orders", "kda_patches/bench/serve_ab.py",
           "        order_rng.shuffle([\"baseline\", \"patched\"])",
           "        pass",
           ("tests/regress/test_serve_ab_resume.py::"
            "test_a_cut_ab_resumes_where_it_stopped_with_the_orders_of_an_uninterrupted_run",), "H (bench)",
           "a resumed A/B draws its orders afresh: its rounds are not the ones the seed fixed"),
    Mutant("engine-stand-aside-unexplained", "scripts/gpu/vllm_engine_check.py",
           "record.get(\"state\") == \"not-applicable\" and \"stands aside\" in record.get(\"reason\", \"\")",
           "record.get(\"state\") == \"not-applicable\"",
           ("tests/test_gpu_engine_check.py::"
            "test_a_case_that_stands_aside_passes_only_when_the_seam_is_visibly_left_alone",), "H (bench)",
           "a 0.34 case passes as standing aside when the seam was merely never imported"),
    # -- issue 26/27 (session of 2026-12-03 night): the instruments of the engine slowdown, PDL -------------------
    Mutant("serve-ab-budget-ignores-warmup", "kda_patches/bench/serve_ab.py",
           "        if not walls and warmup_runs:",
           "        if False:",
           ("tests/regress/test_serve_ab_resume.py::test_the_warmup_is_the_first_rounds_time_estimate",), "H (bench)",
           "a time budget smaller than the warm-up starts round 0 anyway and the device call is cut inside it"),
    Mutant("engine-repeat-baseline-once", "kda_patches/bench/engine_repeat.py",
           "    return [BASELINE, *shuffled, BASELINE]",
           "    return [BASELINE, *shuffled]",
           ("tests/regress/test_engine_repeat.py::test_the_baseline_runs_first_and_last_around_the_shuffled_arms",),
           "H (bench)", "a bisection without the second baseline run cannot show drift over the run"),
    Mutant("step-times-decode-as-prefill", "kda_patches/bench/step_times.py",
           "    return \"prefill\" if max(per_request.values()) > 1 else \"decode\"",
           "    return \"prefill\" if max(per_request.values()) >= 1 else \"decode\"",
           ("tests/regress/test_step_times.py::test_a_batch_is_prefill_when_any_request_gets_more_than_one_token",),
           "H (bench)", "decode steps counted as prefill: the step times no longer split where the overlay runs"),
    Mutant("pdl-prologue-dropped", "kda_patches/state_copy/kernels.py",
           "    pdl_prologue(PDL)  # after the address arithmetic (no memory), before the first load\n",
           "",
           ("tests/state_copy/test_state_copy_targets.py::"
            "test_the_fused_variants_compile_for_sm90_with_grid_dependency_control_only_when_asked",), "D (state_copy)",
           "a kernel launched early by PDL reads before the previous kernel's writes are visible"),
    Mutant("peer-any-vllm-version", "kda_patches/bench/peer.py",
           "    if running != version:",
           "    if False:",
           ("tests/state_copy/test_state_copy_bench_peer.py::"
            "test_upstream_ops_come_from_the_running_vllm_of_that_release_or_are_refused",), "H (bench)",
           "bench peer labels another vLLM's ops as the release asked for"),
    Mutant("interleave-unpaired", "kda_patches/bench/engine_interleave.py",
           "        ratios = [cycle[name] / cycle[BASELINE] for cycle in by_cycle.values() if name in cycle and "
           "BASELINE in cycle]",
           "        ratios = [cycle[name] / statistics.median(c[BASELINE] for c in by_cycle.values() if BASELINE in c) "
           "for cycle in by_cycle.values() if name in cycle and BASELINE in cycle]",
           ("tests/regress/test_engine_interleave.py::"
            "test_the_ratio_pairs_each_pass_with_the_baselines_pass_of_the_same_cycle",
            "tests/regress/test_engine_interleave.py::test_interleaved_arms_cancel_the_drift_and_record_every_pass"),
           "H (bench)", "the interleaved A/B compares against the pooled baseline: the machine's drift is back in"),
    Mutant("interleave-eof-only", "kda_patches/bench/engine_interleave.py",
           "                if self.process.poll() is not None:",
           "                if False:",
           ("tests/regress/test_engine_interleave.py::"
            "test_an_arm_whose_forked_engine_holds_the_pipe_is_still_seen_to_end",), "H (bench)",
           "a dead arm whose forked engine holds the pipe is waited on for the whole timeout"),
    Mutant("step-times-exit-only", "kda_patches/bench/step_times.py",
           "    if flush_every_s is not None:",
           "    if False:",
           ("tests/regress/test_step_times.py::"
            "test_a_process_stopped_without_exit_handlers_keeps_the_samples_it_flushed",), "H (bench)",
           "step times written only at exit: vLLM's engine core never writes them"),
    Mutant("pdl-switch-ignored", "kda_patches/routing/startup.py",
           "initialize(states, max_num_seqs, pdl=current_flags().pdl_request())",
           "initialize(states, max_num_seqs)",
           ("tests/routing/test_routing_core.py::test_the_pdl_switch_reaches_the_plans_compiled_at_startup",),
           "D (state_copy)", "KDA_PATCHES_PDL=1 is accepted and shown but never reaches the plans"),
    Mutant("graph-instances-uneven-split", "kda_patches/bench/stats.py",
           "    if instances < 1 or trials % instances:",
           "    if instances < 1:",
           ("tests/state_copy/test_state_copy_bench_graphs.py::"
            "test_a_split_that_does_not_divide_the_trials_is_refused_naming_both",), "H (bench)",
           "captures that do not divide the trials give some captures fewer rounds than others"),
    Mutant("graph-instances-one-capture-order", "kda_patches/bench/timing.py",
           "    for _ in range(instances):\n        capture = list(keys)\n",
           "    capture = list(keys)\n    for _ in range(instances):\n",
           ("tests/state_copy/test_state_copy_bench_graphs.py::"
            "test_each_block_captures_every_call_anew_in_its_own_order_and_the_rounds_add_up_to_the_trials",),
           "H (bench)", "every block captures in one shared order: each call keeps its place among the captures"),
    Mutant("status-hides-default-choices", "kda_patches/cli.py",
           "if key in defaults and value == defaults[key] and isinstance(value, str)}",
           "if key in defaults and value == defaults[key] and isinstance(value, str) and value != \"auto\"}",
           ("tests/test_cli.py::test_status_shows_a_choice_left_at_its_default",), "B (status)",
           "kda-patches status hides the PDL default (auto) that decides what the plans compile"),
    Mutant("pdl-auto-never-launches", "kda_patches/state_copy/plan.py",
           "self._pdl = available and pdl is not False",
           "self._pdl = available and pdl is True",
           ("tests/state_copy/test_state_copy_targets.py::"
            "test_auto_pdl_compiles_it_where_the_target_has_it_and_records_no_drop_elsewhere",), "D (state_copy)",
           "serving's default (auto) launches plainly on SM90+ though PDL is measured there"),
    Mutant("pdl-auto-records-drops", "kda_patches/state_copy/plan.py",
           "if pdl is True and not available:",
           "if pdl and not available:",
           ("tests/state_copy/test_state_copy_targets.py::test_only_an_explicit_pdl_request_is_recorded_as_dropped",),
           "D (state_copy)", "every CPU and Ascend plan reports a dropped PDL hint nobody asked for"),
    Mutant("ledger-summary-applied-only", "kda_patches/regress/ledgers.py",
           '"applied_targets": applied, "targets": targets}',
           '"applied_targets": applied, "targets": {k: v for k, v in targets.items() if v["state"] == "applied"}}',
           ("tests/test_gpu_engine_check.py::"
            "test_a_case_that_stands_aside_passes_only_when_the_seam_is_visibly_left_alone",), "H (bench)",
           "regress keeps only the applied targets: a seam's stand-aside record never reaches the engine judge"),
    Mutant("extensible-cases-share-the-gpu", "scripts/gpu/vllm_engine_check.py",
           "        return bool(self.extensible)",
           "        return False",
           ("tests/test_gpu_engine_check.py::test_cases_that_profile_memory_run_alone_after_the_shared_wave",),
           "H (bench)", "an engine sizing its KV cache by profiling runs beside others (H200 run 9's failures)"),
    Mutant("jit-watch-any-compile-allowed", "scripts/gpu/vllm_engine_check.py",
           "    if extra:\n        return False, f\"the patched run JIT-compiled",
           "    if False:\n        return False, f\"the patched run JIT-compiled",
           ("tests/test_gpu_engine_check.py::"
            "test_a_jit_watch_case_fails_only_on_a_compile_the_baseline_did_not_have",), "H (bench)",
           "a compile while serving that only the patched engine had passes the JIT watch"),
    Mutant("msa-warmup-stood-in-with-cutlass", "scripts/gpu/gpu_harness.py",
           "    return any(not any((site / folder).is_dir() for folder in folders)",
           "    return True or any(not any((site / folder).is_dir() for folder in folders)",
           ("tests/test_gpu_harness.py::"
            "test_the_msa_warmup_is_stood_in_only_where_the_release_has_it_without_its_cute_dsl_packages",
            "tests/test_gpu_harness.py::test_the_parent_s_record_reads_the_unpacked_site_it_does_not_import"),
           "H (bench)",
           "the MiniMax M3 warm-up is stood in even where the CuTe DSL is carried"),
    Mutant("msa-warmup-real-without-quack", "scripts/gpu/gpu_harness.py",
           '    "quack": (pathlib.PurePosixPath("quack"),),\n',
           "",
           ("tests/test_gpu_harness.py::"
            "test_the_msa_warmup_is_stood_in_only_where_the_release_has_it_without_its_cute_dsl_packages",),
           "H (bench)",
           "the real MiniMax M3 warm-up imported where cutlass is carried and quack is not (H100 run 21: every "
           "0.34 engine stopped at warm-up)"),
    Mutant("stack-twice-fetched-first", "kda_patches/releases/matrix.py",
           "    if len(dists) < len(specs):",
           "    if False:",
           ("tests/releases/test_conformance_verdicts.py::"
            "test_a_stack_naming_one_package_twice_is_refused_before_anything_is_fetched",), "B (releases)",
           "a stack naming one package twice downloads both releases before it is refused"),
)


@dataclasses.dataclass
class Outcome:
    """Result of one mutant in one run: ``killed``, ``survived`` or ``ERROR`` plus a short detail."""

    result: str
    detail: str = ""
    seconds: float = 0.0


def copy_tree(destination: Path, worktree: bool) -> None:
    """Copy the repository into ``destination``: ``HEAD`` by default, the working tree with ``worktree``."""
    if not worktree:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "HEAD"], check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(destination, filter="data")
        return
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is listed but absent
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())


@contextlib.contextmanager
def heavy_lock(path: str | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the block (no-op when None): one heavy job at a time."""
    if path is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_tests(python: str, copy: Path, tests: tuple[str, ...], stop_first: bool) -> tuple[int, str]:
    """Run ``tests`` in ``copy`` with the copy's package first on the path; return (exit status, output tail)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("KDA_PATCHES", "PYTHONPATH", "PYTHONHOME", "TRITON_"))}
    env.update(PYTHONPATH=str(copy), TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1")
    args = [python, "-c", RUNNER, str(copy), "-q", "-p", "no:cacheprovider", *(["-x"] if stop_first else []),
            *tests]
    try:
        result = subprocess.run(args, cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -999, f"timed out after {TIMEOUT_S} s"
    output = (result.stdout + result.stderr).strip().splitlines()
    return result.returncode, "\n".join(output[-12:])


def missing_tests(copy: Path, tests: tuple[str, ...]) -> list[str]:
    """Return the node ids whose file, or whose test function, is not in ``copy`` (moved or renamed)."""
    missing = []
    for test in tests:
        file, _, name = test.partition("::")
        path = copy / file
        function = name.split("[")[0].split("::")[-1]
        if not path.exists() or (function and f"def {function}(" not in path.read_text()):
            missing.append(test)
    return missing


def check_mutant(mutant: Mutant, copy: Path) -> str | None:
    """Return why ``mutant`` cannot be applied to ``copy`` (snippet not found once, tests missing), or None."""
    path = copy / mutant.path
    if not path.exists():
        return f"{mutant.path} does not exist (the code moved): update the mutant"
    found = path.read_text().count(mutant.original)
    if found != 1:
        return (f"snippet found {found} times in {mutant.path} (expected once: the code moved or the snippet is "
                "ambiguous); update the mutant")
    absent = missing_tests(copy, mutant.tests)
    if absent:
        return f"killing tests not found: {', '.join(absent)}"
    return None


def run_mutant(mutant: Mutant, python: str, copy: Path) -> Outcome:
    """Apply ``mutant`` to ``copy``, run its tests, restore the file; return the outcome."""
    problem = check_mutant(mutant, copy)
    if problem is not None:
        return Outcome("ERROR", problem)
    path = copy / mutant.path
    source = path.read_text()
    began = time.monotonic()
    path.write_text(source.replace(mutant.original, mutant.replacement))
    try:
        status, tail = run_tests(python, copy, mutant.tests, stop_first=True)
    finally:
        path.write_text(source)
    seconds = time.monotonic() - began
    if status == 0:
        return Outcome("survived", "", seconds)
    if status == 1:
        failed = [line for line in tail.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return Outcome("killed", failed[0] if failed else "tests failed", seconds)
    if status < 0 and status != -999:
        return Outcome("killed", f"test process died of signal {-status} (a crash is a kill)", seconds)
    if status == WRONG_TREE:
        return Outcome("ERROR", "kda_patches was not imported from the copy:\n" + tail, seconds)
    return Outcome("ERROR", f"pytest exit status {status}:\n{tail}", seconds)


def run_baseline(mutants: tuple[Mutant, ...], python: str, copy: Path) -> tuple[bool, str]:
    """Run every listed (existing) test once on the unmutated copy; return (passed, output tail)."""
    tests = tuple(dict.fromkeys(test for mutant in mutants for test in mutant.tests
                                if test not in missing_tests(copy, (test,))))
    if not tests:
        return True, ""
    status, tail = run_tests(python, copy, tests, stop_first=False)
    return status == 0, f"exit status {status}\n{tail}"


def print_table(mutants: tuple[Mutant, ...], runs: list[dict[str, Outcome]]) -> bool:
    """Print one line per mutant (killed in k/N runs); return True when every mutant was killed in every run."""
    width = max(len(mutant.name) for mutant in mutants)
    clean = True
    print(f"\n{'mutant':<{width}}  result      runs  seconds  detail")
    for mutant in mutants:
        outcomes = [run[mutant.name] for run in runs]
        killed = sum(outcome.result == "killed" for outcome in outcomes)
        errors = [outcome for outcome in outcomes if outcome.result == "ERROR"]
        if errors:
            result, detail = "ERROR", errors[0].detail.splitlines()[0]
        elif killed == len(outcomes):
            result, detail = "killed", outcomes[0].detail
        else:
            result, detail = "survived", f"killing tests owned by {mutant.owner}: {', '.join(mutant.tests)}"
        clean = clean and result == "killed"
        seconds = max(outcome.seconds for outcome in outcomes)
        print(f"{mutant.name:<{width}}  {result:<10}  {killed}/{len(outcomes)}  {seconds:7.1f}  {detail}")
    for mutant in mutants:
        for number, run in enumerate(runs, 1):
            outcome = run[mutant.name]
            if outcome.result == "ERROR" and "\n" in outcome.detail:
                print(f"\n--- {mutant.name} (run {number}) ---\n{outcome.detail}")
                break
    return clean


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/mutants.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="run everything N times (default 1)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--worktree", action="store_true",
                        help="copy the working tree (uncommitted changes included) instead of HEAD")
    parser.add_argument("--lock", metavar="FILE", help="flock FILE during each run (baseline + mutants)")
    parser.add_argument("--python", default=str(DEFAULT_PYTHON), help="interpreter with the test environment")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true",
                        help="only check that every snippet occurs once and every killing test exists")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the mutants; return 0 when all were killed in every run, 1 otherwise, 2 on a baseline failure."""
    args = parse_args(argv)
    names = [mutant.name for mutant in MUTANTS]
    assert len(set(names)) == len(names), "mutant names must be unique"
    if args.list:
        for mutant in MUTANTS:
            print(f"{mutant.name}: {mutant.path}: {mutant.why} [{mutant.owner}]")
        return 0
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        print(f"unknown mutant(s): {', '.join(unknown)}; known: {', '.join(names)}", file=sys.stderr)
        return 2
    mutants = tuple(mutant for mutant in MUTANTS if not args.only or mutant.name in args.only)
    runs: list[dict[str, Outcome]] = []
    for number in range(1, args.repeat + 1):
        with tempfile.TemporaryDirectory(prefix="kda-mutants-") as scratch:
            copy = Path(scratch) / "repo"
            copy.mkdir()
            copy_tree(copy, args.worktree)
            print(f"run {number}/{args.repeat}: copy of {'the working tree' if args.worktree else 'HEAD'} "
                  f"in {copy}", flush=True)
            if args.check:
                problems = {mutant.name: check_mutant(mutant, copy) for mutant in mutants}
                for name, problem in problems.items():
                    print(f"  {name}: {problem or 'ok'}")
                return 1 if any(problems.values()) else 0
            with heavy_lock(args.lock):  # one run's baseline and mutants at a stretch, released between runs
                passed, tail = run_baseline(mutants, args.python, copy)
                if not passed:
                    print(f"baseline FAILED: the listed tests fail on the unmutated copy, so no kill means "
                          f"anything:\n{tail}", file=sys.stderr)
                    return 2
                run: dict[str, Outcome] = {}
                for mutant in mutants:
                    run[mutant.name] = outcome = run_mutant(mutant, args.python, copy)
                    print(f"  {mutant.name}: {outcome.result} ({outcome.seconds:.1f} s)", flush=True)
            runs.append(run)
    return 0 if print_table(mutants, runs) else 1


if __name__ == "__main__":
    sys.exit(main())
