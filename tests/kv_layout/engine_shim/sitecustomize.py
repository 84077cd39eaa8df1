"""Activation path 1 (sitecustomize) for every process of the engine A/B test.

``kv_cache_layout`` wraps ``vllm.v1.worker.utils.allocate_kv_cache``, which vLLM's runner imports by name, so
the overlay must be active before vLLM is imported — exactly what a user's sitecustomize / ``.pth`` does.
Being the one ``sitecustomize`` on the path, it also puts in place the test-only fast exit of spawned
children (``tests/fast_exit``, which ``engine_runs`` puts on ``PYTHONPATH`` after this folder).
"""

import kda_test_fast_exit

import kda_patches  # noqa: F401

kda_test_fast_exit.install()
