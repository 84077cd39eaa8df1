"""vLLM 0.33's relocated ``get_kv_cache_configs`` (4th parameter ``global_kv_cache_groups``) under the separate mode.

The released function cannot be loaded next to the installed vLLM 0.32 (it imports 0.33-only modules), so a
stand-in with the release's signature (checked against the release file) returns a real config built from
released vLLM code (:mod:`released_runner`); what is tested is the wrapper's second call: only the memory changes,
the 4th argument passes through, positionally or by keyword.
"""

from __future__ import annotations

import pytest
from released_runner import ReleasedStack

from kda_patches import registry, static_check
from kda_patches.kv_layout.budget import STAMP, reduced_memory
from kda_patches.patches import kv_cache_layout
from kda_patches.releases.fetch import release_dir

KEY = "vllm.v1.core.kv_cache_planning:get_kv_cache_configs"


def released_parameters() -> tuple[str, ...] | None:
    path = release_dir("vllm", "0.33.0") / "vllm/v1/core/kv_cache_planning.py"
    return static_check.read_parameters(path, "get_kv_cache_configs")


def test_033_target_matches_the_release_and_032_is_not_applicable():
    parameters = released_parameters()
    assert parameters == kv_cache_layout.CONFIGS_033_PARAMETERS
    assert registry.check_key(kv_cache_layout.PATCH, KEY, "0.33.0", parameters).ok
    old = "vllm.v1.core.kv_cache_utils:get_kv_cache_configs"
    assert registry.check_key(kv_cache_layout.PATCH, old, "0.33.0", registry.ABSENT).state == "not-applicable"
    assert registry.check_key(kv_cache_layout.PATCH, KEY, "0.32.0", registry.ABSENT).state == "not-applicable"


@pytest.mark.parametrize("by_keyword", [False, True])
def test_separate_mode_asks_again_with_less_memory_and_the_same_groups(monkeypatch, by_keyword):
    monkeypatch.setattr(kv_cache_layout, "_mode", lambda: "separate")
    stack = ReleasedStack("0.28.0")
    calls = []

    def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups):
        calls.append((vllm_config, kv_cache_specs, list(available_memory), global_kv_cache_groups))
        return [stack.build(2, 2)[1]]

    assert registry.signature_parameters(get_kv_cache_configs) == released_parameters()
    groups = object()
    memory = [1 << 30]
    if by_keyword:
        keywords = {"available_memory": memory, "global_kv_cache_groups": groups}
        configs = kv_cache_layout.wrap_get_kv_cache_configs(get_kv_cache_configs, None, ("cfg", "specs"), keywords)
    else:
        configs = kv_cache_layout.wrap_get_kv_cache_configs(get_kv_cache_configs, None,
                                                            ("cfg", "specs", memory, groups), {})
    expected = reduced_memory([stack.build(2, 2)[1]], memory)
    assert expected is not None and expected[0] < memory[0]
    assert calls == [("cfg", "specs", memory, groups), ("cfg", "specs", expected, groups)]
    assert getattr(configs[0], STAMP)["layers"] == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
