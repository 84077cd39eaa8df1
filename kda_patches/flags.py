"""The one place where ``KDA_PATCHES*`` environment variables are parsed and validated.

Every switch a user can flip is declared in :data:`SWITCHES`; :func:`parse_flags` turns an
environment mapping into an immutable :class:`Flags` record. Unknown ``KDA_PATCHES_*``
variables and unknown patch names in ``KDA_PATCHES_DISABLE`` / ``KDA_PATCHES_ONLY`` are warned
about with the list of valid choices; malformed values raise :class:`ValueError` naming the
variable and what it accepts. Stdlib only: this runs from ``sitecustomize``.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here

if TYPE_CHECKING:
    from typing import Iterable, Mapping

SWITCHES: dict[str, str] = {
    "KDA_PATCHES": "0 disables the overlay entirely (baseline runs); 1 (default) enables it",
    "KDA_PATCHES_DISABLE": "comma-separated patch names to leave unapplied",
    "KDA_PATCHES_ONLY": "comma-separated patch names: apply only these",
    "KDA_PATCHES_FORCE_TRITON": "1: no custom-op bootstrap/preload, every overlay choice goes to Triton",
    "KDA_PATCHES_STRICT": "1: every skipped or failed patch (and bypassed call) raises",
    "KDA_PATCHES_STATUS_DIR": "directory where every process writes its ledger as JSON",
    "KDA_PATCHES_LOG": "log level of the 'kda_patches' logger (DEBUG, INFO, WARNING, ERROR)",
    "KDA_PATCHES_CUSTOM_OPP": "extra AscendC custom-op package dirs (DIR[:DIR])",
    "KDA_PATCHES_PRELOAD": "extra shared libraries to preload by absolute path (LIB[:LIB])",
    "KDA_PATCHES_KV_STATE_MODE": "auto (default): dense state views only where provably safe; "
    "separate: also allocate dense state tensors outside the shared KV pool when in-place is unsafe",
    "KDA_PATCHES_KIMI_PLAN": "fork (default): where the fork ships its own Kimi state-copy plan (vllm-ascend "
    ">=0.30) kimi_prefill stands aside; overlay: publish the overlay's sealed plan into the fork's seam "
    "(unverified on NPUs)",
    "KDA_PATCHES_GDN_PLAN": "fork (default): on vllm-ascend >=0.30, whose NPU GDN prefill copies states with its "
    "own Triton kernels (gather_ssm_states / scatter_ssm_states_), gdn_state_copy stands aside; overlay: route "
    "those two calls through the overlay's sealed plan (needs KDA_PATCHES_ROUTING=rewrite; unverified on NPUs)",
    "KDA_PATCHES_GDN_OPS": "measured (default): on vLLM >=0.34, whose Qwen and Kimi Linear GDN prefill copies "
    "states with its own startup-warmed Triton ops (gather_initial_states / scatter_states), each of those seams "
    "follows the measurement of 0.34's own layer (docs/results/h200-vllm-layers; rule: routed only where the plan "
    "is at least as fast at every batch size): Qwen is routed through the overlay's sealed plan, gdn_state_copy "
    "stands aside on Kimi Linear; upstream: stand aside on both; overlay: route both (needs "
    "KDA_PATCHES_ROUTING=rewrite). Kimi K3 and Olmo are routed either way. Figures: kda-patches status",
    "KDA_PATCHES_ROUTING": "rewrite (default): a seam whose released source has exactly the declared copy lines "
    "runs a twin compiled at apply time that calls the plan directly; alias: every seam routes through the "
    "routed alias of its cache (tensor subclasses, more host time per call). Read when a seam is wrapped",
    "KDA_PATCHES_PDL": "auto (default): the fused state-copy plans compile with programmatic dependent launch "
    "where the target has it (NVIDIA SM90+) and launch plainly elsewhere; 1: ask for it everywhere (a target "
    "without it drops it and records that in each layer's memory_hints); 0: plain kernels. The default follows "
    "docs/results/bench-peer (rule: PDL plans at or below the plain plan's graph-replay time) and "
    "docs/results/h200-vllm-engine (rule: vLLM 0.34's engine EQUAL with PDL plans and its negative control "
    "DIFFERENT). Figures: kda-patches status",
    "KDA_PATCHES_STATE_IO": "measured (default): auto on the seams whose own layer was measured at least as fast "
    "with it at every batch size as unpatched and as the plan's copy (docs/results/no-copy; vLLM 0.34's Qwen and "
    "Kimi Linear GDN seams, each where routed), copy on every other seam; copy: a routed prefill gathers initial "
    "states and scatters final states through the sealed plan; indexed: where a seam's chunk-state kernel has an "
    "indexed twin (derived at apply time from the release's own kernel source), the kernel reads the initial states "
    "from the cache rows and stores the final states into them -- no gather, no scatter; auto: indexed for a "
    "prefill call of at least kda_patches.indexed_chunk.AUTO_MIN_SEQUENCES sequences, the plan's copy below (where "
    "each was measured faster). Figures: kda-patches status",
    "KDA_PATCHES_ROLE": "label for this process in the ledger (set by the launcher; optional)",
    "KDA_PATCHES_RELEASE_CACHE": "folder of released sources for `kda-patches conformance` and `bench peer` "
    "(default ~/.cache/kda-patches/releases); not read at activation",
}

_BOOLEAN_VALUES = {"0": False, "1": True, "false": False, "true": True, "no": False, "yes": True,
                   "off": False, "on": True}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_KV_STATE_MODES = ("auto", "separate")
_KIMI_PLANS = ("fork", "overlay")
_GDN_PLANS = ("fork", "overlay")
_GDN_OPS = ("measured", "upstream", "overlay")
_ROUTINGS = ("rewrite", "alias")
_STATE_IOS = ("measured", "copy", "indexed", "auto")
# what a plan's ``pdl`` argument is for each choice (kda_patches.state_copy.device.PDL_WHERE_AVAILABLE is "auto")
_PDL_REQUESTS = {"auto": "auto", "on": True, "off": False}
# every spelling KDA_PATCHES_PDL accepts -> its choice: auto, or any boolean spelling
_PDL_VALUES = {"auto": "auto", **{raw: "on" if value else "off" for raw, value in _BOOLEAN_VALUES.items()}}


class Flags:
    """Effective switches of this process (immutable).

    Attributes mirror :data:`SWITCHES`; ``only`` is ``None`` when ``KDA_PATCHES_ONLY`` is unset.
    ``warnings`` keeps the human-readable warnings produced while parsing (also logged).
    A plain slotted class rather than a dataclass: ``dataclasses`` costs milliseconds at import.
    """

    __slots__ = ("enabled", "disable", "only", "force_triton", "strict", "status_dir", "log_level",
                 "custom_opp", "preload", "kv_state_mode", "kimi_plan", "gdn_plan", "gdn_ops", "routing", "role",
                 "pdl", "state_io", "warnings")

    def __init__(self, enabled: bool = True, disable: frozenset[str] = frozenset(),
                 only: frozenset[str] | None = None, force_triton: bool = False, strict: bool = False,
                 status_dir: str | None = None, log_level: str = "WARNING", custom_opp: tuple[str, ...] = (),
                 preload: tuple[str, ...] = (), kv_state_mode: str = "auto", role: str | None = None,
                 warnings: tuple[str, ...] = (), kimi_plan: str = "fork", routing: str = "rewrite",
                 gdn_plan: str = "fork", gdn_ops: str = "measured", pdl: str = "auto",
                 state_io: str = "measured") -> None:
        values = dict(enabled=enabled, disable=frozenset(disable), only=None if only is None else frozenset(only),
                      force_triton=force_triton, strict=strict, status_dir=status_dir, log_level=log_level,
                      custom_opp=tuple(custom_opp), preload=tuple(preload), kv_state_mode=kv_state_mode,
                      kimi_plan=kimi_plan, gdn_plan=gdn_plan, gdn_ops=gdn_ops, routing=routing, role=role,
                      pdl=pdl, state_io=state_io, warnings=tuple(warnings))
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Flags are immutable; set the KDA_PATCHES* variable instead of {name}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Flags) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, str(v)) for k, v in self.as_dict().items())))

    def __repr__(self) -> str:
        return f"Flags({self.as_dict()!r})"

    def patch_enabled(self, name: str) -> bool:
        """Return whether patch ``name`` should be registered under these flags."""
        if not self.enabled or name in self.disable:
            return False
        return self.only is None or name in self.only

    def pdl_request(self) -> bool | str:
        """Return ``KDA_PATCHES_PDL``'s choice as the state-copy plans' ``pdl`` argument.

        Returns:
            ``"auto"`` (PDL where the target has it, nothing recorded elsewhere), ``True`` (asked everywhere, a
            target without it records the drop) or ``False`` (plain launches).
        Raises:
            ValueError: the record holds a choice other than auto/on/off (a ``Flags`` built by hand).
        """
        if self.pdl not in _PDL_REQUESTS:
            raise ValueError(f"Flags.pdl={self.pdl!r} is not a choice; use one of {', '.join(_PDL_REQUESTS)}")
        return _PDL_REQUESTS[self.pdl]

    def as_dict(self) -> dict:
        """Return the effective switches as a JSON-serialisable dict (for the ledger)."""
        return {
            "KDA_PATCHES": self.enabled,
            "KDA_PATCHES_DISABLE": sorted(self.disable),
            "KDA_PATCHES_ONLY": None if self.only is None else sorted(self.only),
            "KDA_PATCHES_FORCE_TRITON": self.force_triton,
            "KDA_PATCHES_STRICT": self.strict,
            "KDA_PATCHES_STATUS_DIR": self.status_dir,
            "KDA_PATCHES_LOG": self.log_level,
            "KDA_PATCHES_CUSTOM_OPP": list(self.custom_opp),
            "KDA_PATCHES_PRELOAD": list(self.preload),
            "KDA_PATCHES_KV_STATE_MODE": self.kv_state_mode,
            "KDA_PATCHES_KIMI_PLAN": self.kimi_plan,
            "KDA_PATCHES_GDN_PLAN": self.gdn_plan,
            "KDA_PATCHES_GDN_OPS": self.gdn_ops,
            "KDA_PATCHES_ROUTING": self.routing,
            "KDA_PATCHES_ROLE": self.role,
            "KDA_PATCHES_PDL": self.pdl,
            "KDA_PATCHES_STATE_IO": self.state_io,
        }


def parse_boolean(name: str, raw: str | None, default: bool) -> bool:
    """Parse a 0/1-style switch.

    Args:
        name: the variable name (for the error message).
        raw: its raw value, or None when unset.
        default: value used when unset or empty.
    Returns:
        The boolean value.
    Raises:
        ValueError: when the value is not one of 0/1/true/false/yes/no/on/off.
    """
    if raw is None or raw.strip() == "":
        return default
    value = _BOOLEAN_VALUES.get(raw.strip().lower())
    if value is None:
        raise ValueError(f"{name}={raw!r} is not a boolean switch; use {name}=0 or {name}=1")
    return value


def _split_names(raw: str | None) -> list[str]:
    return [part.strip() for part in (raw or "").split(",") if part.strip()]


def _split_paths(raw: str | None) -> tuple[str, ...]:
    return tuple(part for part in (raw or "").split(os.pathsep) if part)


def parse_flags(environ: Mapping[str, str] | None = None,
                known_patches: Iterable[str] = ()) -> Flags:
    """Parse every ``KDA_PATCHES*`` switch from ``environ``.

    Args:
        environ: the environment to read (default ``os.environ``).
        known_patches: registered patch names; names outside it in DISABLE/ONLY are warned about.
    Returns:
        The immutable :class:`Flags` of this process.
    Raises:
        ValueError: a switch has a malformed value (the message names the variable and the fix).
    """
    env = os.environ if environ is None else environ
    known = sorted(known_patches)
    warnings: list[str] = []

    for key in sorted(k for k in env if k.startswith("KDA_PATCHES")):
        if key not in SWITCHES:
            warnings.append(f"unknown switch {key} ignored; valid switches: {', '.join(SWITCHES)}")

    disable = _split_names(env.get("KDA_PATCHES_DISABLE"))
    only_raw = env.get("KDA_PATCHES_ONLY")
    only = _split_names(only_raw) if only_raw is not None and only_raw.strip() else None
    for variable, names in (("KDA_PATCHES_DISABLE", disable), ("KDA_PATCHES_ONLY", only or [])):
        for unknown in sorted(set(names) - set(known)):
            warnings.append(f"{variable} names unknown patch {unknown!r}; valid patches: {', '.join(known)}")

    log_level = (env.get("KDA_PATCHES_LOG") or "WARNING").strip().upper()
    if log_level not in _LOG_LEVELS:
        raise ValueError(f"KDA_PATCHES_LOG={env.get('KDA_PATCHES_LOG')!r} is not a log level; "
                         f"use one of {', '.join(_LOG_LEVELS)}")
    kv_state_mode = (env.get("KDA_PATCHES_KV_STATE_MODE") or "auto").strip().lower()
    if kv_state_mode not in _KV_STATE_MODES:
        raise ValueError(f"KDA_PATCHES_KV_STATE_MODE={env.get('KDA_PATCHES_KV_STATE_MODE')!r} is not "
                         f"a mode; use one of {', '.join(_KV_STATE_MODES)}")
    kimi_plan = (env.get("KDA_PATCHES_KIMI_PLAN") or "fork").strip().lower()
    if kimi_plan not in _KIMI_PLANS:
        raise ValueError(f"KDA_PATCHES_KIMI_PLAN={env.get('KDA_PATCHES_KIMI_PLAN')!r} is not a choice; "
                         f"use one of {', '.join(_KIMI_PLANS)}")
    gdn_plan = (env.get("KDA_PATCHES_GDN_PLAN") or "fork").strip().lower()
    if gdn_plan not in _GDN_PLANS:
        raise ValueError(f"KDA_PATCHES_GDN_PLAN={env.get('KDA_PATCHES_GDN_PLAN')!r} is not a choice; "
                         f"use one of {', '.join(_GDN_PLANS)}")
    gdn_ops = (env.get("KDA_PATCHES_GDN_OPS") or "measured").strip().lower()
    if gdn_ops not in _GDN_OPS:
        raise ValueError(f"KDA_PATCHES_GDN_OPS={env.get('KDA_PATCHES_GDN_OPS')!r} is not a choice; "
                         f"use one of {', '.join(_GDN_OPS)}")
    pdl = _PDL_VALUES.get((env.get("KDA_PATCHES_PDL") or "auto").strip().lower())
    if pdl is None:
        raise ValueError(f"KDA_PATCHES_PDL={env.get('KDA_PATCHES_PDL')!r} is not a choice; use "
                         "KDA_PATCHES_PDL=auto (the default), 1 or 0")
    routing = (env.get("KDA_PATCHES_ROUTING") or "rewrite").strip().lower()
    if routing not in _ROUTINGS:
        raise ValueError(f"KDA_PATCHES_ROUTING={env.get('KDA_PATCHES_ROUTING')!r} is not a mechanism; "
                         f"use one of {', '.join(_ROUTINGS)}")
    state_io = (env.get("KDA_PATCHES_STATE_IO") or "measured").strip().lower()
    if state_io not in _STATE_IOS:
        raise ValueError(f"KDA_PATCHES_STATE_IO={env.get('KDA_PATCHES_STATE_IO')!r} is not a choice; "
                         f"use one of {', '.join(_STATE_IOS)}")

    flags = Flags(
        enabled=parse_boolean("KDA_PATCHES", env.get("KDA_PATCHES"), True),
        disable=frozenset(disable),
        only=None if only is None else frozenset(only),
        force_triton=parse_boolean("KDA_PATCHES_FORCE_TRITON", env.get("KDA_PATCHES_FORCE_TRITON"), False),
        strict=parse_boolean("KDA_PATCHES_STRICT", env.get("KDA_PATCHES_STRICT"), False),
        status_dir=env.get("KDA_PATCHES_STATUS_DIR") or None,
        log_level=log_level,
        custom_opp=_split_paths(env.get("KDA_PATCHES_CUSTOM_OPP")),
        preload=_split_paths(env.get("KDA_PATCHES_PRELOAD")),
        kv_state_mode=kv_state_mode,
        kimi_plan=kimi_plan,
        gdn_plan=gdn_plan,
        gdn_ops=gdn_ops,
        routing=routing,
        role=env.get("KDA_PATCHES_ROLE") or None,
        pdl=pdl,
        state_io=state_io,
        warnings=tuple(warnings),
    )
    if warnings:
        import logging  # deferred: only needed when there is something to say

        for message in warnings:
            logging.getLogger("kda_patches").warning("kda_patches: %s", message)
    return flags
