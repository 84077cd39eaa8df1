"""Keep ``triton.autotune`` to a few configs per kernel in benchmark and GPU-check processes.

vLLM's FLA/KDA chunk kernels and fla-core autotune over up to 48 configs each; compiling all of them costs
minutes of device time on a fresh machine, and a timing-based pick can differ between two processes that are
compared. Every config is correct; processes that call this first all keep the same one.
"""

from __future__ import annotations

from typing import Any


def limit_autotune(keep: int = 1) -> None:
    """Make ``triton.autotune`` keep ``keep`` config(s) per kernel, 4 warps and 2-3 stages first.

    Call it before the kernels' modules are imported (their decorators run at import).

    Args:
        keep: configs kept per kernel.
    """
    import triton

    original = triton.autotune

    def autotune(configs: list[Any], *args: Any, **kwargs: Any) -> Any:
        preferred = sorted(configs, key=lambda config: (getattr(config, "num_warps", 4) != 4,
                                                        getattr(config, "num_stages", 2) not in (2, 3)))
        return original(preferred[:keep], *args, **kwargs)

    triton.autotune = autotune
