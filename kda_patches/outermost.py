"""Nested wrapped calls: only the outermost one does the patch's extra work.

Patches wrap a method wherever it is defined, so a subclass override that calls ``super()`` runs two
wrappers for one logical call (e.g. ``NPUModelRunner.initialize_kv_cache`` -> ``GPUModelRunner``'s, a
fork's metadata builder -> ``GDNAttentionMetadataBuilder.build``). :class:`OutermostCall` is the
thread-local guard every such wrapper shares.
"""

from __future__ import annotations

import _thread

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any, Callable


class OutermostCall:
    """Thread-local marker of an outermost wrapped call in progress."""

    __slots__ = ("_local",)

    def __init__(self) -> None:
        self._local = _thread._local()

    @property
    def active(self) -> bool:
        """Whether an outermost call is running on this thread."""
        return getattr(self._local, "active", False)

    def run(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, bool]:
        """Call ``wrapped(*args, **kwargs)``.

        Returns:
            ``(result, outermost)``: ``outermost`` is False when this call is nested inside another
            call guarded by the same marker (the caller then does no extra work).
        """
        if self.active:
            return wrapped(*args, **kwargs), False
        self._local.active = True
        try:
            return wrapped(*args, **kwargs), True
        finally:
            self._local.active = False
