"""Verdicts on patch targets, as pure functions of data (versions and parameter names).

The registry (:mod:`kda_patches.registry`, which re-exports every name here) decides with these at import time
from the installed stack; release conformance (:mod:`kda_patches.releases`) decides with the same functions from
versions and signatures read out of released sources. ``patch`` / ``target`` arguments are
:class:`kda_patches.registry.Patch` / ``Target`` records (only their data is read). Stdlib only.

- :func:`version_in_range` ``(target, found) -> bool``
- :func:`newer_than_all` ``(patch, distribution, found) -> bool``
- :func:`fingerprint_matches` ``(target, parameters) -> bool``
- :func:`select_target` ``(patch, key, found) -> Target | None`` (the in-range sibling)
- :func:`check_key` ``(patch, key, found, parameters) -> Verdict`` (one key on one stack)
- :func:`group_verdict` ``(patch, group, version_of, read) -> GroupVerdict`` (all members of a group)
- :func:`stands_aside_by_choice` ``(target) -> bool`` (an opt-in target, not chosen here)
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Callable

    from kda_patches.registry import Patch, Target


def stands_aside_by_choice(target: Target | None) -> bool:
    """Return whether ``target`` is live only when chosen (``chosen_by``) and stands aside in this process."""
    return target is not None and target.chosen_by is not None and inert_reason(target) is not None


def inert_reason(target: Target) -> str | None:
    """Return why ``target`` stays unwrapped in this process (its ``inert`` text), or None when it is live.

    A target ``chosen_by`` a switch is live exactly when the process's flags hold one of the chosen values.
    """
    if target.inert is None:
        return None
    if target.chosen_by is not None:
        from kda_patches import current_flags  # deferred: the package imports this module

        attribute, values = target.chosen_by
        if getattr(current_flags(), attribute) in values:
            return None
    return target.inert


class Verdict:
    """Outcome of checking one key on one stack: ``state`` is ``ok``, ``not-applicable`` or ``skipped``.

    Attributes:
        key: the target key checked.
        state: ``ok`` (would be applied), ``not-applicable`` or ``skipped``.
        reason: human-readable why (version found, range declared, signature found vs expected).
        target: the in-range sibling (None when no range contains the version).
    """

    __slots__ = ("key", "state", "reason", "target")

    def __init__(self, key: str, state: str, reason: str, target: Target | None) -> None:
        self.key, self.state, self.reason, self.target = key, state, reason, target

    def __repr__(self) -> str:
        return f"Verdict({self.key!r}, {self.state!r}, {self.reason!r})"

    @property
    def ok(self) -> bool:
        """Whether the key would be applied."""
        return self.state == "ok"


class GroupVerdict:
    """Outcome of checking every member of a group: ``state`` is ``ok``, ``not-applicable`` or ``skipped``.

    Attributes:
        group: the group name.
        state: ``ok`` when every member is ok; ``not-applicable`` when every member is not-applicable;
            ``skipped`` otherwise.
        reason: names the failing member(s) and why.
        members: the per-key :class:`Verdict`, in declaration order.
    """

    __slots__ = ("group", "state", "reason", "members")

    def __init__(self, group: str, state: str, reason: str, members: dict[str, Verdict]) -> None:
        self.group, self.state, self.reason, self.members = group, state, reason, members

    def __repr__(self) -> str:
        return f"GroupVerdict({self.group!r}, {self.state!r}, {self.reason!r})"

    @property
    def ok(self) -> bool:
        """Whether the group would be applied."""
        return self.state == "ok"


ABSENT = None  # ``parameters`` value meaning "the attribute is not defined there"


def parse_version(text: str) -> tuple[int, ...]:
    """Return the numeric release tuple of a version string (``0.32.0+cpu`` -> ``(0, 32, 0)``)."""
    import re

    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text or "")
    if not match:
        raise ValueError(f"cannot parse version {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _padded(text: str, width: int = 4) -> tuple[int, ...]:
    release = parse_version(text)
    return release + (0,) * (width - len(release))


def version_range(target: Target) -> str:
    """Return the declared range as text, e.g. ``vllm>=0.13,<0.14`` (``*`` for an open bound)."""
    return f"{target.distribution}>={target.min_version or '*'},<{target.max_version or '*'}"


def ranges_overlap(first: Target, second: Target) -> bool:
    """Return whether two targets' version ranges share a version."""
    low = max(_padded(first.min_version or "0"), _padded(second.min_version or "0"))
    highs = [_padded(t.max_version) for t in (first, second) if t.max_version is not None]
    return not highs or low < min(highs)


def version_in_range(target: Target, found: str | None) -> bool:
    """Return whether ``found`` lies inside the target's ``[min_version, max_version)`` range.

    Args:
        target: the target whose range is checked.
        found: the installed version (None: unknown, in range only when no range is declared).
    """
    if target.min_version is None and target.max_version is None:
        return True
    if found is None:
        return False
    release = _padded(found)
    if target.min_version is not None and release < _padded(target.min_version):
        return False
    return not (target.max_version is not None and release >= _padded(target.max_version))


def newer_than_all(patch: Patch, distribution: str, found: str | None) -> bool:
    """Return whether ``found`` is newer than every range ``patch`` declares for ``distribution``.

    Such a release is unverified (``skipped``), unlike an older one or one between ranges (``not-applicable``).
    False when ``found`` is unknown, when no target of ``distribution`` exists, or when a range is open above.
    """
    targets = [target for target in patch.targets if target.distribution == distribution]
    if found is None or not targets:
        return False
    release = _padded(found)
    return all(target.max_version is not None and release >= _padded(target.max_version) for target in targets)


def fingerprint_matches(target: Target, parameters: tuple[str, ...] | None) -> bool:
    """Return whether the parameter names found match the target's fingerprint (always, when it has none)."""
    return target.parameters is None or (parameters is not None and tuple(parameters) == target.parameters)


def select_target(patch: Patch, key: str, found: str | None) -> Target | None:
    """Return the sibling of ``key`` whose version range contains ``found`` (ranges are disjoint), or None."""
    for target in patch.siblings(key):
        if version_in_range(target, found):
            return target
    return None


def check_key(patch: Patch, key: str, found: str | None, parameters: tuple[str, ...] | None) -> Verdict:
    """Decide one key on one stack from data.

    Args:
        patch: the patch declaring the key.
        key: ``module:qualname``.
        found: installed version of the key's distribution (None: unknown).
        parameters: the parameter names of the object found (:data:`ABSENT` = None when not defined); when no
            sibling's range holds ``found``, only consulted for an unknown version (absent: not-applicable).
    Returns:
        The :class:`Verdict`.
    """
    siblings = patch.siblings(key)
    if not siblings:
        raise KeyError(f"patch {patch.name!r} declares no target {key}")
    target = select_target(patch, key, found)
    if target is None:
        declared = " or ".join(version_range(t) for t in siblings)
        distribution = siblings[0].distribution
        if found is None:
            if parameters is ABSENT:  # nothing there and no version: the distribution is simply not installed
                return Verdict(key, "not-applicable", f"{key.partition(':')[2]} is not defined in "
                               f"{key.partition(':')[0]} (no {distribution} found)", None)
            return Verdict(key, "skipped", f"version of {distribution} unknown, declared for {declared}", None)
        if newer_than_all(patch, distribution, found):
            return Verdict(key, "skipped", f"found {distribution} {found}, newer than every range patch "
                           f"{patch.name!r} declares for it (unverified release; declared for {declared})", None)
        return Verdict(key, "not-applicable", f"declared for {declared}, found {found}", target)
    module, _, qualname = key.partition(":")
    if parameters is ABSENT:
        return Verdict(key, "not-applicable", f"{qualname} is not defined in {module}", target)
    inert = inert_reason(target)
    if inert is not None:
        return Verdict(key, "not-applicable", f"inert: {inert} ({version_range(target)}, found {found})", target)
    if not fingerprint_matches(target, parameters):
        return Verdict(key, "skipped", f"signature drifted: found ({', '.join(parameters)}), expected "
                       f"({', '.join(target.parameters)}) (version {found or 'unknown'})", target)
    return Verdict(key, "ok", f"version {found or 'unknown'}, {version_range(target)}", target)


def group_verdict(patch: Patch, group: str, version_of: Callable[[Target], str | None],
                  read: Callable[[Target], tuple[str, ...] | None]) -> GroupVerdict:
    """Decide every member of ``group`` together.

    A key is a member on a stack when its in-range sibling is in ``group``, or when no sibling is in range
    and one of them is in ``group`` (then it fails the group). A member the user opts into (``chosen_by``)
    that stands aside in this process is no member while another member is live: the rest of the group
    applies without it (vLLM 0.34's Olmo seam and runner hooks without the Qwen seam, whose states upstream's
    own ops copy); when every member stands aside the group is ``not-applicable`` with their reasons.
    Siblings may thus move a key between groups
    by version (e.g. a bind hook coupled to one era's allocator and to the next era's).

    Args:
        patch: the patch declaring the group.
        group: the group name.
        version_of: target -> installed version of its distribution (None: unknown).
        read: target -> parameter names of the object found (None: absent).
    Returns:
        The :class:`GroupVerdict` (ok only when every member is ok).
    """
    members = {}
    for key in patch.group_keys(group):
        found = version_of(patch.siblings(key)[0])
        target = select_target(patch, key, found)
        if target is not None and target.group != group:
            continue  # on this stack the key's in-range sibling belongs to another group (or none)
        probe = target if target is not None else patch.siblings(key)[0] if found is None else None
        members[key] = check_key(patch, key, found, read(probe) if probe is not None else ABSENT)
    aside = [key for key, verdict in members.items() if verdict.state == "not-applicable"
             and stands_aside_by_choice(verdict.target)]
    if aside and len(aside) < len(members):  # an opt-in member standing aside is no member while it does
        members = {key: verdict for key, verdict in members.items() if key not in aside}
    failing = [verdict for verdict in members.values() if not verdict.ok]
    if not members:
        return GroupVerdict(group, "not-applicable", f"group {group!r} has no member on this stack", members)
    if not failing:
        return GroupVerdict(group, "ok", f"all {len(members)} members of group {group!r} check", members)
    state = "not-applicable" if len(failing) == len(members) and all(
        v.state == "not-applicable" for v in failing) else "skipped"
    reason = f"group {group!r} not applied: " + "; ".join(f"member {v.key}: {v.reason}" for v in failing)
    return GroupVerdict(group, state, reason, members)
