"""The committed Ascend KV-layout table is what the released code gives today (issue 53, deliverable 1).

Regenerates ``docs/results/ascend-kv-layout/README.md`` in memory -- every vllm-ascend release x model x TP executed
from the release cache and proven by the checker (``python -m kda_patches.kv_layout.ascend_proof``), and vLLM 0.34's
extensible KV cache of the same models before and after ``extend_kv_cache`` -- and fails, showing the difference,
when it differs from the committed file in anything but its date. About 30 s on one core.
"""

from __future__ import annotations

import difflib
import pathlib

from kda_patches.kv_layout import ascend_models, ascend_proof, ascend_table

README = pathlib.Path(__file__).resolve().parents[2] / "docs/results/ascend-kv-layout/README.md"


def test_committed_table_matches_a_fresh_run() -> None:
    rows, bound = ascend_proof.run_all()
    assert [(fork, vllm, model, tp) for fork, vllm, model, tp, _ in rows] == [
        (fork, vllm, model, tp) for fork, vllm in ascend_proof.RELEASES for model in ascend_models.MODELS
        for tp in ascend_proof.TENSOR_PARALLEL]
    upstream = ascend_proof.run_upstream()
    assert [(vllm, model, tp) for vllm, model, tp, _ in upstream[0]] == [
        (vllm, model, tp) for vllm in ascend_proof.UPSTREAM_RELEASES for model in ascend_models.MODELS
        for tp in ascend_proof.TENSOR_PARALLEL]
    fresh = ascend_table.render(rows, bound, "2000-01-01", upstream)
    committed = README.read_text(encoding="utf-8")
    diff = "".join(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True), str(README), "fresh"))
    assert ascend_table.same_but_date(committed, fresh), (
        "the committed table drifted from the released code's layouts; regenerate with "
        "`python -m kda_patches.kv_layout.ascend_proof --write docs/results/ascend-kv-layout/README.md`:\n" + diff)
