"""Under the overlay's default routing, each released seam kind runs its rewritten twin (issue 19).

One released function per seam form: a native clear (vLLM 0.33 Qwen GDN), a gather function (vLLM 0.33 Kimi K3),
a function clear with an argument cache (vllm-ascend 0.29 Kimi ``_run_prefill``) and a function clear on both prefill
variants (vllm-ascend 0.29 GDN). The A/B itself is the other tests' (this reads the patched side's ledger of the
same batches: :mod:`released_batches`, each run once per pytest process).
"""

from __future__ import annotations

import pytest
import released_ab
import released_batches

RUNS = [(released_batches.upstream("0.33.0"), "qwen:float32:DS",
         "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention._forward_core", 1),
        (released_batches.upstream("0.33.0"), "k3:bfloat16:SD",
         "vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention._forward", 1),
        (released_batches.ascend("0.29.0rc1", "fused"), "kimi:bfloat16",
         "vllm_ascend.ops.kimi_kda:AscendKimiK3DeltaAttention._run_prefill", 1),
        (released_batches.ascend("0.29.0rc1", "fused"), "gdn:float32",
         "vllm_ascend.ops.gdn:AscendGatedDeltaNetAttention._forward_core", 2)]


@pytest.mark.parametrize(("batch", "case", "key", "gathers"), RUNS, ids=[key.split(":")[1] for _, _, key, _ in RUNS])
def test_the_released_seam_runs_its_rewritten_twin(batch: released_ab.Batch, case: str, key: str,
                                                   gathers: int) -> None:
    run = released_ab.run_batch(batch)
    patched = run.case(case, "patched")
    context = run.context(case)
    facts = patched["ledger"]["facts"]
    routing = next((section[f"routing {key}"] for section in facts.values() if f"routing {key}" in section), None)
    assert routing is not None, context + f"\nno routing fact for {key}: {sorted(facts)}"
    assert routing["mechanism"] == "rewrite", context + f"\n{routing}"
    kinds = [line.split(": ", 1)[1] for line in routing["replaced"]]
    assert sum(kind.startswith("gather") or kind.endswith("call") for kind in kinds) == gathers, context + f"\n{kinds}"
    assert any(kind.startswith("scatter") for kind in kinds), context + f"\n{kinds}"
