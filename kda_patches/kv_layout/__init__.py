"""Helpers of the ``kv_cache_layout`` patch: the aliasing checker, view descriptions and layout proposals.

- :mod:`kda_patches.kv_layout.checker`: the byte-range proof (pure numpy, no torch).
- :mod:`kda_patches.kv_layout.views`: turn torch views into the checker's :class:`Footprint` records and
  build the proposed views (dense state views, contiguous attention KV, separate state tensors).
- :mod:`kda_patches.kv_layout.decide`: per raw storage, compare upstream's layout with the proposal,
  record every verdict in the ledger and return the views to use.
- :mod:`kda_patches.kv_layout.budget`: the KV budget reduction of the opt-in separate mode.
- :mod:`kda_patches.kv_layout.ascend_proof`: vllm-ascend 0.26-0.30's own layouts of real models
  (:mod:`~kda_patches.kv_layout.ascend_models`) executed from the release cache and proven with the checker;
  writes ``docs/results/ascend-kv-layout/README.md``. Its pieces: ``ascend_engine`` (stood-in engine objects),
  ``ascend_sources`` (facts read from release text), ``ascend_stack`` (the release's KV-cache code executed),
  ``ascend_verdict`` (views to a checker verdict), ``ascend_table`` (the README).
- :mod:`kda_patches.kv_layout.upstream034_stack` / :mod:`~kda_patches.kv_layout.upstream034_proof`: vLLM 0.34's
  own extensible KV cache of the same models executed from the release cache (allocation, warmup commit,
  ``extend_kv_cache``) and its views proven before and after the rebind (rows of the same README).
- :mod:`kda_patches.kv_layout.ascend_verify` / :mod:`~kda_patches.kv_layout.rebind_verify`: the read-only verifiers
  at run time (vllm-ascend 0.26-0.30's reshape; vLLM 0.34's ``extend_kv_cache``).
- :mod:`kda_patches.kv_layout.release_exec`: released source files executed definition by definition
  (``release_module``: one lazy release module; ``release_classes``: partial classes from release methods;
  ``release_compile``: compiling at release line numbers).

Nothing here is imported by ``import kda_patches``; the patch imports these modules at wrap time.
"""
