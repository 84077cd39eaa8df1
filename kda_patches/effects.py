"""Proof by effect: what shows that an *applied* patch actually acted, read from the ledgers.

"Applied" only says a wrapper was installed. Seed 004's lesson is that an optimization can sit behind
an applied label and never run (a caller holding the original, an environment guard, a missing
reservation). Each patch therefore declares its evidence here, and :func:`judge_effect` reads it from the
ledgers of every process of a run (the engine core reserves memory, the workers bind caches, so only
the union tells):

- ``in effect``: the evidence is there, and no opportunity was missed;
- ``idle``: nothing came along to act on (no prefill batch, no KV cache bound in these processes):
  not a failure, and said so with the reason;
- ``not in effect``: something came along and the patch did not act on it (a call seen and bypassed,
  a prefill build left without host flags, separate mode requested and a state layer bound upstream or
  no reservation made). ``status`` and ``regress`` show it as its own state; under ``KDA_PATCHES_STRICT=1``
  the runtime refuses where it can tell at the moment (a bypassed call, a separate-mode state layer bound
  without its reservation) and ``regress`` fails the run.

Standard library only (and :mod:`kda_patches.ledger`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IN_EFFECT, IDLE, NOT_IN_EFFECT = "in effect", "idle", "not in effect"


@dataclass(frozen=True)
class CounterEffect:
    """Evidence as counters of one ledger section.

    Attributes:
        section: the counters' section (the patch's ``LEDGER_PATH``).
        acted: counters that show the patch acted (any > 0).
        missed: counters that show an opportunity it did not take (any > 0 is *not in effect*).
        seen: the counter of opportunities, for the message (None: none kept).
        idle: why no evidence can be fine (said when nothing was seen).
    """

    section: str
    acted: tuple[str, ...]
    missed: tuple[str, ...] = ()
    seen: str | None = None
    idle: str = "nothing to act on in these processes"

    def judge(self, counters: dict[str, dict[str, int]], facts: dict[str, dict[str, Any]]) -> tuple[str, str]:
        values = counters.get(self.section, {})
        missed = {name: values[name] for name in self.missed if values.get(name, 0) > 0}
        acted = {name: values[name] for name in self.acted if values.get(name, 0) > 0}
        seen = f"{self.seen} {values.get(self.seen, 0)}, " if self.seen else ""
        if missed:
            return NOT_IN_EFFECT, f"{seen}" + ", ".join(f"{name} {count}" for name, count in missed.items())
        if acted:
            return IN_EFFECT, f"{seen}" + ", ".join(f"{name} {count}" for name, count in acted.items())
        # the startup hook says why layers got no plan (e.g. vLLM's CPU backend runs them through its own kernels)
        unprepared = [fact for fact in facts.get(self.section, {}).values()
                      if isinstance(fact, dict) and fact.get("decision") == "not-prepared"]
        if unprepared:
            return IDLE, f"{seen}{len(unprepared)} layer(s) not prepared: {unprepared[0].get('reason', '?')}"
        return IDLE, f"{seen}{self.idle}"


@dataclass(frozen=True)
class LayoutEffect:
    """``kv_cache_layout``: every bound KV cache got a recorded layout decision; in separate mode the engine
    reserved the states' memory and the workers bound them dense."""

    section: str = "kv_cache_layout"

    def judge(self, counters: dict[str, dict[str, int]], facts: dict[str, dict[str, Any]]) -> tuple[str, str]:
        values = counters.get(self.section, {})
        layout = facts.get(self.section, {})
        summary = layout.get("summary")
        if summary is None:
            if values.get("plan_failures", 0):
                return NOT_IN_EFFECT, f"plan_failures {values['plan_failures']}"
            return IDLE, "no KV cache was bound in these processes"
        decisions = summary.get("decisions", {})
        told = ", ".join(f"{name} {count}" for name, count in sorted(decisions.items()))
        if summary.get("mode") == "separate":
            stranded = sorted(name for name, fact in layout.items()
                              if isinstance(fact, dict) and fact.get("kind") == "state"
                              and fact.get("decision") == "upstream" and "reserved no separate-state" in
                              str(fact.get("reason", "")))
            if stranded or "separate_budget" not in layout:
                why = (f"separate mode requested but {len(stranded)} state layers were bound upstream without a "
                       f"reservation ({', '.join(stranded[:3])})" if stranded else
                       "separate mode requested but no process reserved separate-state memory")
                return NOT_IN_EFFECT, why
            return IN_EFFECT, f"separate mode: {told}; state_binds_dense {values.get('state_binds_dense', 0)}"
        return IN_EFFECT, f"{summary.get('mode', 'auto')} mode: {told}"


_ROUTED = dict(acted=("calls_routed",), missed=("calls_bypassed", "calls_refused", "calls_failed"),
               seen="calls_seen", idle="no prefill call reached the seam in these processes")
EFFECTS: dict[str, Any] = {
    "gdn_host_flags": CounterEffect("gdn_host_flags", acted=("builds_flagged",),
                                    missed=("prefill_builds_without_host_metadata",), seen="builds_seen",
                                    idle="no prefill batch was built in these processes"),
    "kv_cache_layout": LayoutEffect(),
    "fl_attention_state": CounterEffect("fl_attention_state", acted=("contiguous_calls",),
                                        idle="no FL attention call in these processes"),
    "kimi_prefill": CounterEffect("kimi_prefill", **_ROUTED),
    "gdn_state_copy": CounterEffect("gdn_state_copy", **_ROUTED),
}


def judge_effect(patch: str, ledgers: list[dict[str, Any]]) -> tuple[str, str] | None:
    """Return ``(state, reason)`` of ``patch``'s effect over ledger snapshots (one or all processes).

    Args:
        patch: a registered patch name.
        ledgers: ledger snapshots (:meth:`kda_patches.ledger.Ledger.snapshot` dicts).
    Returns:
        ``(IN_EFFECT | IDLE | NOT_IN_EFFECT, reason)``; None when the patch declares no effect or no
        process has it applied (then its state says all there is).
    """
    effect = EFFECTS.get(patch)
    if effect is None:
        return None
    applied = [ledger for ledger in ledgers if ledger.get("patches", {}).get(patch, {}).get("state") == "applied"]
    if not applied:
        return None
    from kda_patches.ledger import sum_counters

    facts: dict[str, dict[str, Any]] = {}
    for ledger in ledgers:
        for section, values in ledger.get("facts", {}).items():
            facts.setdefault(section, {}).update(values)
    return effect.judge(sum_counters(ledgers), facts)
