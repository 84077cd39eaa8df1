"""Every activation path a user has takes effect in vLLM's real CPU engine, in both state modes.

Paths: the vLLM plugin entry point alone (the package's installed ``vllm.general_plugins`` entry: vLLM calls
it in ``EngineCore.__init__``, after ``vllm.v1.engine.core`` bound ``get_kv_cache_configs`` by name), a
``kda_patches.pth`` line in the site-packages of a throwaway interpreter environment (the ``.pth`` that
``kda-patches install`` writes), and the ``kda-run`` launcher. Each runs STRICT -- the ``.pth`` in ``auto`` and
``separate`` mode, the plugin in ``separate``, the launcher in ``auto`` (:data:`PATHS_AND_MODES`) -- against the
unpatched run of its conv-state layout, and asserts the effect, not only the state: the engine's separate-state
budget and dense state bindings in separate mode, flagged GDN builds, layout decisions, the rebound aliases. The
``.pth`` and launcher runs use vLLM's default SD conv states, against the session's unpatched SD run
(``conftest.py``'s ``sd_baseline``); the plugin run uses DS conv states (``engine_runs.ACTIVATION_LAYOUTS``),
against the session's unpatched DS run (``ds_baseline``). The runs are the session's ``activation_run`` fixture's:
``test_kv_engine_ab`` asserts its SD layout A/B on the same ``.pth`` runs and its DS one on the plugin's run.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_runs import GDN_LAYERS, activation_layout, layout_facts


def counters(ledgers: list[dict[str, Any]], section: str) -> dict[str, int]:
    total: dict[str, int] = {}
    for ledger in ledgers:
        for key, value in ledger["counters"].get(section, {}).items():
            total[key] = total.get(key, 0) + value
    return total


def activations(ledgers: list[dict[str, Any]]) -> set[str]:
    return {key for ledger in ledgers for key in ledger["facts"].get("activation", {})}


def baseline(request: pytest.FixtureRequest, layout: str) -> list[list[int]]:
    """The unpatched tokens of ``layout``: the session's ``sd_baseline`` or ``ds_baseline`` (``conftest.py``)."""
    tokens, ledgers = request.getfixturevalue({"SD": "sd_baseline", "DS": "ds_baseline"}[layout])
    assert counters(ledgers, "kv_cache_layout") == {}
    return tokens


# each path once and each mode on at least two paths (pairwise, not the full cross product: each run is a fresh
# vLLM engine, ~25-35 s on the CI machine's two cores); the .pth runs (SD) and the plugin's (DS) are shared with
# test_kv_engine_ab
PATHS_AND_MODES = (("pth", "separate"), ("pth", "auto"), ("plugin", "separate"), ("launcher", "auto"))


@pytest.mark.engine
@pytest.mark.parametrize(("path", "mode"), PATHS_AND_MODES)
def test_each_activation_path_takes_effect(request: pytest.FixtureRequest, activation_run: Any, path: str,
                                           mode: str) -> None:
    tokens, ledgers = activation_run(path, mode)
    assert tokens == baseline(request, activation_layout(path, mode))
    assert ledgers, "no process wrote a ledger"
    if path == "plugin":
        assert activations(ledgers) == {"vllm_plugin"}  # nothing imported the overlay before vLLM's plugin loader
    assert counters(ledgers, "gdn_host_flags").get("builds_flagged", 0) > 0
    facts = layout_facts(ledgers)
    if mode == "separate":
        budget = facts.get("separate_budget")
        assert budget is not None, f"{path}: the engine core reserved no separate-state memory"
        assert budget["reduced_memory"][0] < budget["available_memory"][0]
        assert facts["counters"].get("state_binds_dense", 0) == len(GDN_LAYERS)
        assert all(facts[name]["decision"] == "separate" for name in GDN_LAYERS)
    else:
        assert "separate_budget" not in facts
        assert all(facts[name]["decision"] == "upstream" for name in GDN_LAYERS)
        assert facts["counters"].get("state_binds_upstream", 0) == len(GDN_LAYERS)
    aliases = {key: value for ledger in ledgers for key, value in ledger["facts"].get("aliases", {}).items()}
    if path == "plugin":  # activated late: the engine core's by-name import had to be rebound
        assert any("vllm.v1.engine.core.get_kv_cache_configs" in value for value in aliases.values()), aliases
