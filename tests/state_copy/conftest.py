"""Fixtures of the state-copy suite: the device it runs on, page-gapped caches, a compiler guard.

On the CPU the suite runs the kernels under the Triton interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before the kernels are imported). With ``--run-gpu`` the
same tests run on ``cuda`` with compiled Triton, plus the tests marked ``gpu``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from state_copy_helpers import PagedCache, build_cache


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """``cuda`` with ``--run-gpu`` (compiled Triton), else ``cpu`` (Triton interpreter)."""
    if pytestconfig.getoption("--run-gpu"):
        if not torch.cuda.is_available():
            pytest.fail("--run-gpu was given but torch sees no CUDA device")
        return torch.device("cuda")
    from kda_patches.state_copy.device import interpreter_active

    if not interpreter_active():
        pytest.fail("the state-copy kernels were defined without TRITON_INTERPRET=1; run the CPU suite as "
                    "`TRITON_INTERPRET=1 python -m pytest tests/state_copy` (make test does)")
    return torch.device("cpu")


@pytest.fixture
def make_cache(device: torch.device) -> Callable[..., PagedCache]:
    """Factory fixture: ``make_cache(dtype=..., num_rows=..., inner=..., gap=..., offset=..., seed=...)``."""

    def factory(**options: Any) -> PagedCache:
        return build_cache(device, **options)

    return factory


GUARDED_ENTRIES = ("JITFunction.run", "JITFunction.__getitem__", "InterpretedFunction.run",
                   "InterpretedFunction.__getitem__", "triton.compiler.compile", "triton.compile")


class CompilerGuard:
    """Records entries into Triton's launch path and compiler once armed (each entry also raises).

    Arm it after the plans are sealed: preparing a plan compiles (that is allowed), serving must not.
    The guard covers the compiled JIT (``JITFunction.run``/``__getitem__``, ``triton.compile``) and the
    interpreter's entry (``InterpretedFunction.run``/``__getitem__``): under ``TRITON_INTERPRET=1`` the
    kernels are ``InterpretedFunction`` objects, and a sealed plan launches through the executor it
    kept at prepare, never through those entries, so a plan that re-enters Triton fails on the CPU too.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entries: list[str] = []
        self._monkeypatch = monkeypatch

    def _refuse(self, name: str) -> Callable[..., Any]:
        def entry(*args: Any, **kwargs: Any) -> Any:
            self.entries.append(name)
            raise RuntimeError(f"compiler entry after seal: {name}")

        return entry

    def arm(self) -> CompilerGuard:
        """Make every entry of :data:`GUARDED_ENTRIES` raise (and be recorded) until the test ends."""
        import triton
        import triton.compiler.compiler as compiler_module
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for owner, attribute in ((JITFunction, "run"), (JITFunction, "__getitem__"), (InterpretedFunction, "run"),
                                 (InterpretedFunction, "__getitem__")):
            self._monkeypatch.setattr(owner, attribute, self._refuse(f"{owner.__name__}.{attribute}"))
        self._monkeypatch.setattr(compiler_module, "compile", self._refuse("triton.compiler.compile"))
        self._monkeypatch.setattr(triton, "compile", self._refuse("triton.compile"))
        return self


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch) -> Iterator[CompilerGuard]:
    """A :class:`CompilerGuard`; call ``no_compiler.arm()`` once the plans are sealed."""
    yield CompilerGuard(monkeypatch)
