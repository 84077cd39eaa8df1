"""The results README of the Ascend KV-layout proof, rendered from the cases' verdicts.

:func:`render` writes ``docs/results/ascend-kv-layout/README.md`` (summary, one row per release x model x TP,
witnesses and reasons, what ran and what was stood in); :func:`same_but_date` compares two READMEs apart from
their dates (the committed table against a fresh run).
"""

from __future__ import annotations

import re
from typing import Any

from kda_patches.kv_layout.ascend_engine import MAX_MODEL_LEN, NUM_BLOCKS, STOOD_IN
from kda_patches.kv_layout.ascend_verdict import CaseResult

Row = tuple[str, str, str, int, CaseResult]  # (vllm-ascend, vLLM, model, TP, result)
UpstreamRow = tuple[str, str, int, Any]  # (vLLM, model, TP, upstream034_proof.RebindResult)
DATE_PATTERN = r"\b20\d\d-\d\d-\d\d\b"


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def label_details(rows: list[Row]) -> dict[str, str]:
    """Label each distinct detail of ``rows`` in order of appearance: ``N1, N2, ...`` for not-checkable cases'
    reasons, ``W1, W2, ...`` for the others' (witnesses and checker reasons).

    Args:
        rows: the cases, as :func:`kda_patches.kv_layout.ascend_proof.run_all` returns them.

    Returns:
        detail -> label.
    """
    notes: dict[str, str] = {}
    for *_, result in rows:
        if result.detail and result.detail not in notes:
            kind = "N" if result.verdict == "not checkable" else "W"
            notes[result.detail] = f"{kind}{sum(label[0] == kind for label in notes.values()) + 1}"
    return notes


def group_cases(rows: list[Row], notes: dict[str, str], verdicts: tuple[str, ...]) -> str:
    """``model[, model] at TP ... on release[, release] (labels)``, cases with the same TPs and labels merged.

    Args:
        rows: the cases.
        notes: the labels of :func:`label_details`.
        verdicts: the verdicts whose cases are listed.

    Returns:
        The cases joined with ``; ``, or ``none``.
    """
    cases: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
    for fork, vllm, model, tp, result in rows:
        if result.verdict in verdicts:
            tps, labels = cases.setdefault((f"{fork} + vLLM {vllm}", model), ([], []))
            tps.append(str(tp))
            if notes[result.detail] not in labels:
                labels.append(notes[result.detail])
    merged: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
    for (pairing, model), (tps, labels) in cases.items():
        key = (", ".join(tps), ", ".join(labels))
        pairings, models = merged.setdefault(key, ([], []))
        if pairing not in pairings:
            pairings.append(pairing)
        if model not in models:
            models.append(model)
    return "; ".join(f"{', '.join(models)} at TP {tps} on {', '.join(pairings)} ({labels})"
                     for (tps, labels), (pairings, models) in merged.items()) or "none"


def upstream_section(upstream: list[UpstreamRow], bound: dict[str, dict[str, list[str]]]) -> list[str]:
    """The vLLM 0.34 section: one row per model x TP, the views before and after ``extend_kv_cache`` proven.

    Args:
        upstream: the 0.34 cases (:func:`kda_patches.kv_layout.ascend_proof.run_upstream`).
        bound: per vLLM release, what its release tree resolved, by kind.

    Returns:
        The section's lines.
    """
    from kda_patches.kv_layout.upstream034_stack import STOOD_IN as UPSTREAM_STOOD_IN

    details: dict[str, str] = {}
    lines = [
        "## vLLM 0.34: the extensible KV cache before and after `extend_kv_cache`", "",
        "vLLM's own code executed from the release cache on the CPU "
        "(`kda_patches/kv_layout/upstream034_stack.py`): the model's config",
        "hooks and `Platform.update_block_size_for_backend` (hybrid block-size alignment and Mamba page padding), the "
        "layers'",
        "specs, `resolve_kv_cache_layout`, the planner (`get_global_kv_cache_groups`, `get_kv_cache_configs`), the "
        "worker's",
        "`pad_kv_cache_segments`, `ExtensibleKVCache` and `init_kv_cache` (`allocate_kv_cache`, `bind_kv_caches`, each "
        "layer's",
        "`bind_kv_cache`), warmup's `ensure_kv_cache_blocks`, then `extend_kv_cache` (commit, `committed_views`, "
        "`bind_kv_caches`",
        "again). *Before*: the views bound at `initialize_kv_cache`, every block id of the reservation; *after*: the "
        "views",
        "`extend_kv_cache` rebound, every final block id. Views are checked per address space (storages whose bytes "
        "intersect:",
        "after the rebind each layer's view is its own tensor over a segment that layers of other groups share), and "
        "each",
        "inside its own storage.", "",
        "| vLLM | model | TP | layout | block size | page bytes | block ids before / after | address spaces before / "
        "after | views | verdict before | verdict after |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for vllm, model, tp, result in upstream:
        before, after = result.phases["before"], result.phases["after"]
        cells = []
        for phase in (before, after):
            verdict = phase.verdict
            if phase.detail:
                label = details.setdefault(phase.detail, f"U{len(details) + 1}")
                verdict = f"{verdict} ({label})"
            cells.append(f"**{verdict}**" if phase.verdict in ("overlap found", "out of storage") else verdict)
        blocks = "" if result.capacity is None else f"{result.capacity} / {result.final}"
        spaces = "" if before.num_storages is None else f"{before.num_storages} / {_cell(after.num_storages)}"
        lines.append(f"| {vllm} | {model} | {tp} | {_cell(result.layout)} | {_cell(before.block_size)} | "
                     f"{_cell(before.page_bytes)} | {blocks} | {spaces} | {_cell(before.num_views)} | {cells[0]} | "
                     f"{cells[1]} |")
    lines.append("")
    for detail, label in details.items():
        lines.append(f"- **{label}**: {detail}")
    if details:
        lines.append("")
    for vllm, kinds in bound.items():
        executed = kinds.get("release", []) + kinds.get("release (on use)", [])
        lines.append(f"vLLM {vllm}: {len(executed)} definitions executed from "
                     f"{len({name.split(':')[0] for name in executed})} release files, {len(kinds.get('standin', []))} "
                     f"stand-ins, {len(kinds.get('inert', []))} inert names.")
    lines += ["", "Stood in:", ""]
    lines += [f"- {name}: {why}." for name, why in UPSTREAM_STOOD_IN.items()]
    return [*lines, ""]


def render(rows: list[Row], bound: dict[tuple[str, str], dict[str, list[str]]], date: str,
           upstream: tuple[list[UpstreamRow], dict[str, dict[str, list[str]]]] | None = None) -> str:
    """The results README (deterministic for given rows, apart from ``date``).

    Args:
        rows: every case, in table order.
        bound: per (vllm-ascend, vLLM) pairing, what its release tree resolved, by kind
            (:meth:`~kda_patches.kv_layout.release_exec.ReleaseTree.report`).
        date: the date the summary names.
        upstream: the vLLM 0.34 cases and what their release tree resolved (a section of their own), or None.

    Returns:
        The README text.
    """
    counts: dict[str, int] = {}
    for *_, result in rows:
        counts[result.verdict] = counts.get(result.verdict, 0) + 1
    notes = label_details(rows)
    verdict_line = ", ".join(f"{count} {verdict}" for verdict, count in sorted(counts.items()))
    upstream_counts: dict[str, int] = {}
    for *_, result in (upstream[0] if upstream else []):
        upstream_counts[result.verdict] = upstream_counts.get(result.verdict, 0) + 1
    upstream_line = ", ".join(f"{count} {verdict}" for verdict, count in sorted(upstream_counts.items()))
    lines = [
        "# vllm-ascend 0.26-0.30 and vLLM 0.34: the stacks' own KV-cache layouts of real models, proven on the CPU "
        "(issue 53)",
        "",
        "## Summary",
        "",
        "- **Measures**: whether the views vllm-ascend's own released code builds for Kimi K3 (MLA + KDA), "
        "Qwen3.6-27B and",
        "  Qwen3-Next-80B at TP 1/2/4/8 let two block ids (or two layers of one group) share bytes: the fork's "
        "config,",
        "  spec, planner, allocation and reshape code executed from the release cache on the meta device, every "
        "bound view",
        f"  checked by `kda_patches/kv_layout/checker.py` for block ids 0-{NUM_BLOCKS - 1}.",
        f"- **Newest verdict**: {date}, **CPU** (no device): {verdict_line} of {len(rows)} cases.",
        f"  Overlap: {group_cases(rows, notes, ('overlap found', 'out of storage'))}.",
        f"  Not checkable: {group_cases(rows, notes, ('not checkable',))}.",
        *([f"  vLLM 0.34 extensible KV cache, views before and after `extend_kv_cache`: {upstream_line} of "
           f"{len(upstream[0])} cases."] if upstream else []),
        "- **Command**: `python -m kda_patches.kv_layout.ascend_proof --write "
        "docs/results/ascend-kv-layout/README.md`",
        "  (`--check` compares; `tests/ascend_layout/test_ascend_layout_table.py` fails when this file drifts).",
        "",
        "## Verdicts",
        "",
        "Block size in tokens as the release chose it; page = the largest group page in bytes; storages = raw "
        "allocations",
        "the views live on; views = tensors bound to the layers (K and V, or each state, per layer). Each release "
        "runs with the",
        "vLLM release its sdist names (Dockerfile `ARG VLLM_TAG`, `.github/vllm-release-tag.commit`), the pairing",
        "the conformance matrix reads (`kda_patches.releases.matrix.PAIRED_VLLM`).",
        "",
        "| vllm-ascend | vLLM | model | TP | block size | page bytes | storages | views | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fork, vllm, model, tp, result in rows:
        verdict = result.verdict
        if result.detail:
            verdict = f"{verdict} ({notes[result.detail]})"
        if result.verdict in ("overlap found", "out of storage"):
            verdict = f"**{verdict}**"
        lines.append(f"| {fork} | {vllm} | {model} | {tp} | {_cell(result.block_size)} | "
                     f"{_cell(result.page_bytes)} | {_cell(result.num_storages)} | {_cell(result.num_views)} | "
                     f"{verdict} |")
    lines += ["", "## Witnesses and reasons", "",
              "State views are numbered as the spec lists them (state0: the convolution state, state1: the "
              "recurrent state);",
              "attention views are `k` and `v` (for MLA: the latent part and the RoPE part). Byte offsets are "
              "from the start of the storage.", ""]
    for detail, label in sorted(notes.items(), key=lambda item: (item[1][0] != "W", int(item[1][1:]))):
        lines.append(f"- **{label}**: {detail}")
    lines += ["", "## What ran and what was stood in", "",
              "Executed from the release cache, per pairing (counts of top-level definitions and methods compiled "
              "from the",
              "release files, of the fork's import-time patch statements run, of stood-in names, of release names "
              "that resolved to",
              "inert placeholders -- resolved but never called, or the case would not have run):", "",
              "| vllm-ascend | vLLM | definitions executed | files | patch statements | stand-ins | inert |",
              "|---|---|---|---|---|---|---|"]
    for (fork, vllm), kinds in bound.items():
        executed = kinds.get("release", []) + kinds.get("release (on use)", [])
        files = {name.split(":")[0] for name in executed}
        lines.append(f"| {fork} | {vllm} | {len(executed)} | {len(files)} | {len(kinds.get('installed', []))} | "
                     f"{len(kinds.get('standin', []))} | {len(kinds.get('inert', []))} |")
    lines += ["", "Entry points called (each a release function or method, compiled from its release file):", "",
              "1. vLLM's `MODELS_CONFIG_MAP[architecture].verify_and_update_config`, the fork's",
              "   `patch/platform/patch_mamba_config.verify_and_update_config` (vLLM's hybrid hook, which it "
              "replaces),",
              "   `vllm_ascend.utils.refresh_block_size` and `NPUPlatform.update_block_size_for_backend` (with "
              "vLLM's",
              "   `Platform.update_block_size_for_backend` / `_align_hybrid_block_size` where the fork chains to "
              "them);",
              "2. `NPUModelRunner.get_kv_cache_spec` over the layers (vLLM's `Attention` / `MLAAttention` / "
              "`MambaBase.get_kv_cache_spec`);",
              "3. vLLM's `get_kv_cache_configs` after the fork's `patch/platform/patch_kv_cache_utils` import-time "
              "statements, and",
              "   vLLM's `resolve_kv_cache_layout` where the release has it;",
              "4. `NPUModelRunner.initialize_kv_cache_tensors` (allocation, reshape, binding; the fork's",
              "   `patch/worker/patch_bind_kv_cache` installed where it exists) with vLLM's "
              "`prepare_kernel_block_sizes` where the",
              "   runner takes kernel block sizes; the views checked are the ones bound to the layers.", "",
              "The runner is the fork's default V1 `NPUModelRunner` (every release here uses its V2 runner only "
              "with",
              "`VLLM_USE_V2_MODEL_RUNNER=1`, per its `patch/platform/patch_use_v2_model_runner.py`); the V2 "
              "runner is not covered.", "",
              "Stood in:", ""]
    for name, why in STOOD_IN.items():
        lines.append(f"- {name}: {why}.")
    lines += ["", f"Engine settings: block ids 0-{NUM_BLOCKS - 1} (`num_gpu_blocks_override`), max_model_len "
              f"{MAX_MODEL_LEN}, prefix caching on,",
              "dtype bfloat16, `cache_dtype` auto, no speculative decoding, no KV transfer, no `VLLM_*` variables. "
              "Model numbers and their",
              "sources: `kda_patches/kv_layout/ascend_models.py`.", ""]
    if upstream is not None:
        lines += upstream_section(*upstream)
    return "\n".join(lines)



def same_but_date(left: str, right: str) -> bool:
    """Whether two READMEs agree apart from their dates.

    Args:
        left, right: the README texts.

    Returns:
        True when they are equal once every ``20YY-MM-DD`` is masked.
    """
    return re.sub(DATE_PATTERN, "DATE", left) == re.sub(DATE_PATTERN, "DATE", right)
