"""Release eras of the state-copy patch records: coupled target groups and the runners' startup signatures.

Both state-copy records (``kimi_prefill``, ``gdn_state_copy``) declare their targets per release era: a seam,
the copy functions its module calls and the model runners' ``initialize_kv_cache`` hooks, applied together or
not at all (:func:`era`). The runners' signatures change between releases, and not always where an era starts
(vLLM 0.29 added ``kv_cache_allocation_context`` inside the 0.27-0.29 era of the seams): they are data, one
table per runner module with the release span of each signature (:data:`UPSTREAM_RUNNER_SIGNATURES`,
:data:`ASCEND_RUNNER_SIGNATURES`), and :func:`upstream_runners` / :func:`ascend_runners` give an era one member
per signature, each kept to its span. Standard library only: the records build these at ``import kda_patches``.
"""

from __future__ import annotations

from kda_patches.registry import Target

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any

CLEAR_PARAMETERS = ("ssm_states", "has_initial_state")
GATHER_PARAMETERS = ("state", "indices", "has_initial_state")
VLLM_RUNNER_PARAMETERS = ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context")
VLLM_RUNNER_PARAMETERS_027 = ("self", "kv_cache_config", "is_profiling")
VLLM_V2_RUNNER_PARAMETERS_027 = ("self", "kv_cache_config")
VLLM_V2_RUNNER_PARAMETERS_034 = ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context", "extensible")
EXTEND_KV_CACHE_PARAMETERS = ("runner", "kv_cache_config", "num_blocks")
ASCEND_RUNNER_PARAMETERS = ("self", "kv_cache_config")
ASCEND_RUNNER_PARAMETERS_028 = ("self", "kv_cache_config", "kv_cache_allocation_context")
NPU_RUNNER_MODULES = ("vllm_ascend.worker.model_runner_v1", "vllm_ascend.worker.v2.model_runner")
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"

# ``initialize_kv_cache`` fingerprints per runner module: (first release, first release without it, parameters),
# None = open; read from the released sources (tests/releases/test_runner_signatures.py re-reads every release).
# vLLM 0.29 gave both runners is_profiling and kv_cache_allocation_context; 0.34 dropped the V1 runner's module and
# gave the V2 one extensible.
UPSTREAM_RUNNER_SIGNATURES: dict[str, tuple[tuple[str | None, str | None, tuple[str, ...]], ...]] = {
    V1_RUNNER_MODULE: ((None, "0.29", VLLM_RUNNER_PARAMETERS_027), ("0.29", "0.34", VLLM_RUNNER_PARAMETERS)),
    V2_RUNNER_MODULE: ((None, "0.29", VLLM_V2_RUNNER_PARAMETERS_027), ("0.29", "0.34", VLLM_RUNNER_PARAMETERS),
                       ("0.34", None, VLLM_V2_RUNNER_PARAMETERS_034)),
}
# vllm-ascend 0.28 gave both NPU runners kv_cache_allocation_context
ASCEND_RUNNER_SIGNATURES: tuple[tuple[str | None, str | None, tuple[str, ...]], ...] = (
    (None, "0.28", ASCEND_RUNNER_PARAMETERS), ("0.28", None, ASCEND_RUNNER_PARAMETERS_028))


def release_tuple(version: str) -> tuple[int, ...]:
    """Return ``"0.27"`` / ``"0.27.1"`` as ``(0, 27)`` / ``(0, 27, 1)`` (era bounds are plain releases)."""
    return tuple(int(part) for part in version.split("."))


def _later(first: str | None, second: str | None) -> str | None:
    """The later of two lower bounds (None: open)."""
    return second if first is None or (second is not None and release_tuple(second) > release_tuple(first)) \
        else first


def _earlier(first: str | None, second: str | None) -> str | None:
    """The earlier of two upper bounds (None: open)."""
    return second if first is None or (second is not None and release_tuple(second) < release_tuple(first)) \
        else first


def era(distribution: str, low: str, high: str, members: tuple[tuple[Any, ...], ...],
        chosen_by: tuple[str, str | tuple[str, ...]] | None = None,
        stands_aside: str | None = None) -> tuple[Target, ...]:
    """Return one coupled group of targets valid for ``distribution`` in ``[low, high)``.

    A release era is one group (named ``<distribution>-<low>``): its members -- a seam, the copy functions
    its module calls, the startup hooks -- are applied together or not at all. A key that changes between
    eras (a runner's signature, the Kimi class name) has one sibling per era, each in that era's group.
    A member may carry its own release span (a sixth item ``(from, to)``, None open): it is declared for the
    part of the era inside that span only, and not at all when the two do not meet -- so a runner whose
    signature changes inside an era is one sibling per signature, each in the era's group.

    Args:
        distribution: ``vllm`` or ``vllm-ascend`` (also the stack label).
        low, high: the era's version range.
        members: ``(module, qualname, wrapper, parameters, shapes)`` per target, optionally ``+ (span,)``.
        chosen_by, stands_aside: an era the user opts into (``Target.chosen_by``): every member is inert with
            the ``stands_aside`` text unless the switch has the chosen value.
    Returns:
        The era's targets, in the order given.
    """
    targets = []
    for module, qualname, wrapper, parameters, shapes, *span in members:
        first, last = (_later(low, span[0][0]), _earlier(high, span[0][1])) if span else (low, high)
        if first is not None and last is not None and release_tuple(first) >= release_tuple(last):
            continue  # the member's span and the era do not meet
        targets.append(Target(module, qualname, wrapper, distribution, distribution, first, last, parameters,
                              f"{distribution}-{low}", shapes, inert=stands_aside, chosen_by=chosen_by))
    return tuple(targets)


def _runner_members(module: str, cls: str, wrapper: Any,
                    signatures: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...]:
    return tuple((module, f"{cls}.initialize_kv_cache", wrapper, parameters, (), (first, last))
                 for first, last, parameters in signatures)


def upstream_runners(wrapper: Any, low: str, rebind: Any = None) -> tuple[tuple[Any, ...], ...]:
    """Return the era members for vLLM's runner hooks, one per signature (:data:`UPSTREAM_RUNNER_SIGNATURES`).

    Before 0.34: V1 and V2 ``GPUModelRunner.initialize_kv_cache``. From 0.34 the V1 runner is gone (its module
    is not shipped, so it is no member: not drift) and the V2 runner's hook gained ``extensible``; the
    extensible KV cache rebinds every layer after warmup through the module-level ``extend_kv_cache``
    (imported by name in ``gpu_worker``; the registry rebinds that alias), whose ``rebind`` wrapper is a member.
    :func:`era` keeps each signature's member to the part of the era its span covers.

    Args:
        wrapper: the startup wrapper of the record.
        low: the era's lowest release.
        rebind: the record's ``extend_kv_cache`` wrapper (required from 0.34).
    """
    if release_tuple(low) >= (0, 34):
        if rebind is None:
            raise ValueError(f"a vLLM >= 0.34 era ({low}) needs the extend_kv_cache wrapper (rebind=)")
        return (*_runner_members(V2_RUNNER_MODULE, "GPUModelRunner", wrapper,
                                 UPSTREAM_RUNNER_SIGNATURES[V2_RUNNER_MODULE]),
                ("vllm.v1.worker.extensible_kv_cache", "extend_kv_cache", rebind, EXTEND_KV_CACHE_PARAMETERS, ()))
    return tuple(member for module, signatures in UPSTREAM_RUNNER_SIGNATURES.items()
                 for member in _runner_members(module, "GPUModelRunner", wrapper, signatures))


def ascend_runners(wrapper: Any, low: str) -> tuple[tuple[Any, ...], ...]:
    """Return the era members for vllm-ascend's V1/V2 ``NPUModelRunner.initialize_kv_cache``, one per signature
    (:data:`ASCEND_RUNNER_SIGNATURES`; :func:`era` keeps each to its span).

    Args:
        wrapper: the startup wrapper of the record.
        low: the era's lowest release (unused: the spans decide; kept for the records' calls).
    """
    return tuple(member for module in NPU_RUNNER_MODULES
                 for member in _runner_members(module, "NPUModelRunner", wrapper, ASCEND_RUNNER_SIGNATURES))


# KDA_PATCHES_STATE_IO=indexed (kda_patches.indexed_chunk): vLLM's vendored FLA chunk-state host function, which every
# Triton GDN/KDA prefill reaches (Qwen, Olmo, Kimi Linear, Kimi K3); its kernel has the indexed twin
FLA_CHUNK_STATE_MODULE = "vllm.third_party.flash_linear_attention.ops.chunk_delta_h"
FLA_CHUNK_STATE_HOST = "chunk_gated_delta_rule_fwd_h"
FLA_CHUNK_STATE_KERNEL = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
FLA_CHUNK_STATE_PARAMETERS = ("k", "w", "u", "g", "gk", "initial_state", "output_final_state", "chunk_size",
                              "save_new_value", "cu_seqlens", "chunk_indices", "chunk_offsets", "use_exp2")
# the dtype of the final states the host returns (``k.new_empty(N, H, V, K, dtype=torch.float32)`` in every release)
FLA_CHUNK_STATE_FINAL_DTYPE = "float32"
BLOCK_POINTER_FORM = (
    "vLLM 0.26-0.31's chunk-state kernel loads and stores its states through block pointers (tl.make_block_ptr); "
    "its indexed twin derives, but the Triton interpreter of the CPU tests cannot run that form, so the twin is "
    "unverified there and these releases keep copying (KDA_PATCHES_STATE_IO has no effect)")
# The chunk-state host each vLLM release's seams reach, as data: (first release, first release without, module of
# ``chunk_gated_delta_rule_fwd_h``, None where its kernel has a verified indexed twin, else why the span keeps
# copying), None = open; read from the released sources (every release 0.26-0.34 ships the host at the same module;
# 0.32 rewrote its kernel with masked pointers, the form 0.34 keeps). :func:`indexed_host_targets` gives each record
# era the part of this table it covers: adding a release (or a host moved to another module) is a row here.
FLA_CHUNK_STATE_RELEASES: tuple[tuple[str | None, str | None, str, str | None], ...] = (
    ("0.26", "0.32", FLA_CHUNK_STATE_MODULE, BLOCK_POINTER_FORM),
    ("0.32", None, FLA_CHUNK_STATE_MODULE, None),
)


# the KDA_PATCHES_STATE_IO choices that wrap a chunk-state host: everywhere, and in an era with a seam measured faster
# with no copy (``IndexedChunk.measured``) also the default, which runs only that seam's calls indexed
STATE_IO_WRAPS = ("indexed", "auto")
STATE_IO_WRAPS_MEASURED = (*STATE_IO_WRAPS, "measured")


def indexed_host_targets(wrapper: Any, low: str, high: str, group: str | None, stands_aside: str,
                         releases: tuple[tuple[str | None, str | None, str, str | None], ...] =
                         FLA_CHUNK_STATE_RELEASES, chosen: tuple[str, ...] = STATE_IO_WRAPS) -> tuple[Target, ...]:
    """Return the chunk-state host targets of a record's vLLM era, each applied only under a
    ``KDA_PATCHES_STATE_IO`` of ``chosen``: one per row of ``releases`` that meets ``[low, high)``, kept to the part
    of the era it covers.

    A row with a reason is a declared gap (an inert target without a group: the era's seams keep copying there,
    and the support matrix says why); a row without one is the opted-in host, a member of the era's group (it
    applies with the seams that reach it).

    Args:
        wrapper: the record's :class:`~kda_patches.routing.wrappers.IndexedHostWrapper` (its ``indexed`` names the
            host, module and kernel).
        low, high: the era's version range.
        group: the era's group.
        stands_aside: the inert text of an opted-in host (why it stays unwrapped under a choice not in ``chosen``).
        releases: the table (:data:`FLA_CHUNK_STATE_RELEASES`).
        chosen: the choices that wrap it (:data:`STATE_IO_WRAPS`; :data:`STATE_IO_WRAPS_MEASURED` in an era with a
            measured seam).
    Returns:
        The era's host targets, in the table's order (none where no row meets the era).
    Raises:
        ValueError: a row meeting the era names another module than the wrapper's host (the seams' ``indexed``
            declaration and this table disagree).
    """
    indexed = wrapper.indexed
    targets = []
    for first, last, module, gap in releases:
        first, last = _later(low, first), _earlier(high, last)
        if first is not None and last is not None and release_tuple(first) >= release_tuple(last):
            continue  # the row and the era do not meet
        if module != indexed.module:
            raise ValueError(f"vLLM {first}-{last}: the chunk-state host is declared at {module}, but the era's "
                             f"seams reach {indexed.key}; declare an IndexedChunk for that module")
        shapes = (f"indexed:{indexed.kernel}",)
        if gap is not None:
            targets.append(Target(module, indexed.host, None, "vllm", "vllm", first, last, FLA_CHUNK_STATE_PARAMETERS,
                                  None, (), inert=gap))
        else:
            targets.append(Target(module, indexed.host, wrapper, "vllm", "vllm", first, last,
                                  FLA_CHUNK_STATE_PARAMETERS, group, shapes, inert=stands_aside,
                                  chosen_by=("state_io", chosen)))
    return tuple(targets)


class UncastFinalGate:
    """An indexed seam whose scatter stores the host's final states without a cast (``S[I] = final``): exact under
    the twin only into a cache of the host's final dtype (:data:`FLA_CHUNK_STATE_FINAL_DTYPE`).

    Into any other cache the release's own ``index_put`` refuses the FP32 final states (and raises); so does the copy
    route, which runs that assignment as written. The twin would store them cast instead, so a layer whose cache
    has another dtype only copies (:meth:`stands_aside_on`), as a :class:`~kda_patches.routing.seams.BackendGate`
    makes a layer on an unserved backend copy (``IndexedChunk.backend``).

    Attributes:
        slot: the layer's ``kv_cache`` entry holding the recurrent state.
        dtype: the one cache dtype the twin serves (``"float32"``).
        reason: why.
    """

    __slots__ = ("dtype", "reason", "slot")

    def __init__(self, slot: int, dtype: str, reason: str) -> None:
        self.slot, self.dtype, self.reason = slot, dtype, reason

    def __repr__(self) -> str:
        return f"UncastFinalGate(slot={self.slot}, dtype={self.dtype!r})"

    def stands_aside_on(self, layer: Any) -> str | None:
        """Return why ``layer``'s cache is not served (its dtype named), or None when it is.

        Args:
            layer: the seam's layer (its ``kv_cache[slot]``).
        Returns:
            None for a cache of :attr:`dtype`, else the reason with the dtype found.
        """
        cache = getattr(layer, "kv_cache", None)
        state = cache[self.slot] if isinstance(cache, (tuple, list)) and len(cache) > self.slot else None
        found = str(getattr(state, "dtype", None)).removeprefix("torch.")
        return None if found == self.dtype else f"recurrent-state cache dtype {found} (served: {self.dtype}): " \
            f"{self.reason}"
