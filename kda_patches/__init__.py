"""kda_patches: a monkey-patch overlay for hybrid linear-attention models on vLLM-based stacks.

Importing this package activates the overlay in this process: it parses the switches
(:mod:`kda_patches.flags`), runs the environment bootstrap (:mod:`kda_patches.env`), and registers
wrapt post-import hooks for every enabled patch. It imports neither torch nor vLLM; patches are
installed when their target modules are imported. ``KDA_PATCHES=0`` registers nothing.
"""

from __future__ import annotations

import os

from kda_patches.flags import Flags, parse_flags
from kda_patches.ledger import get_ledger

__all__ = ["activate", "current_flags", "get_ledger", "vllm_plugin"]
__version__ = "0.1.0"

_FLAGS: Flags | None = None


def _configure_logging(level: str) -> None:
    """Give the 'kda_patches' logger a level and a handler (only when a warning is about to matter)."""
    import logging

    logger = logging.getLogger("kda_patches")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s[%(process)d]: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def activate(environ: dict[str, str] | None = None) -> Flags:
    """Activate the overlay in this process (idempotent) and return the effective flags.

    Args:
        environ: environment to read switches from (default ``os.environ``).
    Returns:
        The parsed :class:`~kda_patches.flags.Flags`.
    """
    global _FLAGS
    if _FLAGS is not None:
        return _FLAGS
    from kda_patches import registry

    patches = registry.all_patches()
    flags = parse_flags(environ, known_patches=patches)
    if flags.log_level != "WARNING" or flags.warnings:
        _configure_logging(flags.log_level)
    ledger = get_ledger()
    ledger.switches = flags.as_dict()
    ledger.role = flags.role
    ledger.status_dir = flags.status_dir
    _FLAGS = flags
    if not flags.enabled:
        for name in patches:
            ledger.record_patch(name, "disabled", "KDA_PATCHES=0")
        return flags

    from kda_patches import env
    env.bootstrap_environment(flags)
    for name, patch in patches.items():
        if flags.patch_enabled(name):
            registry.register_patch(patch, strict=flags.strict)
        else:
            ledger.record_patch(name, "disabled", "switched off by KDA_PATCHES_DISABLE/ONLY")
    return flags


def current_flags() -> Flags:
    """Return the flags this process was activated with (activating first if needed)."""
    return _FLAGS if _FLAGS is not None else activate()


def vllm_plugin() -> None:
    """Entry point for ``vllm.general_plugins``: vLLM calls it in every process it starts."""
    flags = activate()
    get_ledger().set_fact("activation", "vllm_plugin", {"pid": os.getpid(), "enabled": flags.enabled})


activate()
