"""No copy: the chunk-state kernel reads initial states from the cache and stores final states into it by index.

- :mod:`~kda_patches.indexed_chunk.derive`: the indexed twin of the installed release's own chunk-state kernel,
  derived from its source by declared edits (refused with the reason where the source is not the declared shape);
- :mod:`~kda_patches.indexed_chunk.launch`: the host function that launches it in place of the release's
  ``chunk_gated_delta_rule_fwd_h``, and its naive twin (gather, the release's function, scatter).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class ReadyHost(NamedTuple):
    """A wrapped host function's twin, the fewest sequences a routed prefill call must have to run it (fewer: the
    plan copies; 0 under ``KDA_PATCHES_STATE_IO=indexed``, :data:`AUTO_MIN_SEQUENCES` under ``auto`` and
    ``measured``), and whether only seams measured faster with it run it (``measured``: any other seam that reaches
    the host copies through the plan; ``IndexedChunk.measured``)."""

    derived: Any
    min_sequences: int
    measured_only: bool = False


# IndexedChunk.key -> its ReadyHost, for every host function wrapped in this process (filled by route.prepare_host;
# read per routed call by kda_patches.routing.direct without importing the twin's machinery while it is empty)
READY: dict[str, ReadyHost] = {}
# auto's crossover: the smallest batch measured where the twin's layer call beat the plan's on an H100, with the plan
# ahead at the sizes measured below it (docs/results/no-copy, run 1)
AUTO_MIN_SEQUENCES = 64
