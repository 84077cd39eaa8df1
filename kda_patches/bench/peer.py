"""``kda-patches bench peer``: the fork's released GDN state-copy kernels beside the plans (seed-000 method).

vllm-ascend 0.30 gathers and scatters its GDN states with its own Triton kernels
(``vllm_ascend/ops/triton/mamba/state_index.py``: ``gather_ssm_states`` / ``scatter_ssm_states_``). This
benchmark loads that released file from the release cache (:func:`kda_patches.releases.load.load_released_module`:
the file runs unchanged; its ``from vllm.triton_utils import tl, triton`` is answered with the installed Triton, so
on CUDA the fork's kernels compile with mainline Triton and on the CPU they run under the interpreter; nothing in
the file names ``torch.npu``, so no device namespace is ported) and measures it as the fork calls it on its
``fla_gdn_prefill`` path -- ``gather_ssm_states(state, indices, has_initial_state)`` and
``scatter_ssm_states_(state, indices, last.to(state.dtype).contiguous())`` -- beside upstream's native pattern and
the overlay's plan, with the GDN benchmark's machinery (:mod:`kda_patches.bench.gdn_state_copy`): same inputs,
one process, shuffled rounds, graph replay / eager / wall / host enqueue, raw samples, bit-exactness checked first.

The fork's kernels launch through Triton's JIT on every call (``kernel[grid](...)``): their JIT entries are
counted apart (``peer_jit_entries``) and do not count against the plans' zero-entries check. Under the
CPU interpreter the fork's gather does not run (its load mask is a scalar flag, which ``TRITON_INTERPRET=1``
rejects: "mask has unsupported dtype"); the smoke run then measures native and plan, and the result and the
output say the peer was not run and why (``peers_not_run``).

Not covered yet: the fork's Kimi plans (``KDAStateCopyPlan`` / ``StridedKDAFallbackPlan`` in
``vllm_ascend/ops/kda_state_copy_plan.py``) call ``torch.npu`` and compile on an NPU; their measurement on CUDA is
recorded in ``shared/notes/RELEASES.md`` (H200, 2026-12-01), not produced by this command.
"""

from __future__ import annotations

import argparse
from typing import Any

STATE_INDEX = "vllm_ascend/ops/triton/mamba/state_index.py"
DEFAULT_RELEASE = "vllm-ascend==0.30.0rc2"
FOREIGN_KERNELS = ("_gather_ssm_states_kernel", "_scatter_ssm_states_kernel")


def fork_gdn_impl(release: str) -> tuple[str, tuple[Any, Any]]:
    """Return ``(label, (gather, scatter))`` of the fork's released GDN state copies, as its GDN layer calls them.

    Args:
        release: ``vllm-ascend==VERSION`` (fetched into the release cache when missing).
    Raises:
        ValueError: not a vllm-ascend release spec.
        FileNotFoundError: the release has no ``state_index.py`` (before 0.30).
    """
    from kda_patches.releases.fetch import release_dir
    from kda_patches.releases.load import load_released_module
    from kda_patches.releases.matrix import parse_spec

    dist, version = parse_spec(release)
    if dist != "vllm-ascend":
        raise ValueError(f"bench peer measures vllm-ascend's kernels; got {release!r} (e.g. {DEFAULT_RELEASE})")
    module = load_released_module(release_dir(dist, version), STATE_INDEX)

    def gather(state: Any, indices: Any, flags: Any) -> Any:
        return module.gather_ssm_states(state, indices, flags)

    def scatter(state: Any, last: Any, indices: Any) -> None:
        module.scatter_ssm_states_(state, indices, last.to(state.dtype).contiguous())

    return f"{dist}-{version}", (gather, scatter)


def run_peer_benchmark(args: argparse.Namespace) -> int:
    """Run the GDN benchmark of ``args`` with the fork's kernels added as one more implementation.

    Returns:
        0 on success, 2 when the output exists, the device refuses, or the release cannot be loaded.
    """
    from kda_patches.bench.gdn_state_copy import run_gdn_benchmark
    from kda_patches.releases.fetch import ReleaseFetchError

    try:
        label, impl = fork_gdn_impl(args.release)
    except (ValueError, FileNotFoundError, ReleaseFetchError) as error:
        print(f"kda-patches bench peer: {error}")
        return 2
    reason = peer_unrunnable(impl, args.device)
    if reason is not None:
        print(f"kda-patches bench peer: {label} is NOT measured on {args.device}: {reason}")
        return run_gdn_benchmark(args, extra_fields={"peers_not_run": {label: reason}})
    args.foreign_kernels = FOREIGN_KERNELS
    return run_gdn_benchmark(args, extra_impls={label: impl}, extra_fields={"peers": [label]})


def peer_unrunnable(impl: tuple[Any, Any], device: str) -> str | None:
    """Run the peer's gather and scatter once on a tiny cache of ``device``; return why they cannot run, or None."""
    import torch

    state = torch.zeros((4, 1, 4, 4), device=device)
    indices = torch.tensor([2, 0], device=device)
    flags = torch.tensor([True, False], device=device)
    try:
        impl[0](state, indices, flags)
        impl[1](state, torch.ones((2, 1, 4, 4), device=device), indices)
    except Exception as error:  # the peer's own failure is the measurement's result, not ours
        return f"{type(error).__name__}: {error}"
    return None
