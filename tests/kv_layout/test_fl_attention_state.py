"""``fl_attention_state`` on stand-in modules with vllm-plugin-FL's module path and forward signature (the
plugin needs CANN/torch_npu and cannot be installed here): the bug is detected from the source, copies counted."""

from __future__ import annotations

import sys
import textwrap
from typing import Any

import pytest
import torch

from kda_patches import registry
from kda_patches.ledger import get_ledger
from kda_patches.patches import fl_attention_state

MODULE = "vllm_fl.dispatch.backends.vendor.ascend.impl.attention"

STAND_IN = '''
import enum

class AscendAttentionState(enum.Enum):
    PrefillNoCache = 0
    DecodeOnly = 1

class AscendAttentionBackendImpl:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        if {condition}:
            kv_cache = [i.contiguous() for i in kv_cache]
        return kv_cache
'''


def _install(tmp_path: Any, condition: str) -> Any:
    root = tmp_path / "site"
    parts = MODULE.split(".")
    root.joinpath(*parts[:-1]).mkdir(parents=True)
    for depth in range(1, len(parts)):
        root.joinpath(*parts[:depth], "__init__.py").touch()
    root.joinpath(*parts[:-1], "attention.py").write_text(textwrap.dedent(STAND_IN.format(condition=condition)))
    sys.path.insert(0, str(root))
    return root


@pytest.fixture
def fl_record() -> Any:
    yield fl_attention_state.PATCH
    registry.revert_patch(fl_attention_state.PATCH)
    fl_attention_state._bug_present.clear()
    for name in [n for n in sys.modules if n == "vllm_fl" or n.startswith("vllm_fl.")]:
        del sys.modules[name]


BUGGY = "attn_metadata != AscendAttentionState.DecodeOnly"
FIXED = "attn_metadata.attn_state != AscendAttentionState.DecodeOnly"


@pytest.mark.parametrize(("condition", "bug"), [(BUGGY, True), (FIXED, False)])
def test_bug_detected_and_forced_copies_counted(tmp_path: Any, fl_record: Any, condition: str, bug: bool) -> None:
    root = _install(tmp_path, condition)
    try:
        registry.register_patch(fl_record)
        import vllm_fl.dispatch.backends.vendor.ascend.impl.attention as attention

        assert registry.is_applied(fl_record, fl_record.targets[0])
        cache = torch.zeros(2, 4, 8).as_strided((2, 4, 8), (8, 16, 1))  # hybrid-restrided: non-contiguous
        metadata = type("Meta", (), {"attn_state": attention.AscendAttentionState.DecodeOnly})()
        before = get_ledger().counters("fl_attention_state")
        attention.AscendAttentionBackendImpl().forward(None, None, None, None, [cache[0], cache[1]], metadata)
        after = get_ledger().counters("fl_attention_state")
        assert get_ledger().snapshot()["facts"]["fl_attention_state"]["bug_present"] is bug
        forced = after.get("forced_copies", 0) - before.get("forced_copies", 0)
        assert forced == (2 if bug else 0)
    finally:
        sys.path.remove(str(root))
