"""Release eras of the state-copy patch records: coupled target groups and the runners' startup signatures.

Both state-copy records (``kimi_prefill``, ``gdn_state_copy``) declare their targets per release era: a seam,
the copy functions its module calls and the model runners' ``initialize_kv_cache`` hooks, applied together or
not at all (:func:`era`). The runners' signatures change between releases; :func:`upstream_runners` and
:func:`ascend_runners` give each era's members with that era's fingerprint. Standard library only: the
records build these at ``import kda_patches``.
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


def release_tuple(version: str) -> tuple[int, ...]:
    """Return ``"0.27"`` / ``"0.27.1"`` as ``(0, 27)`` / ``(0, 27, 1)`` (era bounds are plain releases)."""
    return tuple(int(part) for part in version.split("."))


def era(distribution: str, low: str, high: str, members: tuple[tuple[Any, ...], ...],
        chosen_by: tuple[str, str | tuple[str, ...]] | None = None,
        stands_aside: str | None = None) -> tuple[Target, ...]:
    """Return one coupled group of targets valid for ``distribution`` in ``[low, high)``.

    A release era is one group (named ``<distribution>-<low>``): its members -- a seam, the copy functions
    its module calls, the startup hooks -- are applied together or not at all. A key that changes between
    eras (a runner's signature, the Kimi class name) has one sibling per era, each in that era's group.

    Args:
        distribution: ``vllm`` or ``vllm-ascend`` (also the stack label).
        low, high: the era's version range.
        members: ``(module, qualname, wrapper, parameters, shapes)`` per target.
        chosen_by, stands_aside: an era the user opts into (``Target.chosen_by``): every member is inert with
            the ``stands_aside`` text unless the switch has the chosen value.
    Returns:
        The era's targets, in the order given.
    """
    return tuple(Target(module, qualname, wrapper, distribution, distribution, low, high, parameters,
                        f"{distribution}-{low}", shapes, inert=stands_aside, chosen_by=chosen_by)
                 for module, qualname, wrapper, parameters, shapes in members)


def upstream_runners(wrapper: Any, low: str, rebind: Any = None) -> tuple[tuple[Any, ...], ...]:
    """Return the era members for vLLM's runner hooks (signatures by era).

    Before 0.34: V1 and V2 ``GPUModelRunner.initialize_kv_cache``. From 0.34 the V1 runner is gone (its module
    is not shipped, so it is no member: not drift) and the V2 runner's hook gained ``extensible``; the
    extensible KV cache rebinds every layer after warmup through the module-level ``extend_kv_cache``
    (imported by name in ``gpu_worker``; the registry rebinds that alias), whose ``rebind`` wrapper is a member.

    Args:
        wrapper: the startup wrapper of the record.
        low: the era's lowest release (vLLM < 0.30 has the older signatures).
        rebind: the record's ``extend_kv_cache`` wrapper (required from 0.34).
    """
    if release_tuple(low) >= (0, 34):
        if rebind is None:
            raise ValueError(f"a vLLM >= 0.34 era ({low}) needs the extend_kv_cache wrapper (rebind=)")
        return (("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.initialize_kv_cache", wrapper,
                 VLLM_V2_RUNNER_PARAMETERS_034, ()),
                ("vllm.v1.worker.extensible_kv_cache", "extend_kv_cache", rebind, EXTEND_KV_CACHE_PARAMETERS, ()))
    old = release_tuple(low) < (0, 30)
    return (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.initialize_kv_cache", wrapper,
             VLLM_RUNNER_PARAMETERS_027 if old else VLLM_RUNNER_PARAMETERS, ()),
            ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.initialize_kv_cache", wrapper,
             VLLM_V2_RUNNER_PARAMETERS_027 if old else VLLM_RUNNER_PARAMETERS, ()))


def ascend_runners(wrapper: Any, low: str) -> tuple[tuple[Any, ...], ...]:
    """Return the era members for vllm-ascend's V1/V2 ``NPUModelRunner.initialize_kv_cache`` (signature by era).

    Args:
        wrapper: the startup wrapper of the record.
        low: the era's lowest release (vllm-ascend >= 0.28 passes ``kv_cache_allocation_context``).
    """
    parameters = ASCEND_RUNNER_PARAMETERS if release_tuple(low) < (0, 28) else ASCEND_RUNNER_PARAMETERS_028
    return tuple((module, "NPUModelRunner.initialize_kv_cache", wrapper, parameters, ())
                 for module in NPU_RUNNER_MODULES)
