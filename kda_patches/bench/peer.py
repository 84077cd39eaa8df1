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

``--release vllm==VERSION`` measures upstream vLLM's own ``gather_initial_states`` / ``scatter_states`` instead
(:func:`upstream_gdn_impl`): imported from the vLLM this process runs, which must be that release (on the H200 the
engine check's ``--peer`` runs it inside the unpacked bundle), launched through vLLM's own code (its dispatcher and
PDL choice included); their kernels' JIT entries are counted apart like the fork's.

The same release's Kimi plans (``KDAStateCopyPlan`` / ``StridedKDAFallbackPlan``) are measured beside them,
loaded by :mod:`kda_patches.bench.peer_kimi` with the device namespace ported (the exact replacements are in the
result's ``peer_ports``; kernels untouched). A peer that cannot run on the device is listed in
``peers_not_run`` with its own error (on the CPU: the ported plans refuse a non-CUDA cache), never dropped.
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
        raise ValueError(f"bench peer measures vllm-ascend's kernels or upstream vLLM's own ops (vllm==0.34.0); got "
                         f"{release!r} (e.g. {DEFAULT_RELEASE})")
    module = load_released_module(release_dir(dist, version), STATE_INDEX)

    def gather(state: Any, indices: Any, flags: Any) -> Any:
        return module.gather_ssm_states(state, indices, flags)

    def scatter(state: Any, last: Any, indices: Any) -> None:
        module.scatter_ssm_states_(state, indices, last.to(state.dtype).contiguous())

    return f"{dist}-{version}", (gather, scatter)


UPSTREAM_OPS = "vllm.model_executor.layers.mamba.ops"
UPSTREAM_KERNELS = ("_gather_initial_states_kernel", "_scatter_states_kernel")


def upstream_gdn_impl(release: str) -> tuple[str, tuple[Any, Any]]:
    """Return ``(label, (gather, scatter))`` of upstream vLLM's own GDN state copies (shipped from 0.30; the Kimi
    Linear and Kimi K3 layers call them in 0.33, the Qwen GDN layer from 0.34; the kernels are the same in 0.33 and
    0.34), as its GDN layers call them: ``gather_initial_states(state, indices, has_initial_state)`` (flag-false
    rows zero) and ``scatter_states(state, last, indices)`` (the cast to the cache dtype in the kernel's store).

    They are taken from the vLLM this process imports -- the released package, its warm-up dispatcher and platform
    (PDL where it says the GPU supports it) -- so run it where that release is installed or unpacked (on the H200:
    ``scripts/gpu/vllm_engine_check.py --peer`` after staging that release's carry).

    Raises:
        ValueError: the running vLLM is another version than ``release`` names.
        FileNotFoundError: the running vLLM has no such ops (before 0.34).
    """
    import importlib

    import vllm

    from kda_patches.releases.matrix import parse_spec

    _, version = parse_spec(release)
    running = str(vllm.__version__).split("+")[0]
    if running != version:
        raise ValueError(f"bench peer {release}: this process imports vLLM {vllm.__version__} from "
                         f"{vllm.__path__[0]}; run it where vLLM {version} is imported (on the H200: "
                         "scripts/gpu/vllm_engine_check.py --peer after staging that release's carry)")
    try:
        gather_module = importlib.import_module(f"{UPSTREAM_OPS}.gather_initial_states")
        scatter_module = importlib.import_module(f"{UPSTREAM_OPS}.scatter_states")
    except ImportError as error:
        raise FileNotFoundError(f"vLLM {running} has no GDN state-copy ops of its own ({error}); upstream ships "
                                "gather_initial_states / scatter_states from 0.30 (its Qwen GDN layer calls them "
                                "from 0.34)") from error

    def gather(state: Any, indices: Any, flags: Any) -> Any:
        return gather_module.gather_initial_states(state, indices, flags)

    def scatter(state: Any, last: Any, indices: Any) -> None:
        scatter_module.scatter_states(state, last, indices)

    return f"vllm-{running}", (gather, scatter)


def run_peer_benchmark(args: argparse.Namespace) -> int:
    """Run the GDN benchmark of ``args`` with the fork's kernels added as one more implementation.

    Returns:
        0 on success, 2 when the output exists, the device refuses, or the release cannot be loaded.
    """
    from kda_patches.bench.gdn_state_copy import run_gdn_benchmark
    from kda_patches.bench.peer_kimi import FOREIGN_KERNELS as KIMI_KERNELS
    from kda_patches.bench.peer_kimi import fork_kimi_impls
    from kda_patches.releases.fetch import ReleaseFetchError, release_dir
    from kda_patches.releases.load import PortMismatch
    from kda_patches.releases.matrix import parse_spec

    foreign: tuple[str, ...] = (*FOREIGN_KERNELS, *KIMI_KERNELS)
    try:
        if args.release.startswith("vllm=="):  # upstream's own ops, from the vLLM this process imports
            label, impl = upstream_gdn_impl(args.release)
            peers, ports, foreign = {label: impl}, {}, UPSTREAM_KERNELS
        else:
            label, impl = fork_gdn_impl(args.release)  # refuses anything but a vllm-ascend release first
            peers = {label: impl}
            dist, version = parse_spec(args.release)
            kimi, ports = fork_kimi_impls(release_dir(dist, version), label)
            peers.update(kimi)
    except (ValueError, FileNotFoundError, ReleaseFetchError, PortMismatch) as error:
        print(f"kda-patches bench peer: {error}")
        return 2
    runnable, not_run = {}, {}
    for name, peer in peers.items():
        reason = peer_unrunnable(peer, args.device)
        if reason is None:
            runnable[name] = peer
        else:
            not_run[name] = reason
            print(f"kda-patches bench peer: {name} is NOT measured on {args.device}: {reason}")
    args.foreign_kernels = foreign
    fields = {"peers": list(runnable), "peer_ports": ports, **({"peers_not_run": not_run} if not_run else {})}
    return run_gdn_benchmark(args, extra_impls=runnable, extra_fields=fields)


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
