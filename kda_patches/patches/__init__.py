"""One module per patch, named after what it wraps; each defines ``PATCH`` (a registry record).

``PATCH_MODULES`` is the registry order. Importing a patch module imports neither torch nor vLLM.
"""

PATCH_MODULES: tuple[str, ...] = ("gdn_host_flags", "kv_cache_layout", "fl_attention_state", "kimi_prefill",
                                  "gdn_state_copy")
