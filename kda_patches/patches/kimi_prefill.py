"""``kimi_prefill``: route the Kimi KDA layer's prefill state copy through a sealed state-copy plan.

Seed 000 / DESIGN §4.1. The Kimi layer's prefill gathers each request's initial recurrent state out of
the cache rows (clearing rows that have no initial state), runs the chunk math, and scatters the final
state back. This patch replaces exactly that gather(+clear) and that scatter with the layer's
worker-owned plan (:mod:`kda_patches.state_copy`), prepared and sealed at worker startup; the chunk
math and everything else in the layer stay the fork's own code.

Targets (one record, one switch ``kimi_prefill``):

- vllm-ascend ``vllm_ascend.ops.kimi_kda.AscendKimiK3DeltaAttention._run_prefill`` and the
  ``clear_ssm_states`` name its module calls (the clear folded into the plan's gather is elided);
- upstream vLLM ``vllm.models.kimi_k3.nvidia.kda.KimiK3DeltaAttention._forward`` (which has no
  ``_run_prefill``: the seam is the prefill branch of ``_forward``) and the ``gather_initial_states``
  name that module calls;
- the worker startup hook on ``initialize_kv_cache`` of vLLM's V1/V2 ``GPUModelRunner`` and
  vllm-ascend's V1/V2 ``NPUModelRunner``: after the KV cache is bound, every layer whose class is
  patched here (or that is marked ``_requires_kda_state_copy``) gets its plan; all are prepared and
  sealed before any is published; a failure aborts startup naming the layer.

How a call is routed (:mod:`kda_patches.kimi.routing`; the upstream seam in :mod:`kda_patches.kimi.upstream`):
for the duration of one call the layer's recurrent-state cache is replaced by a zero-copy alias of a tensor
subclass whose ``__getitem__`` / ``__setitem__`` send an integer-vector index to the plan; every other use
of the alias behaves like the plain cache (its ``__torch_function__`` is disabled, so nothing else pays). Each call must
route exactly one gather and one scatter, otherwise it is counted ``calls_bypassed`` (and raises under
``KDA_PATCHES_STRICT=1``). A layer without a published plan refuses prefill with an error naming it.

Importing this module imports neither torch nor vLLM: the wrappers below load the routing code on
their first call. Tests build the same record for their reference layers with :func:`build_patch`.
"""

from __future__ import annotations

from kda_patches.registry import Patch, Target

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any

LEDGER_PATH = "kimi_prefill"

RUN_PREFILL_PARAMETERS = ("self", "q", "k", "v", "raw_gate", "beta", "recurrent_state", "state_indices",
                          "has_initial_state", "prebuilt_metadata")
CLEAR_PARAMETERS = ("ssm_states", "has_initial_state")
FORWARD_PARAMETERS = ("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out")
GATHER_PARAMETERS = ("state", "indices", "has_initial_state")
VLLM_RUNNER_PARAMETERS = ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context")
ASCEND_RUNNER_PARAMETERS = ("self", "kv_cache_config")

_routing: Any = None
_upstream: Any = None
_startup: Any = None


def _load_routing() -> Any:
    global _routing
    from kda_patches.kimi import routing  # deferred: imports torch

    _routing = routing
    return routing


def _load_upstream() -> Any:
    global _upstream
    from kda_patches.kimi import upstream  # deferred: imports torch

    _upstream = upstream
    return upstream


def _load_startup() -> Any:
    global _startup
    from kda_patches.kimi import startup  # deferred: imports torch

    _startup = startup
    return startup


def wrap_run_prefill(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``_run_prefill``: route its gather(+clear) and scatter through the layer's plan."""
    return (_routing or _load_routing()).route_run_prefill(wrapped, instance, args, kwargs)


def wrap_clear_ssm_states(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the module-level ``clear_ssm_states``: elide the clear the plan's gather already did."""
    return (_routing or _load_routing()).route_clear_ssm_states(wrapped, instance, args, kwargs)


def wrap_upstream_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of upstream ``KimiK3DeltaAttention._forward``: route its prefill state copy."""
    return (_upstream or _load_upstream()).route_upstream_forward(wrapped, instance, args, kwargs)


def wrap_gather_initial_states(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the module-level ``gather_initial_states``: gather through the plan inside a routed call."""
    return (_upstream or _load_upstream()).route_gather_initial_states(wrapped, instance, args, kwargs)


def wrap_initialize_kv_cache(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``initialize_kv_cache``: after the cache is bound, prepare and publish every plan."""
    return (_startup or _load_startup()).route_initialize_kv_cache(wrapped, instance, args, kwargs)


SEAM_WRAPPERS = (wrap_run_prefill, wrap_upstream_forward)


def build_targets(ascend: tuple[str, str] | None = None, upstream: tuple[str, str] | None = None,
                  runners: tuple[tuple[str, str, tuple[str, ...]], ...] = (), stack: str = "vllm-ascend",
                  upstream_stack: str = "vllm", distribution: str | None = None,
                  upstream_distribution: str | None = None, min_version: str | None = None,
                  max_version: str | None = None, upstream_min_version: str | None = None,
                  upstream_max_version: str | None = None) -> tuple[Target, ...]:
    """Build the target list of the patch for given modules and classes (the real stacks or test modules).

    Args:
        ascend: ``(module, class)`` of a layer shaped like vllm-ascend's (``_run_prefill`` + a module-level
            ``clear_ssm_states``), or None.
        upstream: ``(module, class)`` of a layer shaped like upstream vLLM's (``_forward`` + a module-level
            ``gather_initial_states``), or None.
        runners: ``(module, class, parameters)`` of model runners whose ``initialize_kv_cache`` gets the
            startup hook; ``parameters`` is that method's expected signature.
        stack: stack label of the ascend-shaped targets (and of runners in a module starting with ``vllm_ascend``).
        upstream_stack: stack label of the upstream-shaped targets and other runners.
        distribution: distribution whose version is checked for ascend-shaped targets (None: no check).
        upstream_distribution: the same for upstream-shaped targets and runners.
        min_version: lowest supported version of ``distribution`` (inclusive).
        max_version: first unsupported version of ``distribution``.
        upstream_min_version: lowest supported version of ``upstream_distribution``.
        upstream_max_version: first unsupported version of ``upstream_distribution``.
    Returns:
        The targets, in order: layer seams, module-level copy functions, runner hooks.
    """
    def target(module: str, qualname: str, wrapper: Any, parameters: tuple[str, ...], ascend_side: bool) -> Target:
        if ascend_side:
            return Target(module, qualname, wrapper, stack, distribution or stack, min_version if distribution
                          else None, max_version if distribution else None, parameters)
        return Target(module, qualname, wrapper, upstream_stack, upstream_distribution or upstream_stack,
                      upstream_min_version if upstream_distribution else None,
                      upstream_max_version if upstream_distribution else None, parameters)

    targets = []
    if ascend is not None:
        module, cls = ascend
        targets.append(target(module, f"{cls}._run_prefill", wrap_run_prefill, RUN_PREFILL_PARAMETERS, True))
        targets.append(target(module, "clear_ssm_states", wrap_clear_ssm_states, CLEAR_PARAMETERS, True))
    if upstream is not None:
        module, cls = upstream
        targets.append(target(module, f"{cls}._forward", wrap_upstream_forward, FORWARD_PARAMETERS, False))
        targets.append(target(module, "gather_initial_states", wrap_gather_initial_states, GATHER_PARAMETERS,
                              False))
    for module, cls, parameters in runners:
        targets.append(target(module, f"{cls}.initialize_kv_cache", wrap_initialize_kv_cache, parameters,
                              module.startswith("vllm_ascend")))
    return tuple(targets)


def build_patch(name: str = "kimi_prefill", **target_options: Any) -> Patch:
    """Return a :class:`Patch` named ``name`` whose targets are ``build_targets(**target_options)``."""
    return Patch(name=name, summary="route the Kimi KDA prefill gather(+clear)/scatter through sealed "
                 "state-copy plans prepared at worker startup", targets=build_targets(**target_options))


PATCH = build_patch(
    "kimi_prefill",
    ascend=("vllm_ascend.ops.kimi_kda", "AscendKimiK3DeltaAttention"),
    upstream=("vllm.models.kimi_k3.nvidia.kda", "KimiK3DeltaAttention"),
    runners=(("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", VLLM_RUNNER_PARAMETERS),
             ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", VLLM_RUNNER_PARAMETERS),
             ("vllm_ascend.worker.model_runner_v1", "NPUModelRunner", ASCEND_RUNNER_PARAMETERS),
             ("vllm_ascend.worker.v2.model_runner", "NPUModelRunner", ASCEND_RUNNER_PARAMETERS)),
    distribution="vllm-ascend", min_version="0.26", max_version="0.40",
    upstream_distribution="vllm", upstream_min_version="0.30", upstream_max_version="0.40",
)


def format_status_line(snapshot: dict[str, Any]) -> str:
    """Return the one-line ``status`` summary of this patch from a ledger snapshot.

    Args:
        snapshot: ``Ledger.snapshot()`` (or a ledger JSON file's content).
    Returns:
        e.g. ``kimi_prefill: prefill calls seen 12, routed 12, bypassed 0; plans fused=4 (model.layers.0…)``.
    """
    counters = snapshot.get("counters", {}).get(LEDGER_PATH, {})
    facts = snapshot.get("facts", {}).get(LEDGER_PATH, {})
    kinds: dict[str, list[str]] = {}
    for layer, fact in sorted(facts.items()):
        if isinstance(fact, dict) and "plan_kind" in fact:
            kinds.setdefault(fact["plan_kind"], []).append(layer)
    plans = ", ".join(f"{kind}={len(layers)} ({layers[0]}{'…' if len(layers) > 1 else ''})"
                      for kind, layers in sorted(kinds.items())) or "none published"
    line = (f"{LEDGER_PATH}: prefill calls seen {counters.get('calls_seen', 0)}, routed "
            f"{counters.get('calls_routed', 0)}, bypassed {counters.get('calls_bypassed', 0)}")
    for extra in ("calls_refused", "calls_failed"):
        if counters.get(extra):
            line += f", {extra.split('_')[1]} {counters[extra]}"
    return f"{line}; plans {plans}"
