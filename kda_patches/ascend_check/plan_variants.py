"""Every kernel variant the state-copy plans can prepare on an Ascend chip class, enumerated from the plans.

Nothing here is a hand list of kernels: for each supported model's per-rank state shape, each cache
dtype and each chip class, :func:`~kda_patches.state_copy.device.route_plan` picks the plan class
exactly as a worker would, and :meth:`~kda_patches.state_copy.plan.StateCopyPlan.variant_specs` returns
the variants that plan's ``prepare`` would compile (block capped by the chip class's unified-buffer
limits, constexprs, pointer types). The NaN rule of a cast is probed with torch on the device at
prepare, which cannot run here, so every rule of :data:`~kda_patches.state_copy.casts.NAN_RULES` is
enumerated; and since a plan's block is the one every variant it compiles fits, every set of final
dtypes a plan can be prepared for (each non-empty subset of FP32, BF16, FP16) is enumerated too.
Variants that compile to the same code (same kernel, pointer types and constexprs) for the same cache
dtype are checked once and carry every model they serve.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from kda_patches.state_copy import casts
from kda_patches.state_copy.device import TARGETS, route_plan
from kda_patches.state_copy.plan import PLAN_CLASSES

# Per-rank recurrent-state shapes [H, V, K] of the supported models' state-copy layers at their usual
# tensor-parallel splits (value heads / TP; 128x128 heads). The compiled code depends on the shape only
# through PAYLOAD, TILES and ROW_STRIDE, so these cover the payload classes from 4 to 48 heads.
MODEL_SHAPES: dict[str, tuple[int, int, int]] = {
    "kimi-k3-kda": (12, 128, 128),  # the seed-000 benchmark cache
    "qwen3.6-27b-gdn-tp1": (48, 128, 128),
    "qwen3.6-27b-gdn-tp4": (12, 128, 128),
    "qwen3.5-397b-gdn-tp8": (8, 128, 128),
    "qwen3-next-80b-gdn-tp2": (16, 128, 128),
    "qwen3-next-80b-gdn-tp8": (4, 128, 128),
    "olmo-hybrid-gdn-tp1": (32, 128, 128),
    "kimi-linear-kda-tp4": (8, 128, 128),
    "qwen3.6-27b-gdn-tp8": (6, 128, 128),
    "kimi-linear-kda-tp1": (32, 128, 128),
}
# The meta cache's row count. Not compiled in: the kernels take it per launch as the runtime argument
# ``num_rows`` (signature ``i32``, what Triton types the host's ``shape[0]`` below 2**31 as, never specialized
# on its value: :data:`~kda_patches.state_copy.kernels.ROWS_TYPE`), so any count enumerates the same variants.
CACHE_ROWS = 1024
PAGE_GAP_ITEMS = 4096  # rows of a vLLM hybrid cache are pages: the conv state sits in the gap
MAX_SELECTED = 256
CHIP_SOCS = {"a2a3": "Ascend910B3", "a5": "Ascend950PR_9599"}  # build-time SOC names (device.is_ascend_a5)
CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


@dataclass
class VariantCase:
    """One distinct compiled variant for one chip class.

    Attributes:
        chip: ``"a2a3"`` or ``"a5"``.
        plan: the plan kind (``fused``/``fallback``) the chip routes that cache dtype to.
        name: the plan's variant name (``fallback/scatter/int32/float32``).
        cache_dtype, final_dtype: cache and packed dtype names (the final dtype of a gather is the cache's).
        nan_rule: the cast's NaN rule name, ``"bit copy"`` when no cast is folded.
        family: the block-limit family, ``block`` the block in the family's items.
        kernel: the JIT function; ``signature`` and ``constexprs`` as ``triton.compile`` takes them (the
            signature in parameter order: the four pointers, the runtime row count ``num_rows: i32``, then
            every constexpr).
        models: the model shapes that prepare this variant.
    """

    chip: str
    plan: str
    name: str
    cache_dtype: str
    final_dtype: str
    nan_rule: str
    family: str
    block: int
    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    models: list[str] = field(default_factory=list)

    def key(self) -> tuple[Any, ...]:
        """The identity of the compiled code (kernel, signature, constexprs) on this chip, per cache dtype (the
        byte copy of a BF16 and of an FP16 cache is the same code, listed under both)."""
        return (self.chip, self.cache_dtype, self.kernel.__name__, tuple(self.signature.items()),
                tuple(self.constexprs.items()))

    def row(self) -> tuple[str, ...]:
        """The matrix row this variant belongs to (shape-independent facts)."""
        return (self.plan, self.name, self.cache_dtype, self.nan_rule, self.family, str(self.block))


def cast_policies(cache: torch.dtype, rule: int,
                  finals: tuple[torch.dtype, ...] = casts.FINAL_DTYPES) -> dict[torch.dtype, casts.CastPolicy]:
    """Return one policy per final dtype of ``finals`` into ``cache``, casts under NaN ``rule``."""
    return {final: casts.CastPolicy(final, cache, rule, CANONICAL_NAN[cache] if rule == casts.NAN_CANONICAL else 0)
            for final in finals}


def final_dtype_sets() -> list[tuple[torch.dtype, ...]]:
    """Return every non-empty set of final dtypes a plan can be prepared for."""
    return [subset for size in range(1, len(casts.FINAL_DTYPES) + 1)
            for subset in itertools.combinations(casts.FINAL_DTYPES, size)]


def meta_cache(inner: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """Return a ``meta`` cache ``[CACHE_ROWS, H, V, K]`` with a page gap between rows (no storage)."""
    payload = inner[0] * inner[1] * inner[2]
    stride = (payload + PAGE_GAP_ITEMS, inner[1] * inner[2], inner[2], 1)
    return torch.empty_strided((CACHE_ROWS, *inner), stride, dtype=dtype, device="meta")


def enumerate_variants(chips: tuple[str, ...] = ("a2a3", "a5"),
                       shapes: dict[str, tuple[int, int, int]] | None = None) -> list[VariantCase]:
    """Return the distinct variants the plans prepare on each chip class, for every model shape.

    Args:
        chips: chip classes (keys of :data:`CHIP_SOCS`).
        shapes: model name -> per-rank ``(H, V, K)`` (default :data:`MODEL_SHAPES`).
    Returns:
        Distinct :class:`VariantCase` s, each listing the models that prepare it, in a stable order.
    """
    found: dict[tuple[Any, ...], VariantCase] = {}
    npu = SimpleNamespace(type="npu")
    for chip in chips:
        for model, inner in (shapes or MODEL_SHAPES).items():
            for cache in casts.FINAL_DTYPES:
                route = route_plan(npu, cache, CHIP_SOCS[chip])
                plan_class = PLAN_CLASSES[route.kind]
                assert route.target is TARGETS[f"ascend-{chip}"], (chip, route.target.name)
                state = meta_cache(inner, cache)
                for rule, finals in itertools.product(casts.NAN_RULES, final_dtype_sets()):
                    for spec in plan_class.variant_specs(state, MAX_SELECTED, route.target,
                                                         cast_policies(cache, rule, finals)):
                        case = _case(chip, route.kind, cache, rule, spec)
                        found.setdefault(case.key(), case).models.append(model)
    for case in found.values():
        case.models = sorted(set(case.models))
    return sorted(found.values(), key=lambda case: (case.chip, case.row(), case.key()))


def _case(chip: str, plan: str, cache: torch.dtype, rule: int, spec: dict[str, Any]) -> VariantCase:
    final = casts.dtype_name(spec["final"] or cache)  # a gather's "final" dtype is the cache's
    folds_cast = final != casts.dtype_name(cache)
    signature = dict(spec["signature"])  # the row count among them: a runtime argument, compiled as its type only
    block = spec["constexprs"]["BLOCK"]
    return VariantCase(chip, plan, spec["name"], casts.dtype_name(cache), final,
                       casts.NAN_RULES[rule] if folds_cast else "bit copy", spec["family"], block, spec["kernel"],
                       signature, dict(spec["constexprs"]))


def probe_case(chip: str, family: str, cases: list[VariantCase] | None = None) -> VariantCase:
    """Return the first variant of ``family`` the plans prepare on ``chip``; for a family the chip's plans
    never use (a fused copy on A2/A3, a cast into an FP32 cache on A5), the variant of that family's plan
    class for a Kimi-K3 cache, built the same way.

    Args:
        chip, family: what to find.
        cases: ``enumerate_variants((chip,))`` when the caller already has it (enumerated otherwise).
    Raises:
        KeyError: no plan kernel belongs to ``family``.
    """
    for case in cases if cases is not None else enumerate_variants((chip,)):
        if case.family == family:
            return case
    target = TARGETS[f"ascend-{chip}"]
    names = {casts.dtype_name(dtype): dtype for dtype in casts.FINAL_DTYPES}
    kind, _, pair = family.partition("/")
    source, _, cache = pair.partition("->")
    plan = {"fused": "fused", "cast_items": "fallback"}.get(kind)
    if plan and source in names and cache in names:
        state = meta_cache(MODEL_SHAPES["kimi-k3-kda"], names[cache])
        policies = {names[source]: cast_policies(names[cache], casts.NAN_QUIET)[names[source]]}
        for spec in PLAN_CLASSES[plan].variant_specs(state, MAX_SELECTED, target, policies):
            if spec["family"] == family and spec["pointers"][2] == torch.int64 and \
                    ("/scatter/" in spec["name"]) == (source != cache):
                return _case(chip, plan, names[cache], casts.NAN_QUIET, spec)
    raise KeyError(f"no state-copy kernel variant belongs to block-limit family {family!r} on {chip}")
