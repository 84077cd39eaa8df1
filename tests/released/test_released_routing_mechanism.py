"""Under the overlay's default routing, each released seam kind runs its rewritten twin (issue 19).

One released function per seam form: a native clear (vLLM 0.33 Qwen GDN), a gather function (vLLM 0.33 Kimi K3),
a function clear with an argument cache (vllm-ascend 0.29 Kimi ``_run_prefill``) and a function clear on both prefill
variants (vllm-ascend 0.29 GDN). The A/B itself is the other tests' (this reads the patched child's ledger).
"""

from __future__ import annotations

import pytest
import released_ab

RUNS = [("upstream_gdn_child.py", ["qwen", "0.33.0", "float32", "DS"],
         "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention._forward_core", 1),
        ("upstream_kimi_child.py", ["k3", "0.33.0", "bfloat16", "SD"],
         "vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention._forward", 1),
        ("ascend_kimi_child.py", ["0.29.0rc1", "bfloat16"],
         "vllm_ascend.ops.kimi_kda:AscendKimiK3DeltaAttention._run_prefill", 1),
        ("ascend_gdn_child.py", ["0.29.0rc1", "fused", "float32"],
         "vllm_ascend.ops.gdn:AscendGatedDeltaNetAttention._forward_core", 2)]


@pytest.mark.parametrize(("script", "args", "key", "gathers"), RUNS, ids=[key.split(":")[1] for _, _, key, _ in RUNS])
def test_the_released_seam_runs_its_rewritten_twin(script: str, args: list[str], key: str, gathers: int) -> None:
    seed = str(released_ab.fresh_seed())
    argv = [*args[:2], seed, *args[2:]] if script != "ascend_kimi_child.py" else [args[0], seed, *args[1:]]
    _, patched = released_ab.run_pair(script, argv)
    facts = patched["ledger"]["facts"]
    routing = next(section[f"routing {key}"] for section in facts.values() if f"routing {key}" in section)
    assert routing["mechanism"] == "rewrite", routing
    kinds = [line.split(": ", 1)[1] for line in routing["replaced"]]
    assert sum(kind.startswith("gather") or kind.endswith("call") for kind in kinds) == gathers, kinds
    assert any(kind.startswith("scatter") for kind in kinds), kinds
