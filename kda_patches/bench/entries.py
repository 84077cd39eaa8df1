"""Counting entries into the Triton JIT, the interpreter's launch entry and the compiler while a benchmark
runs (after every plan is sealed). Sealed plans launch through stored launchers (compiled) or the
interpreter executor they kept (``TRITON_INTERPRET=1``), so every count stays 0 unless something
re-enters Triton."""

from __future__ import annotations

from typing import Any


class CompilerEntryCounter:
    """Context manager that counts calls of ``JITFunction.run``, ``InterpretedFunction.run`` and
    ``triton.compile`` (without blocking them).

    Args:
        foreign: names of kernels that are not the overlay's (a fork's kernels measured beside the plans,
            which launch through the JIT by design): their JIT entries are counted in :attr:`foreign`,
            not in :attr:`counts`.

    Attributes:
        counts: ``{entry point: calls}`` accumulated over every ``with`` block.
        foreign: ``{kernel name: JIT entries}`` of the foreign kernels.
    """

    def __init__(self, foreign: tuple[str, ...] = ()) -> None:
        self.counts: dict[str, int] = {"JITFunction.run": 0, "InterpretedFunction.run": 0, "triton.compile": 0}
        self.foreign: dict[str, int] = dict.fromkeys(foreign, 0)
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, attribute: str, key: str) -> None:
        original = getattr(owner, attribute)

        def counted(*args: Any, **kwargs: Any) -> Any:
            name = getattr(getattr(args[0], "fn", None), "__name__", None) if args else None
            if name in self.foreign:
                self.foreign[name] += 1
            else:
                self.counts[key] += 1
            return original(*args, **kwargs)

        self._saved.append((owner, attribute, original))
        setattr(owner, attribute, counted)

    def __enter__(self) -> CompilerEntryCounter:
        import triton
        import triton.compiler.compiler as compiler_module
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        self._wrap(JITFunction, "run", "JITFunction.run")
        self._wrap(InterpretedFunction, "run", "InterpretedFunction.run")
        self._wrap(compiler_module, "compile", "triton.compile")
        self._wrap(triton, "compile", "triton.compile")
        return self

    def __exit__(self, *exc_info: Any) -> None:
        while self._saved:
            owner, attribute, original = self._saved.pop()
            setattr(owner, attribute, original)
