"""vLLM 0.34's extensible KV cache of real models, proven with the checker before and after ``extend_kv_cache``.

:class:`~kda_patches.kv_layout.upstream034_stack.Upstream034Stack` executes the release's path on the CPU; this
module describes the views it bound and ranks the checker's findings (as
:mod:`kda_patches.kv_layout.ascend_verdict` does for the fork), once for the views bound at ``initialize_kv_cache``
(every block id of the reservation) and once for those ``extend_kv_cache`` rebound (the final block ids).

Views are grouped by **address space**, not by storage object: after the rebind every layer's view is its own
DLPack tensor over a segment of one reservation (``committed_views``), so layers of different groups that share a
segment have different storage objects over the same bytes. :func:`describe_address_spaces` merges storages whose
byte ranges intersect into one space and places every footprint at its address in it, so the checker compares
them all; each view is also checked alone against its own storage (a view reaching past the committed bytes it
was given is ``out of storage``).
"""

from __future__ import annotations

from typing import Any

from kda_patches.kv_layout import ascend_models
from kda_patches.kv_layout.ascend_verdict import CaseResult, _stopped_by, ranked_verdict
from kda_patches.kv_layout.checker import Footprint

PHASES = ("before", "after")  # initialize_kv_cache's views (the reservation), extend_kv_cache's (the final blocks)


def _tensors(value: Any) -> list[tuple[str, Any]]:
    """``(part, tensor)`` of one layer's bound cache: a state list (``state0``...) or one attention tensor (``kv``)."""
    if isinstance(value, (list, tuple)):
        return [(f"state{index}", tensor) for index, tensor in enumerate(value) if tensor is not None]
    return [("kv", value)]


def describe_address_spaces(config: Any, views: dict[str, Any]) -> dict[Any, tuple[int, list[Footprint]]]:
    """Every bound view as a checker footprint, by address space (see the module docstring).

    Args:
        config: the ``KVCacheConfig`` the views were built for (groups name each layer's group; ``num_blocks`` the
            block ids).
        views: layer -> the tensor or state tensors bound to it.

    Returns:
        ``{key: (bytes, footprints)}``: one entry per address space (storages whose bytes intersect), footprints at
        their addresses in it, and one entry per view against its own storage alone.

    Raises:
        ValueError: a view cannot be described (rows not a multiple of the block count, too irregular).
    """
    from kda_patches.kv_layout.ascend_verdict import block_footprint

    group_of = {name: index for index, group in enumerate(config.kv_cache_groups) for name in group.layer_names}
    described = []
    for layer, value in views.items():
        for part, tensor in _tensors(value):
            footprint = block_footprint(tensor, layer, part, group_of[layer], config.num_blocks)
            storage = tensor.untyped_storage()
            described.append((footprint, storage.data_ptr(), storage.nbytes()))
    spaces: list[list[int]] = []  # [start, end) of each merged address space
    for _, start, nbytes in sorted(described, key=lambda item: item[1]):
        if spaces and start < spaces[-1][1]:
            spaces[-1][1] = max(spaces[-1][1], start + nbytes)
        else:
            spaces.append([start, start + nbytes])
    found: dict[Any, tuple[int, list[Footprint]]] = {}
    for index, (footprint, start, nbytes) in enumerate(described):
        space = next(space for space in spaces if space[0] <= start < space[1])
        moved = Footprint(footprint.layer, footprint.state, footprint.group, footprint.base + start - space[0],
                          footprint.stride, footprint.num_blocks, footprint.runs)
        found.setdefault(("space", space[0]), (space[1] - space[0], []))[1].append(moved)
        found[("own", index)] = (nbytes, [footprint])
    return found


def prove_phase(config: Any, views: dict[str, Any]) -> tuple[str, str, int, int]:
    """``(verdict, detail, address spaces, views)`` of one phase's views (:func:`ranked_verdict`'s ranking)."""
    described = describe_address_spaces(config, views)
    verdict, detail, _, _, num_views = ranked_verdict({key: value for key, value in described.items()
                                                      if key[0] == "space"})
    if verdict == "proven":  # each view inside the storage it was given (its committed bytes after the rebind)
        own = ranked_verdict({key: value for key, value in described.items() if key[0] == "own"})
        verdict, detail = own[0], own[1]
    return verdict, detail, sum(key[0] == "space" for key in described), num_views


class RebindResult:
    """One model x TP on vLLM 0.34: a :class:`CaseResult` per phase and the layout facts.

    Attributes:
        phases: ``before`` / ``after`` -> :class:`CaseResult`.
        layout: the resolved KV cache layout's name; capacity / final: the block ids of each phase.
    """

    def __init__(self, phases: dict[str, CaseResult], layout: str | None = None, capacity: int | None = None,
                 final: int | None = None) -> None:
        self.phases = phases
        self.layout, self.capacity, self.final = layout, capacity, final

    @property
    def verdict(self) -> str:
        """The worse phase's verdict (ranked as the checker's findings are)."""
        order = ("overlap found", "out of storage", "not checkable", "proven")
        return min((result.verdict for result in self.phases.values()), key=order.index)


def run_case(stack: Any, model_name: str, tp: int) -> RebindResult:
    """Execute the release path for one model and TP and prove both phases' views."""
    model = ascend_models.MODELS[model_name]
    try:
        run = stack.run(model, tp)
    except Exception as error:
        stopped = CaseResult("not checkable", _stopped_by(error))
        return RebindResult({phase: stopped for phase in PHASES})
    facts = {"block_size": run.vllm_config.cache_config.block_size,
             "page_bytes": max(group.kv_cache_spec.page_size_bytes for group in run.config_before.kv_cache_groups)}
    phases = {}
    for phase, config, views in (("before", run.config_before, run.views_before),
                                 ("after", run.config_after, run.views_after)):
        try:
            verdict, detail, spaces, num_views = prove_phase(config, views)
        except ValueError as error:
            phases[phase] = CaseResult("not checkable", f"views: {error}", **facts)
            continue
        phases[phase] = CaseResult(verdict, detail, num_storages=spaces, num_views=num_views, **facts)
    return RebindResult(phases, run.layout.name, run.config_before.num_blocks, run.config_after.num_blocks)
