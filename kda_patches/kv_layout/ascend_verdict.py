"""The verdict of one release x model x TP: every view the release built, proven with the aliasing checker.

:func:`describe_views` turns the views into :class:`~kda_patches.kv_layout.checker.Footprint` records per raw
storage, :func:`verdict_of` runs :class:`~kda_patches.kv_layout.checker.CheckerCache` over each storage and ranks
what it finds (``overlap found`` > ``out of storage`` > ``not checkable`` > ``proven``; :func:`ranked_verdict` also
returns the overlap's witness), :func:`witness_text` names an overlap's bytes, and :func:`run_case` executes one case
on an :class:`~kda_patches.kv_layout.ascend_stack.AscendStack` and returns its :class:`CaseResult`.
"""

from __future__ import annotations

import pathlib
import traceback
from typing import TYPE_CHECKING, Any

from kda_patches.kv_layout import ascend_models
from kda_patches.kv_layout.checker import CheckerCache, Footprint

if TYPE_CHECKING:
    from kda_patches.kv_layout.ascend_stack import AscendStack


class CaseResult:
    """One release x model x TP: the verdict and what it rests on.

    Attributes:
        verdict: ``proven``, ``overlap found``, ``out of storage`` or ``not checkable``.
        detail: the witness with its bytes (overlap), the checker's reason, or what stopped the release code.
        block_size, page_bytes, num_storages, num_views: facts of the layout (None when it was not built).
    """

    def __init__(self, verdict: str, detail: str, **facts: Any) -> None:
        self.verdict = verdict
        self.detail = detail
        self.block_size = facts.get("block_size")
        self.page_bytes = facts.get("page_bytes")
        self.num_storages = facts.get("num_storages")
        self.num_views = facts.get("num_views")


def block_footprint(tensor: Any, layer: str, part: str, group: int, num_blocks: int) -> Footprint:
    """The footprint of one KV-cache view whose leading dimension holds ``num_blocks`` blocks (whole rows each).

    Raises:
        ValueError: the rows are not a multiple of the block count, or the view is too irregular to describe.
    """
    from kda_patches.kv_layout.views import view_footprint

    rows = tensor.shape[0]
    if rows % num_blocks:
        raise ValueError(f"{layer}[{part}]: {rows} rows is not a multiple of {num_blocks} blocks")
    footprint = view_footprint(tensor, layer, part, group, 0, rows // num_blocks)
    if footprint is None:
        raise ValueError(f"{layer}[{part}]: view too irregular to describe {tuple(tensor.stride())}")
    return footprint


def describe_views(config: Any, views: dict[str, Any]) -> dict[Any, tuple[int, list[Footprint]]]:
    """Group every view the model would use by raw storage, as checker footprints.

    Block ids index dimension 0 of every Ascend view (block-first); a view with ``k`` times as many rows as the
    config has blocks is split by the kernel block size, so block id ``b`` owns rows ``b*k .. b*k+k-1``.

    Raises:
        ValueError: a view cannot be described (rows not a multiple of the block count, too irregular).
    """
    from kda_patches.kv_layout.views import storage_nbytes

    group_of = {name: index for index, group in enumerate(config.kv_cache_groups) for name in group.layer_names}
    storages: dict[Any, tuple[int, list[Footprint]]] = {}
    for layer, value in views.items():
        tensors = list(value) if isinstance(value, (list, tuple)) else [value]
        attention = not isinstance(value, list)
        for index, tensor in enumerate(tensors):
            if tensor is None:
                continue
            state = (("k", "v")[index] if len(tensors) == 2 else f"kv{index}") if attention else f"state{index}"
            footprint = block_footprint(tensor, layer, state, group_of[layer], config.num_blocks)
            entry = storages.setdefault(tensor.untyped_storage()._cdata, (storage_nbytes(tensor), []))
            entry[1].append(footprint)
    return storages


def witness_text(witness: dict[str, Any], footprints: list[Footprint], storage_nbytes: int) -> str:
    """The witness with the byte range each side addresses: ``A [x, y) and B [u, v) share byte n``."""
    sides = []
    for key, owner in zip("ab", witness["owners"], strict=True):
        named = witness[key]
        ranges = footprints[owner].block_bytes(named["block"])
        hit = next(((lo, hi) for lo, hi in ranges if lo <= witness["byte"] < hi), ranges[0])
        sides.append(f"`{named['layer']}` {named['state']} block {named['block']} (group {named['group']}) "
                     f"bytes [{hit[0]}, {hit[1]})")
    return f"{sides[0]} and {sides[1]} share byte {witness['byte']} (one storage of {storage_nbytes} bytes)"


def prove(config: Any, views: dict[str, Any]) -> tuple[str, str, int, int]:
    """Run the checker on every storage of ``views``: ``(verdict, detail, storages, views)``."""
    return verdict_of(describe_views(config, views))


def verdict_of(storages: dict[Any, tuple[int, list[Footprint]]]) -> tuple[str, str, int, int]:
    """The case's verdict from every storage's footprints: ``(verdict, detail, storages, views)``.

    ``overlap found`` (a witness: two block ids, or two layers of one group, share a byte) wins over ``out of
    storage``, which wins over ``not checkable`` (the checker gave up); ``proven`` needs every storage accepted.
    """
    verdict, detail, _, num_storages, num_views = ranked_verdict(storages)
    return verdict, detail, num_storages, num_views


def ranked_verdict(storages: dict[Any, tuple[int, list[Footprint]]]
                   ) -> tuple[str, str, tuple[dict[str, Any], list[Footprint]] | None, int, int]:
    """:func:`verdict_of` with the overlap's witness and the footprints of its storage (None unless an overlap).

    Returns:
        ``(verdict, detail, (witness, footprints) or None, storages, views)``.
    """
    cache = CheckerCache()
    verdicts = [(cache.check(footprints, nbytes), footprints, nbytes) for nbytes, footprints in storages.values()]
    num_views = sum(len(footprints) for _, footprints, _ in verdicts)
    for verdict, footprints, nbytes in verdicts:
        if verdict.status == "rejected" and verdict.witness is not None:
            return ("overlap found", witness_text(verdict.witness, footprints, nbytes), (verdict.witness, footprints),
                    len(storages), num_views)
    for verdict, _, _ in verdicts:
        if verdict.status == "rejected":
            return "out of storage", verdict.reason, None, len(storages), num_views
    for verdict, _, _ in verdicts:
        if verdict.status != "accepted":
            return "not checkable", f"checker: {verdict.reason}", None, len(storages), num_views
    return "proven", "", None, len(storages), num_views


def run_case(stack: AscendStack, model_name: str, tp: int) -> CaseResult:
    """Execute the release path for one model and TP and prove its views (see the module docstring)."""
    model = ascend_models.MODELS[model_name]
    try:
        vllm_config, config, views = stack.run(model, tp)
    except Exception as error:
        return CaseResult("not checkable", _stopped_by(error))
    facts = {"block_size": vllm_config.cache_config.block_size,
             "page_bytes": max(group.kv_cache_spec.page_size_bytes for group in config.kv_cache_groups)}
    try:
        verdict, detail, storages, num_views = prove(config, views)
    except ValueError as error:
        return CaseResult("not checkable", f"views: {error}", **facts)
    return CaseResult(verdict, detail, num_storages=storages, num_views=num_views, **facts)


def _stopped_by(error: BaseException) -> str:
    """``Type: message (release file:line)`` of the innermost release frame of ``error``."""
    frames = traceback.extract_tb(error.__traceback__)
    where = next((frame for frame in reversed(frames) if "/releases/" in frame.filename), frames[-1] if frames
                 else None)
    place = ""
    if where is not None:
        path = pathlib.Path(where.filename)
        parts = path.parts
        root = next((i for i, part in enumerate(parts) if part in ("vllm", "vllm_ascend")), len(parts) - 1)
        place = f" ({'/'.join(parts[root:])}:{where.lineno})"
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {message}{place}"
