"""``kv_cache_layout``: dense state views and contiguous attention KV, only where provably memory-safe.

Seed 004 §2.3 and §6: kernels that address state caches densely (the AscendC GDN ops) need each state
tensor dense, and attention code that calls ``.contiguous()`` on a K/V-interleaved hybrid cache copies the
whole cache per layer per step. The seed fixed both unconditionally; but vLLM's hybrid allocator overlays
cache groups on the same raw storage, so moving a block's bytes into pages of other block ids corrupts other
requests. This patch wraps the runner's KV-cache view construction, runs the aliasing checker
(:mod:`kda_patches.kv_layout.checker`) on upstream's layout and on the proposed one, and changes a layout only
when the proof succeeds; every verdict is a ledger fact (section ``kv_cache_layout``, keyed by layer).

Targets (ranges as the released sources show them; ``kda-patches conformance`` re-reads them):
- vLLM 0.13: ``GPUModelRunner._reshape_kv_cache_tensors(self, kv_cache_config, kv_cache_raw_tensors,
  kernel_block_sizes)`` (dense state views in place, or separate, then contiguous attention KV) and
  ``_update_hybrid_attention_mamba_layout(self, kv_caches)`` (when called on its own: contiguous attention KV);
  the same-named methods of vllm-plugin-FL's ``ModelRunnerFL`` (no registry release; unranged).
- vLLM 0.26: ``_reshape_kv_cache_tensors(self, kv_cache_raw_tensors, kernel_block_sizes)`` (the config is
  ``self.kv_cache_config``), state layers still get per-state views: the 0.13 adapter applies.
- vLLM 0.27-0.28: the same reshape signature, but a state layer's view is one raw ``[B, 1, 1, C]`` page view
  that ``MambaBase.bind_kv_cache`` slices; the 0.13 adapter describes those views like the 0.3x adapter
  (:mod:`kda_patches.kv_layout.era013`), and the reshape and ``bind_kv_cache`` are coupled (group
  ``page-views-reshape``).
- vLLM 0.29-0.33: ``vllm.v1.worker.utils.allocate_kv_cache`` (decide) and ``MambaBase.bind_kv_cache`` (bind the
  chosen dense states), coupled (group ``page-views-allocate``).
- vLLM 0.34: ``vllm.v1.worker.extensible_kv_cache.extend_kv_cache(runner, kv_cache_config, num_blocks)`` is a
  read-only verifier (:mod:`kda_patches.kv_layout.rebind_verify`): after the extensible KV cache rebinds every
  layer's views (``committed_views`` -> ``bind_kv_caches``), the views bound to the layers are proven with the
  checker per address space; proven, nothing changes and the ledger says "upstream layout proven" (fact
  ``upstream_layout``); an overlap (or a view out of its storage) refuses to go on before a request is served, with
  the witness; not checkable keeps them with a WARNING (refused under STRICT). ``gpu_worker`` holds the function by
  name; the registry rebinds that alias. The planner/allocation/bind targets stay inert there: no layout is changed
  (the released layouts of Kimi K3, Qwen3.6-27B and Qwen3-Next at TP 1/2/4/8 are proven before and after the
  rebind, ``docs/results/ascend-kv-layout``), and with ``--no-enable-extensible-kv-cache`` nothing is verified.
- ``get_kv_cache_configs`` — only with ``KDA_PATCHES_KV_STATE_MODE=separate``: shrink the KV budget by the
  separate states' memory and stamp the reservation on the configs. ``vllm.v1.core.kv_cache_utils`` up to 0.32;
  ``vllm.v1.core.kv_cache_planning`` from 0.33 (a 4th parameter ``global_kv_cache_groups``, passed through).
- vllm-ascend: ``NPUModelRunner._reshape_kv_cache_tensors`` 0.13 (the 0.13 adapter); 0.26-0.30
  (``(self, kv_cache_config, kv_cache_raw_tensors)``, 0.30 ``+ kernel_block_sizes``): a read-only verifier
  (:mod:`kda_patches.kv_layout.ascend_verify`): the fork's own views are proven with the checker as soon as the
  reshape returns; proven, they are kept and the ledger says "upstream layout proven"; an overlap (or a view out of
  its storage) refuses to start with the witness and the fix; not checkable keeps them with a WARNING (refused
  under STRICT). The V1 runner only: the V2 runner (``VLLM_USE_V2_MODEL_RUNNER=1``) and the 310P runner do not call
  this reshape and are not verified.

Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

from kda_patches.ledger import get_ledger
from kda_patches.outermost import OutermostCall
from kda_patches.registry import Patch, Target

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any


LEDGER_PATH = "kv_cache_layout"
RESHAPE_PARAMETERS = ("self", "kv_cache_config", "kv_cache_raw_tensors", "kernel_block_sizes")
RESHAPE_026_PARAMETERS = ("self", "kv_cache_raw_tensors", "kernel_block_sizes")
ASCEND_RESHAPE_PARAMETERS = ("self", "kv_cache_config", "kv_cache_raw_tensors")
ASCEND_RESHAPE_030_PARAMETERS = (*ASCEND_RESHAPE_PARAMETERS, "kernel_block_sizes")
UPDATE_HYBRID_PARAMETERS = ("self", "kv_caches")
UPDATE_HYBRID_026_PARAMETERS = ("self", "kv_caches", "kernel_block_sizes")
ALLOCATE_PARAMETERS = ("kv_cache_config", "device", "layout", "kernel_block_sizes")
BIND_PARAMETERS = ("self", "kv_cache")
EXTEND_PARAMETERS = ("runner", "kv_cache_config", "num_blocks")
CONFIGS_PARAMETERS = ("vllm_config", "kv_cache_specs", "available_memory")
CONFIGS_033_PARAMETERS = (*CONFIGS_PARAMETERS, "global_kv_cache_groups")

_outermost_reshape = OutermostCall()


class LayoutPlanError(RuntimeError):
    """Raised when the layout could not be decided: startup stops, nothing was published."""


def _mode() -> str:
    from kda_patches import current_flags

    return current_flags().kv_state_mode


def _argument(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _plan(apply: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run an adapter's ``apply_layouts``; turn any failure into :class:`LayoutPlanError`."""
    try:
        summary = apply(*args, **kwargs)
    except Exception as error:
        get_ledger().count(LEDGER_PATH, "plan_failures")
        raise LayoutPlanError(f"kda_patches kv_cache_layout: could not decide the KV-cache layout "
                              f"({type(error).__name__}: {error}); nothing was changed. Disable the patch with "
                              f"KDA_PATCHES_DISABLE=kv_cache_layout to run upstream's layout.") from error
    get_ledger().count(LEDGER_PATH, "plans")
    return summary


def _reshape_config(instance: Any, args: tuple, kwargs: dict) -> Any:
    """The ``KVCacheConfig`` of a reshape call: its first argument in 0.13, ``self.kv_cache_config`` from 0.26."""
    if "kv_cache_config" in kwargs:
        return kwargs["kv_cache_config"]
    if args and hasattr(args[0], "kv_cache_groups"):
        return args[0]
    return instance.kv_cache_config


def wrap_reshape_kv_cache_tensors(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """vLLM 0.13-0.28: run upstream's reshape (K/V re-stride included), then apply the proven layouts.

    A subclass override that calls ``super()`` is wrapped too; only the outermost call plans.
    """
    kv_caches, outermost = _outermost_reshape.run(wrapped, args, kwargs)
    if not outermost:
        return kv_caches
    config = _reshape_config(instance, args, kwargs)
    from kda_patches.kv_layout.era013 import apply_layouts

    _plan(apply_layouts, config, kv_caches, _mode())
    return kv_caches


def wrap_update_hybrid_attention_mamba_layout(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """0.13 era: upstream re-strides; called on its own (not from a wrapped reshape), undo it where proven safe."""
    result = wrapped(*args, **kwargs)
    if _outermost_reshape.active:
        return result  # the reshape wrapper decides once the state layout is known
    kv_caches = _argument(args, kwargs, 0, "kv_caches")
    from kda_patches.kv_layout.era013 import apply_layouts

    _plan(apply_layouts, instance.kv_cache_config, kv_caches, _mode(), states=False)
    return result


def _installed_release() -> str:
    """``vllm-ascend X + vLLM Y`` as installed here (for the verifier's messages)."""
    from kda_patches.registry import find_version

    fork = find_version(PATCH.siblings(f"{_ASCEND_RUNNER}:NPUModelRunner._reshape_kv_cache_tensors")[0])
    return f"vllm-ascend {fork or 'unknown'} + vLLM {find_version(PATCH.targets[0]) or 'unknown'}"


def wrap_ascend_reshape_kv_cache_tensors(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """vllm-ascend 0.26-0.30: run the fork's reshape, then prove its views or refuse to start (read-only)."""
    kv_caches = wrapped(*args, **kwargs)
    from kda_patches import current_flags
    from kda_patches.kv_layout.ascend_verify import model_name, verify

    verify(_argument(args, kwargs, 0, "kv_cache_config"), kv_caches, _installed_release(), model_name(instance),
           current_flags().strict)
    return kv_caches


def format_status_line(snapshot: dict[str, Any]) -> str:
    """The one-line ``status`` summary: a verifier's verdict (vllm-ascend, or vLLM 0.34's rebind), else the layout
    decisions by kind."""
    facts = snapshot.get("facts", {}).get(LEDGER_PATH, {})
    verifier = facts.get("ascend_layout", facts.get("upstream_layout"))
    if isinstance(verifier, dict):
        from kda_patches.kv_layout.ascend_verify import status_line

        return status_line(verifier)
    summary = facts.get("summary")
    if not isinstance(summary, dict):
        return "kv_cache_layout: no KV cache laid out in this process"
    decisions = ", ".join(f"{name} {count}" for name, count in sorted(summary.get("decisions", {}).items()))
    return f"kv_cache_layout: {summary.get('mode')} mode, {summary.get('layers')} layers: {decisions or 'none'}"


def wrap_extend_kv_cache(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """vLLM 0.34: run the release's rebind, then prove the views it bound or refuse to go on (read-only)."""
    result = wrapped(*args, **kwargs)
    from kda_patches import current_flags
    from kda_patches.kv_layout.ascend_verify import model_name
    from kda_patches.kv_layout.rebind_verify import bound_views, verify_rebind
    from kda_patches.registry import find_version

    runner = _argument(args, kwargs, 0, "runner")
    config, views = bound_views(runner)
    verify_rebind(config, views, f"vLLM {find_version(PATCH.targets[0]) or 'unknown'}", model_name(runner),
                  current_flags().strict)
    return result


def wrap_allocate_kv_cache(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """0.3x era: after upstream allocates and views the pool, decide the state layouts."""
    kv_caches = wrapped(*args, **kwargs)
    config = _argument(args, kwargs, 0, "kv_cache_config")
    from kda_patches.kv_layout.era032 import apply_layouts

    _plan(apply_layouts, config, kv_caches, _mode())
    return kv_caches


def wrap_mamba_bind_kv_cache(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """vLLM 0.27+: bind the planned dense states instead of slicing the page view (counted in the ledger)."""
    kv_cache = _argument(args, kwargs, 0, "kv_cache")
    from kda_patches.kv_layout.era032 import bound_state_views

    states = bound_state_views(instance, kv_cache)
    if states is None:
        get_ledger().count(LEDGER_PATH, "state_binds_upstream")
        return wrapped(*args, **kwargs)
    instance.kv_cache = states
    get_ledger().count(LEDGER_PATH, "state_binds_dense")
    return None


def wrap_get_kv_cache_configs(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Separate mode only: ask again with the separate states' memory taken out, and stamp the reservation."""
    configs = wrapped(*args, **kwargs)
    if _mode() != "separate":
        return configs
    from kda_patches.kv_layout import budget

    memory = _argument(args, kwargs, 2, "available_memory")
    reduced = budget.reduced_memory(configs, memory)
    if reduced is not None:  # the same call with only the memory changed (0.33's 4th argument passes through)
        if "available_memory" in kwargs:
            configs = wrapped(*args, **{**kwargs, "available_memory": reduced})
        else:
            configs = wrapped(*args[:2], reduced, *args[3:], **kwargs)
    stamps = [budget.stamp_reservation(config) for config in configs]
    get_ledger().set_fact(LEDGER_PATH, "separate_budget", {
        "available_memory": list(memory), "reduced_memory": reduced, "workers": stamps})
    return configs


def _target(module: str, qualname: str, wrapper: Any, parameters: tuple[str, ...] | None, stack: str = "vllm",
            distribution: str = "vllm", min_version: str | None = None, max_version: str | None = None,
            group: str | None = None, inert: str | None = None, shapes: tuple[str, ...] = ()) -> Target:
    return Target(module=module, qualname=qualname, wrapper=wrapper, stack=stack, distribution=distribution,
                  min_version=min_version, max_version=max_version, parameters=parameters, group=group, inert=inert,
                  shapes=shapes)


_RUNNER = "vllm.v1.worker.gpu_model_runner"
_FL_RUNNER = "vllm_fl.worker.model_runner"
_ASCEND_RUNNER = "vllm_ascend.worker.model_runner_v1"
# what the read-only verifier relies on in the fork (kda_patches.releases.shapes; conformance: "verifies")
ASCEND_VERIFY_SHAPE = "verify:npu_reshape_views_bound"
# what the vLLM 0.34 rebind verifier relies on (the views extend_kv_cache rebuilds are the ones it binds)
EXTEND_VERIFY_SHAPE = "verify:extend_kv_cache_binds_committed_views"
_BIND = ("vllm.model_executor.layers.mamba.abstract", "MambaBase.bind_kv_cache", wrap_mamba_bind_kv_cache,
         BIND_PARAMETERS)
_EXTENSIBLE_INERT = ("vLLM 0.34's extensible KV cache (default on CUDA/ROCm) rebuilds every layer's views after "
                     "warmup in extend_kv_cache; its own layout is proven there instead (read-only verifier on "
                     "extend_kv_cache; issue 53), so no dense or separate state layout is decided on 0.34")

PATCH = Patch(
    name="kv_cache_layout",
    summary="dense state views and contiguous attention KV, each only where an aliasing proof allows it",
    targets=(
        _target(_RUNNER, "GPUModelRunner._reshape_kv_cache_tensors", wrap_reshape_kv_cache_tensors,
                RESHAPE_PARAMETERS, min_version="0.13", max_version="0.14"),
        _target(_RUNNER, "GPUModelRunner._reshape_kv_cache_tensors", wrap_reshape_kv_cache_tensors,
                RESHAPE_026_PARAMETERS, min_version="0.26", max_version="0.27"),
        _target(_RUNNER, "GPUModelRunner._reshape_kv_cache_tensors", wrap_reshape_kv_cache_tensors,
                RESHAPE_026_PARAMETERS, min_version="0.27", max_version="0.29", group="page-views-reshape"),
        _target(_RUNNER, "GPUModelRunner._update_hybrid_attention_mamba_layout",
                wrap_update_hybrid_attention_mamba_layout, UPDATE_HYBRID_PARAMETERS, min_version="0.13",
                max_version="0.14"),
        _target(_RUNNER, "GPUModelRunner._update_hybrid_attention_mamba_layout",
                wrap_update_hybrid_attention_mamba_layout, UPDATE_HYBRID_026_PARAMETERS, min_version="0.26",
                max_version="0.29"),
        _target(_FL_RUNNER, "ModelRunnerFL._reshape_kv_cache_tensors", wrap_reshape_kv_cache_tensors,
                RESHAPE_PARAMETERS, stack="vllm-plugin-FL", distribution="vllm_fl"),
        _target(_FL_RUNNER, "ModelRunnerFL._update_hybrid_attention_mamba_layout",
                wrap_update_hybrid_attention_mamba_layout, UPDATE_HYBRID_PARAMETERS, stack="vllm-plugin-FL",
                distribution="vllm_fl"),
        _target(_ASCEND_RUNNER, "NPUModelRunner._reshape_kv_cache_tensors", wrap_reshape_kv_cache_tensors,
                ASCEND_RESHAPE_PARAMETERS, stack="vllm-ascend", distribution="vllm-ascend", min_version="0.13",
                max_version="0.14"),
        _target(_ASCEND_RUNNER, "NPUModelRunner._reshape_kv_cache_tensors", wrap_ascend_reshape_kv_cache_tensors,
                ASCEND_RESHAPE_PARAMETERS, stack="vllm-ascend", distribution="vllm-ascend", min_version="0.26",
                max_version="0.30", shapes=(ASCEND_VERIFY_SHAPE,)),
        _target(_ASCEND_RUNNER, "NPUModelRunner._reshape_kv_cache_tensors", wrap_ascend_reshape_kv_cache_tensors,
                ASCEND_RESHAPE_030_PARAMETERS, stack="vllm-ascend", distribution="vllm-ascend", min_version="0.30",
                max_version="0.31", shapes=(ASCEND_VERIFY_SHAPE,)),
        _target("vllm.v1.worker.utils", "allocate_kv_cache", wrap_allocate_kv_cache, ALLOCATE_PARAMETERS,
                min_version="0.29", max_version="0.34", group="page-views-allocate"),
        _target(*_BIND, min_version="0.27", max_version="0.29", group="page-views-reshape"),
        _target(*_BIND, min_version="0.29", max_version="0.34", group="page-views-allocate"),
        _target("vllm.v1.core.kv_cache_utils", "get_kv_cache_configs", wrap_get_kv_cache_configs,
                CONFIGS_PARAMETERS, min_version="0.13", max_version="0.33"),
        _target("vllm.v1.core.kv_cache_planning", "get_kv_cache_configs", wrap_get_kv_cache_configs,
                CONFIGS_033_PARAMETERS, min_version="0.33", max_version="0.34"),
        _target("vllm.v1.worker.extensible_kv_cache", "extend_kv_cache", wrap_extend_kv_cache, EXTEND_PARAMETERS,
                min_version="0.34", max_version="0.35", shapes=(EXTEND_VERIFY_SHAPE,)),
        *(_target(module, qualname, None, None, min_version="0.34", max_version="0.35", inert=_EXTENSIBLE_INERT)
          for module, qualname in (("vllm.v1.worker.utils", "allocate_kv_cache"), _BIND[:2],
                                   ("vllm.v1.core.kv_cache_planning", "get_kv_cache_configs"))),
    ),
)
