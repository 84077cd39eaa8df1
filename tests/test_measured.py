"""``kda_patches/measured.json`` -- the one declared place of the headline figures -- matches the results it names.

Every entry names its result README and the raw data (``*.json.xz`` under ``docs/results``); each of its checks is
recomputed here from that data: the layer-call ratios per batch size and the rule's verdict, the graph-replay ratios
of ``bench peer`` rows, the engine cases' verdicts, the routing bookkeeping over the host-cost processes. The card
and date must be the data's where the data records them, the figure text must show every checked value, and the
README must tell the run. ``status`` / ``doctor`` print these entries beside the choices they explain; loading them
stays out of ``import kda_patches``. Reads files only (the data through ``kda_patches.results_io``).
"""

from __future__ import annotations

import glob
import json
import pathlib
import re
import statistics
import subprocess
import sys

import pytest

from kda_patches import measured
from kda_patches.flags import SWITCHES
from kda_patches.results_io import read_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENTRIES = measured.entries()
FIELDS = {"id", "switch", "targets", "what", "figure", "card", "date", "run", "source", "data", "checks"}


def data_files(entry: dict) -> list[pathlib.Path]:
    """Return the entry's raw result files (glob patterns expanded, sorted)."""
    files = []
    for pattern in entry["data"]:
        matched = sorted(glob.glob(str(ROOT / pattern)))
        assert matched, f"{entry['id']}: no file matches {pattern}"
        files.extend(pathlib.Path(path) for path in matched)
    return files


def card_of(device_name: str) -> str:
    """Return ``H100`` / ``H200`` from an NVIDIA device name."""
    return next(card for card in ("H100", "H200") if card in device_name)


def check_layer_step_ratios(entry: dict, check: dict, result: dict) -> None:
    on = result["layers"][check["layer"]]["overlay_on"]
    ratios = {str(row["seqs"]): round(row["paired_step_speedup"], 4) for row in on["timing"]}
    assert ratios == check["values"], f"{entry['id']}: the data reads {ratios}"
    verdict = "route" if all(row["paired_step_speedup"] >= 1.0 for row in on["timing"]) else "stand aside"
    assert verdict == check["verdict"], f"{entry['id']}: the rule reads {verdict} from the data"
    assert entry["figure"].endswith(f"(the rule: {verdict})"), entry["figure"]
    for value in check["values"].values():
        assert f"{value:.4f}" in entry["figure"], f"{entry['id']}: {value:.4f} not in {entry['figure']!r}"
    assert card_of(on["facts"]["device_name"]) == entry["card"], on["facts"]["device_name"]
    assert result["started"][:10] == entry["date"], result["started"]


def check_peer_graph_ratios(entry: dict, check: dict, result: dict) -> None:
    ratios = [row["impls"][check["peer"]]["graph"] / row["impls"][check["reference"]]["graph"]
              for row in result["summary"]["rows"] if check["peer"] in row["impls"]]
    assert len(ratios) == check["rows"], f"{entry['id']}: {len(ratios)} rows"
    for key, value in (("min", min(ratios)), ("max", max(ratios))):
        assert round(value, 3) == check[key], f"{entry['id']}: {key} {value:.3f}"
        assert f"{check[key]:.3f}" in entry["figure"], f"{entry['id']}: {check[key]:.3f} not in the figure"
    counts = {"at_or_above": sum(ratio >= 1.0 for ratio in ratios),
              "lead_by_10pct": sum(ratio >= 1.1 for ratio in ratios), "behind": sum(ratio < 1.0 for ratio in ratios)}
    for key, count in counts.items():
        if key in check:
            assert count == check[key], f"{entry['id']}: {key} {count} in the data"
            assert re.search(rf"\b{count}\b", entry["figure"]), f"{entry['id']}: {count} not in {entry['figure']!r}"
    assert card_of(result["versions"]["device_name"]) == entry["card"], result["versions"]["device_name"]


def check_engine_cases(entry: dict, check: dict, results: list[dict]) -> None:
    runs = {run["case"]["name"]: run for result in results for run in result["runs"]}
    for case, why in check["cases"].items():
        assert case in runs, f"{entry['id']}: no case {case} in {sorted(runs)}"
        assert runs[case]["passed"], f"{entry['id']}: {case} did not pass"
        assert runs[case]["why"].startswith(why), f"{entry['id']}: {case}: {runs[case]['why']!r}"
        routed = why.split("routed ")[-1]
        assert routed in entry["figure"], f"{entry['id']}: {routed!r} not in the figure"


def check_route_host_costs(entry: dict, check: dict, results: list[dict]) -> None:
    costs = {mechanism: [result["routed_steps_us"][mechanism]["bookkeeping = routed - ideal (us)"]
                         for result in results] for mechanism in ("rewrite", "alias")}
    assert len(costs["rewrite"]) == check["processes"]
    measured_values = {"rewrite_min": min(costs["rewrite"]), "rewrite_max": max(costs["rewrite"]),
                       "rewrite_median": statistics.median(costs["rewrite"]), "alias_min": min(costs["alias"]),
                       "alias_max": max(costs["alias"])}
    for key, value in measured_values.items():
        assert round(value, 1) == check[key], f"{entry['id']}: {key} {value:.2f} in the data"
        assert f"{check[key]:.1f}" in entry["figure"], f"{entry['id']}: {check[key]:.1f} not in the figure"


CHECKS = {"layer_step_ratios": check_layer_step_ratios, "peer_graph_ratios": check_peer_graph_ratios}
MANY_FILE_CHECKS = {"engine_cases": check_engine_cases, "route_host_costs": check_route_host_costs}


def test_the_table_has_entries_with_every_field() -> None:
    assert ENTRIES
    assert len({entry["id"] for entry in ENTRIES}) == len(ENTRIES), "ids repeat"
    for entry in ENTRIES:
        assert set(entry) == FIELDS, f"{entry['id']}: fields {sorted(set(entry) ^ FIELDS)}"
        assert entry["card"] in ("H100", "H200", "CPU"), entry["card"]
        assert entry["switch"] in SWITCHES, f"{entry['id']}: {entry['switch']} is not a switch"
        assert entry["checks"], f"{entry['id']}: nothing checks it"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda entry: entry["id"])
def test_entry_matches_the_result_it_names(entry: dict) -> None:
    readme = ROOT / entry["source"]
    assert readme.is_file() and readme.parent.parent == ROOT / "docs" / "results", entry["source"]
    text = readme.read_text(encoding="utf-8")
    assert entry["date"] in text, f"{entry['id']}: {entry['date']} not in {entry['source']}"
    files = data_files(entry)
    for path in files:
        assert path.parent == readme.parent, f"{entry['id']}: {path} is not in {readme.parent}"
        # named in full, or as the README abbreviates a family (run18c-..., h200-run{6,7})
        stem = path.name.split(".")[0]
        assert stem in text or f"`{stem.split('-')[0]}-" in text, f"{entry['id']}: {entry['source']} lacks {stem}"
    results = [read_json(path) for path in files]
    for check in entry["checks"]:
        if check["kind"] in CHECKS:
            assert len(results) == 1, f"{entry['id']}: {check['kind']} reads one file"
            CHECKS[check["kind"]](entry, check, results[0])
        else:
            MANY_FILE_CHECKS[check["kind"]](entry, check, results)


def test_each_switch_default_entry_is_the_newest_of_its_card() -> None:
    """Two entries about one target and card: the table keeps the newest run only."""
    seen: dict[tuple, str] = {}
    for entry in ENTRIES:
        for target in entry["targets"] or [entry["id"].split("/")[0] + "/" + entry["id"].split("/")[1]]:
            key = (target, entry["card"])
            assert key not in seen, f"{entry['id']} and {seen[key]} both give {target} on {entry['card']}"
            seen[key] = entry["id"]


def test_status_prints_the_figures_under_a_stand_aside_reason_and_beside_the_switches() -> None:
    from kda_patches.cli import format_ledger, format_measured
    from kda_patches.patches.gdn_state_copy import KIMI_GDN_034_STAND_ASIDE, LAYER_RULE

    target = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn:KimiGatedDeltaNetAttention._forward"
    snapshot = {"pid": 1, "role": "main", "switches": {"KDA_PATCHES_GDN_OPS": "measured"},
                "patches": {"gdn_state_copy": {"state": "applied", "reason": "", "targets": {
                    target: {"state": "not-applicable", "reason": f"inert: {KIMI_GDN_034_STAND_ASIDE}"}}}}}
    assert "docs/results/h200-vllm-layers" in LAYER_RULE and "docs/results/h200-vllm-layers" in KIMI_GDN_034_STAND_ASIDE
    lines = format_ledger(snapshot).splitlines()
    at = next(i for i, line in enumerate(lines) if target in line)
    assert lines[at].split()[:1] == ["not-applicable"] and "so the overlay stands aside" in lines[at]
    shown = [line.strip() for line in lines[at + 1:at + 3]]
    kimi = [entry for entry in ENTRIES if target in entry["targets"]]
    assert shown == [f"measured: {measured.describe(entry)}" for entry in kimi]
    assert all(entry["figure"] in "\n".join(shown) for entry in kimi)
    switch_text = format_measured({"KDA_PATCHES_GDN_OPS": "measured", "KDA_PATCHES_PDL": "auto"})
    for entry in ENTRIES:
        assert measured.describe(entry) in switch_text
    assert "[KDA_PATCHES_GDN_OPS=measured]" in switch_text and "[KDA_PATCHES_PDL=auto]" in switch_text


def test_a_reason_without_the_result_folder_gets_no_figures() -> None:
    target = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention._forward_core"
    assert measured.target_lines(target, "wrapped QwenGatedDeltaNetAttention._forward_core (version 0.32.0)") == []
    assert measured.target_lines(target, None) == []


def test_import_kda_patches_reads_no_table_and_imports_neither_torch_nor_vllm() -> None:
    code = ("import sys, kda_patches; "
            "print(json.dumps(['torch' in sys.modules, 'vllm' in sys.modules, 'kda_patches.measured' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", f"import json; {code}"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [False, False, False]


def test_the_table_ships_with_the_package() -> None:
    setup = (ROOT / "setup.cfg").read_text(encoding="utf-8")
    assert "[options.package_data]" in setup and "measured.json" in setup
