"""Activation path 1 (sitecustomize) for every process of the engine A/B test.

``kv_cache_layout`` wraps ``vllm.v1.worker.utils.allocate_kv_cache``, which vLLM's runner imports by name, so
the overlay must be active before vLLM is imported — exactly what a user's sitecustomize / ``.pth`` does.
"""

import kda_patches  # noqa: F401
