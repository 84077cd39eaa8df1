"""Patch records and their installation through post-import hooks and wrapt wrappers.

A :class:`Patch` names the targets it wraps on each supported stack. :func:`register_patch`
arranges for every target to be wrapped when its module is imported (at once if it already is).
Each target is checked before wrapping: a missing attribute is ``not-applicable``; a version
outside the supported range or a signature that differs from the recorded fingerprint is
``skipped`` with one WARNING; an exception while wrapping is ``failed`` (traceback logged) and the
target module still imports. Under ``KDA_PATCHES_STRICT=1`` skipped/failed raise ImportError.
"""

from __future__ import annotations

import _thread
import importlib
import sys

from kda_patches.hooks import when_imported
from kda_patches.ledger import get_ledger

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
    """

    __slots__ = ("module", "qualname", "wrapper", "stack", "distribution", "min_version", "max_version",
                 "parameters")

    def __init__(self, module: str, qualname: str, wrapper: Wrapper, stack: str = "vllm",
                 distribution: str = "vllm", min_version: str | None = None, max_version: str | None = None,
                 parameters: tuple[str, ...] | None = None) -> None:
        self.module = module
        self.qualname = qualname
        self.wrapper = wrapper
        self.stack = stack
        self.distribution = distribution
        self.min_version = min_version
        self.max_version = max_version
        self.parameters = None if parameters is None else tuple(parameters)

    def __repr__(self) -> str:
        return f"Target({self.key!r}, stack={self.stack!r})"

    @property
    def key(self) -> str:
        """``module:qualname``, the name used in the ledger and in messages."""
        return f"{self.module}:{self.qualname}"


class Patch:
    """A registered patch: a name (also its switch value), a one-line summary and its targets."""

    __slots__ = ("name", "summary", "targets")

    def __init__(self, name: str, summary: str, targets: tuple[Target, ...]) -> None:
        self.name = name
        self.summary = summary
        self.targets = tuple(targets)

    def __repr__(self) -> str:
        return f"Patch({self.name!r}, targets={len(self.targets)})"


class PatchSkipped(ImportError):
    """Raised under STRICT when a patch target is skipped or fails to apply."""


class _Applied:
    __slots__ = ("parent", "attribute", "original", "wrapper_object")

    def __init__(self, parent: Any, attribute: str, original: Any, wrapper_object: Any) -> None:
        self.parent = parent
        self.attribute = attribute
        self.original = original
        self.wrapper_object = wrapper_object


_applied: dict[tuple[str, str], _Applied] = {}
_registered: set[str] = set()
_lock = _thread.RLock()


def parse_version(text: str) -> tuple[int, ...]:
    """Return the numeric release tuple of a version string (``0.32.0+cpu`` -> ``(0, 32, 0)``)."""
    import re

    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text or "")
    if not match:
        raise ValueError(f"cannot parse version {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def find_version(target: Target, module: Any) -> str | None:
    """Return the installed version of the target's stack, or None when unknown."""
    top = sys.modules.get(target.module.split(".")[0])
    version = getattr(top, "__version__", None) if top is not None else None
    if isinstance(version, str):
        return version
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version
        return dist_version(target.distribution)
    except (ImportError, PackageNotFoundError, ValueError):
        return None


def version_supported(target: Target, found: str | None) -> bool:
    """Return whether ``found`` lies inside the target's ``[min_version, max_version)`` range."""
    if target.min_version is None and target.max_version is None:
        return True
    if found is None:
        return False
    release = parse_version(found)
    if target.min_version is not None and release < parse_version(target.min_version):
        return False
    return not (target.max_version is not None and release >= parse_version(target.max_version))


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


def _target_range(target: Target) -> str:
    return f"{target.distribution}>={target.min_version or '*'},<{target.max_version or '*'}"


def _report(patch: Patch, target: Target, state: str, reason: str, strict: bool) -> None:
    get_ledger().record_target(patch.name, target.key, state, reason)
    if state in ("skipped", "failed"):
        message = f"kda_patches: patch {patch.name!r} {state} on {target.key} [{target.stack}]: {reason}"
        _logger().warning(message)
        if strict:
            raise PatchSkipped(message + " (KDA_PATCHES_STRICT=1 makes this an error; unset it to "
                               "run the original code, or install a supported version)")


def apply_target(patch: Patch, target: Target, module: Any, strict: bool = False) -> str:
    """Wrap one target in an imported module and record the outcome.

    Args:
        patch: the patch the target belongs to.
        target: the target to wrap.
        module: the imported module object named by ``target.module``.
        strict: raise :class:`PatchSkipped` instead of only recording skipped/failed.
    Returns:
        The recorded state: ``applied``, ``not-applicable``, ``skipped`` or ``failed``.
    """
    with _lock:
        if (patch.name, target.key) in _applied:
            return "applied"
        try:
            resolved = resolve_attribute(module, target.qualname)
            if resolved is None:
                _report(patch, target, "not-applicable", f"{target.qualname} is not defined in {target.module}",
                        strict)
                return "not-applicable"
            parent, attribute, raw = resolved
            found = find_version(target, module)
            if not version_supported(target, found):
                _report(patch, target, "skipped",
                        f"version found {found or 'unknown'}, expected {_target_range(target)}", strict)
                return "skipped"
            if target.parameters is not None:
                actual = signature_parameters(getattr(parent, attribute))
                if actual != tuple(target.parameters):
                    _report(patch, target, "skipped",
                            f"signature drifted: found ({', '.join(actual)}), expected "
                            f"({', '.join(target.parameters)}) (version {found or 'unknown'})", strict)
                    return "skipped"
            import wrapt  # deferred: see kda_patches.hooks for why

            wrapper_object = wrapt.wrap_function_wrapper(parent, attribute, target.wrapper)
            _applied[(patch.name, target.key)] = _Applied(parent, attribute, raw, wrapper_object)
            get_ledger().record_target(patch.name, target.key, "applied",
                                       f"wrapped {target.qualname} (version {found or 'unknown'})")
            return "applied"
        except PatchSkipped:
            raise
        except Exception as error:  # a broken patch must never break the target's import
            _logger().exception("kda_patches: patch %r failed on %s", patch.name, target.key)
            _report(patch, target, "failed", f"{type(error).__name__}: {error}", strict)
            return "failed"


def register_patch(patch: Patch, strict: bool = False) -> None:
    """Arrange for every target of ``patch`` to be wrapped when its module is imported.

    Registering the same patch twice registers its hooks once. Modules already imported are
    patched immediately.
    """
    with _lock:
        if patch.name in _registered:
            return
        _registered.add(patch.name)
    for target in patch.targets:
        get_ledger().record_target(patch.name, target.key, "pending",
                                   f"waiting for import of {target.module}")
        when_imported(target.module, _make_hook(patch, target, strict))


def _make_hook(patch: Patch, target: Target, strict: bool) -> Callable[[Any], None]:
    def on_import(module: Any) -> None:
        if patch.name in _registered:
            apply_target(patch, target, module, strict)
    return on_import


def revert_patch(patch: Patch) -> int:
    """Restore every wrapped target of ``patch`` to its original object; stop its pending hooks.

    Returns:
        How many targets were restored.
    """
    restored = 0
    with _lock:
        _registered.discard(patch.name)
        for target in patch.targets:
            applied = _applied.pop((patch.name, target.key), None)
            if applied is None:
                continue
            setattr(applied.parent, applied.attribute, applied.original)
            get_ledger().record_target(patch.name, target.key, "disabled", "reverted")
            restored += 1
    return restored


def is_applied(patch: Patch, target: Target) -> bool:
    """Return whether ``target`` of ``patch`` is currently wrapped in this process."""
    return (patch.name, target.key) in _applied


def all_patches() -> dict[str, Patch]:
    """Return every registered patch record by name, in registry order (imports no torch/vLLM)."""
    from kda_patches.patches import PATCH_MODULES
    records = {}
    for module_name in PATCH_MODULES:
        module = importlib.import_module(f"kda_patches.patches.{module_name}")
        records[module.PATCH.name] = module.PATCH
    return records
