"""A/B regression: run a workload with the overlay off and on, in fresh processes, and compare.

Modules: ``runner`` (the A/B and :class:`~kda_patches.regress.runner.ABReport`), ``workloads``
(name registry, the embedded tiny Qwen3-Next vLLM workload), ``tiny_model`` (builds that model
from a fixed seed), ``compare`` (output encoding and first-difference comparison), ``baseline``
(baseline store), ``ledgers`` (per-process ledger aggregation), ``report`` (text/JSON),
``cli`` (``kda-patches regress``), ``child`` (one run's entry point), ``pytest_plugin`` (``kda_ab``).
Importing this package imports neither torch nor vLLM.
"""
