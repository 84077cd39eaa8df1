"""``gdn_host_flags``: attach CPU-side prefill facts to GDN attention metadata.

Seed 004 §5: a prefill wrapper that asked the device ``torch.any(initial_state != 0)`` and
``cu_seqlens.cpu().tolist()`` paid two device->host synchronizations per layer per step. This
patch wraps the GDN metadata builders' ``build()`` and, after the original build, attaches facts
computed from the CPU copies of the batch metadata only, so consumers can decide without a sync:

- ``any_initial_state_cpu``: whether any prefill row has prior state (``num_computed_tokens > 0``);
- ``has_initial_state_host``: that flag per prefill row (tuple of bools);
- ``cu_seqlens_host``: the prefill rows' cumulative query lengths (tuple of ints, starts at 0),
  the host twin of ``prefill_query_start_loc``;
- ``prefill_chunk_totals``: ``{chunk_size: sum(ceil(len / chunk_size))}`` for 64 and 128.

Consumers read them with ``getattr(metadata, "any_initial_state_cpu", None)`` and keep their old
behaviour on ``None``. Nothing here reads a device tensor.
"""

from __future__ import annotations

from itertools import pairwise

from kda_patches.ledger import get_ledger
from kda_patches.outermost import OutermostCall
from kda_patches.registry import Patch, Target

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any

CHUNK_SIZES: tuple[int, ...] = (64, 128)
BUILD_PARAMETERS = ("self", "common_prefix_len", "common_attn_metadata", "num_accepted_tokens",
                    "num_decode_draft_tokens_cpu", "fast_build")
ASCEND_029_BUILD_PARAMETERS = (*BUILD_PARAMETERS, "num_actual_reqs")
LEDGER_PATH = "gdn_host_flags"


class HostFlags:
    """CPU-side prefill facts of one batch (see the module docstring for each field)."""

    __slots__ = ("any_initial_state_cpu", "has_initial_state_host", "cu_seqlens_host", "prefill_chunk_totals")

    def __init__(self, any_initial_state_cpu: bool, has_initial_state_host: tuple[bool, ...],
                 cu_seqlens_host: tuple[int, ...], prefill_chunk_totals: dict[int, int]) -> None:
        self.any_initial_state_cpu = any_initial_state_cpu
        self.has_initial_state_host = has_initial_state_host
        self.cu_seqlens_host = cu_seqlens_host
        self.prefill_chunk_totals = prefill_chunk_totals


def _host_list(value: Any) -> list[int]:
    """Return a CPU tensor / numpy array / sequence as a list of ints; refuse device tensors."""
    device = getattr(value, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise ValueError(f"gdn_host_flags only reads host metadata, got a tensor on {device}")
    return [int(item) for item in value.tolist()] if hasattr(value, "tolist") else [int(v) for v in value]


def compute_host_flags(common_attn_metadata: Any, metadata: Any, num_reqs: int | None = None) -> HostFlags | None:
    """Compute the host flags of a batch from CPU metadata only.

    Args:
        common_attn_metadata: vLLM ``CommonAttentionMetadata`` of the batch; reads
            ``query_start_loc_cpu`` and ``seq_lens_cpu_upper_bound`` (precise for prefill rows;
            vLLM 0.3x) or ``num_computed_tokens_cpu`` (vLLM 0.13-era).
        metadata: the built GDN metadata; reads ``num_decodes`` and ``spec_sequence_masks_cpu``
            to select the same prefill rows as the builder.
        num_reqs: the builder's ``num_actual_reqs`` (vllm-ascend 0.29+): only the first ``num_reqs``
            rows are real, the rest are graph padding the builder drops (None: every row is real).
    Returns:
        The :class:`HostFlags`, or None when the host copies needed are absent.
    """
    query_start = _host_list(common_attn_metadata.query_start_loc_cpu)
    if num_reqs is not None:
        query_start = query_start[: num_reqs + 1]
    query_lens = [end - start for start, end in pairwise(query_start)]
    computed = getattr(common_attn_metadata, "num_computed_tokens_cpu", None)
    if computed is not None:
        num_computed = _host_list(computed)[: len(query_lens)]
    else:
        seq_upper = getattr(common_attn_metadata, "seq_lens_cpu_upper_bound", None)
        if seq_upper is None:
            return None
        seq_lens = _host_list(seq_upper)[: len(query_lens)]
        num_computed = [seq - qlen for seq, qlen in zip(seq_lens, query_lens, strict=True)]

    rows = list(range(len(query_lens)))
    spec_mask = getattr(metadata, "spec_sequence_masks_cpu", None)
    if spec_mask is not None:
        mask = _host_list(spec_mask)[: len(rows)]
        rows = [row for row, is_spec in zip(rows, mask, strict=True) if not is_spec]
    elif metadata.num_decodes > 0:
        rows = rows[metadata.num_decodes:]

    cu_seqlens = [0]
    for row in rows:
        cu_seqlens.append(cu_seqlens[-1] + query_lens[row])
    has_initial = tuple(num_computed[row] > 0 for row in rows)
    totals = {size: sum(-(-query_lens[row] // size) for row in rows) for size in CHUNK_SIZES}
    return HostFlags(any(has_initial), has_initial, tuple(cu_seqlens), totals)


def attach_host_flags(metadata: Any, flags: HostFlags) -> None:
    """Set the :class:`HostFlags` fields as attributes of the built metadata object."""
    metadata.any_initial_state_cpu = flags.any_initial_state_cpu
    metadata.has_initial_state_host = flags.has_initial_state_host
    metadata.cu_seqlens_host = flags.cu_seqlens_host
    metadata.prefill_chunk_totals = flags.prefill_chunk_totals


_outermost_build = OutermostCall()


def wrap_build(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``build()``: run the original, then attach host flags to prefill batches.

    A subclass override that calls ``super().build()`` is wrapped too; only the outermost call
    computes and counts, so each batch is flagged once. vllm-ascend 0.29+ passes ``num_actual_reqs``
    (6th argument): the flags then describe only those real rows, as the builder's own metadata does.
    """
    metadata, outermost = _outermost_build.run(wrapped, args, kwargs)
    if not outermost:
        return metadata
    ledger = get_ledger()
    ledger.count(LEDGER_PATH, "builds_seen")
    if getattr(metadata, "num_prefills", 0) > 0:
        common = kwargs["common_attn_metadata"] if "common_attn_metadata" in kwargs else args[1]
        num_reqs = kwargs.get("num_actual_reqs", args[5] if len(args) > 5 else None)
        flags = compute_host_flags(common, metadata, num_reqs)
        if flags is None:
            ledger.count(LEDGER_PATH, "prefill_builds_without_host_metadata")
        else:
            attach_host_flags(metadata, flags)
            ledger.count(LEDGER_PATH, "builds_flagged")
    return metadata


def _build_target(module: str, qualname: str, stack: str, distribution: str, min_version: str | None,
                  max_version: str | None, parameters: tuple[str, ...] = BUILD_PARAMETERS,
                  shapes: tuple[str, ...] = ()) -> Target:
    return Target(module=module, qualname=qualname, wrapper=wrap_build, stack=stack, distribution=distribution,
                  min_version=min_version, max_version=max_version, parameters=parameters, shapes=shapes)


_ASCEND_BUILDER = ("vllm_ascend.ops.gdn_attn_builder", "AscendGDNAttentionMetadataBuilder.build")

# Ranges as the released sources show them (kda-patches conformance re-reads them): the upstream builder
# has the same six parameters in vLLM 0.13.0 and 0.26.0-0.34.0; the Kimi K3 NVIDIA builder first ships in
# 0.27.1, the ROCm one in 0.32.0; vllm-ascend 0.26.0rc1-0.28.0rc1 have six parameters, 0.29.0rc1-0.30.0rc2
# seven (+ num_actual_reqs). Upper bounds are the first release not read yet.
PATCH = Patch(
    name="gdn_host_flags",
    summary="attach CPU-side prefill facts to GDN metadata so prefill decisions need no device sync",
    targets=(
        _build_target("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder.build",
                      "vllm", "vllm", "0.13", "0.35"),
        _build_target("vllm.models.kimi_k3.nvidia.kda_metadata", "KimiK3KDAMetadataBuilder.build",
                      "vllm", "vllm", "0.27", "0.35"),
        _build_target("vllm.models.kimi_k3.amd.kda_metadata", "KimiK3ROCmKDAMetadataBuilder.build",
                      "vllm", "vllm", "0.32", "0.35"),
        _build_target(*_ASCEND_BUILDER, "vllm-ascend", "vllm-ascend", "0.26", "0.29"),
        _build_target(*_ASCEND_BUILDER, "vllm-ascend", "vllm-ascend", "0.29", "0.31",
                      parameters=ASCEND_029_BUILD_PARAMETERS, shapes=("unpads:m.unpadded(_, num_actual_reqs)",)),
        _build_target("vllm_fl.dispatch.backends.vendor.ascend.impl.gdn_attn_builder",
                      "AscendGDNAttentionMetadataBuilder.build", "vllm-plugin-FL", "vllm-plugin-fl", None, None),
    ),
)
