"""The routing core every state-copy seam shares (``kimi_prefill``, ``gdn_state_copy``).

- :mod:`kda_patches.routing.seams`: seam declarations (data) and the wrapt wrappers patch records name
  (standard library only: patch records import it at ``import kda_patches``);
- :mod:`kda_patches.routing.alias`: the routed alias of one call, the tagged packed/flags tensors, tallies;
- :mod:`kda_patches.routing.calls`: the mechanism that reads a declaration and routes one call;
- :mod:`kda_patches.routing.proof`: per-call proof and ledger counters, refusals;
- :mod:`kda_patches.routing.startup`: the worker startup hook (prepare, seal, publish for every seam layer);
- :mod:`kda_patches.routing.fork_native`: forks that ship their own plan (vllm-ascend >= 0.30).

Only ``seams`` is imported before a patched target runs; the rest imports torch.
"""
