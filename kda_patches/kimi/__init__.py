"""Runtime side of the ``kimi_prefill`` patch (imported only when a patched target runs).

- :mod:`kda_patches.kimi.routing`: per-call routing of a layer's prefill gather(+clear)/scatter through
  its published state-copy plan, and the per-call proof (routed / bypassed / refused).
- :mod:`kda_patches.kimi.upstream`: the same routing for upstream vLLM's ``KimiK3DeltaAttention._forward``
  (no ``_run_prefill`` there) and its ``gather_initial_states``.
- :mod:`kda_patches.kimi.startup`: the worker hook that prepares, seals and publishes every layer's plan
  right after the model runner bound the KV cache.

The patch record itself lives in :mod:`kda_patches.patches.kimi_prefill` (no torch import).
"""
