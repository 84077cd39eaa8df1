"""The real vLLM 0.13.0 tests run only inside ``.venv013`` (``make setup-vllm013``).

``tests/kv_layout/test_vllm013_env.py`` launches them there with ``KDA_TEST_VLLM013=1``; the main run
ignores this folder. Configs come from vLLM 0.13's own ``get_kv_cache_groups`` /
``get_kv_cache_config_from_groups``, views from the real ``GPUModelRunner._allocate_kv_cache_tensors`` /
``_reshape_kv_cache_tensors`` on CPU tensors (``runner013.py``).
"""

from __future__ import annotations

import os

if os.environ.get("KDA_TEST_VLLM013") != "1":
    collect_ignore_glob = ["test_*.py"]
