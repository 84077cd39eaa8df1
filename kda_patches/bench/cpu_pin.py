"""Which host cores a benchmark runs on: parse a core list, pin a process tree to it, read the current core.

On the H200 machine the same pure-Python loop took up to about twice as long from one round to the next while the
GPU's fixed work stayed steady (issue 26, ``scripts/gpu/drift_probe.py``; ``docs/results/h200-vllm-engine/``, the
drift probe), and vLLM's engine at a small model's scale is host-bound. An
engine A/B whose arms land on cores of different speed measures the cores. Pinning every arm's processes to the
*same* cores (the arms of an interleaved run take turns, so they never compete) takes that out of the ratio; a
child process inherits its parent's affinity, so vLLM's engine-core and worker processes follow.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def parse_cpus(text: str) -> frozenset[int]:
    """Parse a core list like ``2-5,8`` (the ``taskset -c`` / cpuset form) into core numbers.

    Raises:
        ValueError: an empty list, a part that is not ``N`` or ``N-M`` with ``N <= M``, or a negative core.
    """
    cores: set[int] = set()
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"cpus {text!r}: {part!r} is not N or N-M") from None
        if low < 0 or high < low:
            raise ValueError(f"cpus {text!r}: {part!r} is not a range of core numbers (N-M with 0 <= N <= M)")
        cores.update(range(low, high + 1))
    if not cores:
        raise ValueError(f"cpus {text!r}: name at least one core, e.g. 2-5")
    return frozenset(cores)


def check_available(cores: frozenset[int]) -> None:
    """Refuse cores this process may not run on (a typo would otherwise fail inside the child).

    Raises:
        ValueError: naming the cores that are not in this process's affinity, and the ones that are.
    """
    allowed = os.sched_getaffinity(0)
    missing = sorted(cores - allowed)
    if missing:
        raise ValueError(f"cores {missing} are not available to this process (available: {sorted(allowed)})")


def pin_children(cores: frozenset[int] | None) -> Callable[[], None] | None:
    """Return a ``preexec_fn`` that pins the child (and so everything it starts) to ``cores``; None for None."""
    if cores is None:
        return None

    def pin() -> None:
        os.sched_setaffinity(0, cores)
    return pin


def current_cpu() -> int | None:
    """Return the core this thread runs on now (Linux ``/proc/self/stat`` field 39), None where it is unknown."""
    try:
        with open("/proc/thread-self/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[36])  # field 39 of the line; fields[0] here is field 3 (state)
