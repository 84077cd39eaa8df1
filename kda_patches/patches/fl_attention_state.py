"""``fl_attention_state``: record of vllm-plugin-FL's attention-state comparison bug (seed 004 §6.3).

vllm-plugin-FL's ``AscendAttentionBackendImpl.forward`` (``vllm_fl/dispatch/backends/vendor/ascend/impl/
attention.py``) guards its ``kv_cache = [i.contiguous() for i in kv_cache]`` with
``if attn_metadata != AscendAttentionState.DecodeOnly:`` — a metadata *object* compared with an enum member,
always true, so every call copies each non-contiguous K/V cache (the hybrid re-stride makes them so): a whole
cache copy per layer per step in the seed's profile (patches/README.md, ``fl_attention_state``). The fix compares
``attn_metadata.attn_state``.

This record wraps that ``forward`` without changing what it does (the comparison sits inside the method; the
remedy that needs no rewrite is ``kv_cache_layout`` keeping the cache contiguous, which makes the copy a
no-op). On the first call it reads the method's source and records whether the buggy comparison is present
(fact ``fl_attention_state/bug_present``); per call it counts the copies the bug forces on decode-only steps
and their bytes (``forced_copies``, ``forced_copy_bytes``), and the calls where the cache was already
contiguous (``contiguous_calls``), so ``kda-patches status`` shows whether the copies happen.
Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

from kda_patches.ledger import get_ledger
from kda_patches.registry import Patch, Target

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any


LEDGER_PATH = "fl_attention_state"
FORWARD_PARAMETERS = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
                      "output_scale", "output_block_scale")
_bug_present: dict[Any, bool] = {}


def source_has_state_comparison_bug(function: Any) -> bool | None:
    """Return whether ``function`` compares ``attn_metadata`` itself with ``AscendAttentionState.<member>``.

    Returns:
        True/False from the parsed source, or None when the source is unavailable.
    """
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "attn_metadata":
            for right in node.comparators:
                if isinstance(right, ast.Attribute) and isinstance(right.value, ast.Name) \
                        and right.value.id == "AscendAttentionState":
                    return True
    return False


def _is_decode_only(attn_metadata: Any) -> bool:
    state = getattr(attn_metadata, "attn_state", None)
    return getattr(state, "name", None) == "DecodeOnly"


def wrap_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Count the ``.contiguous()`` copies the comparison bug forces, then run the original ``forward``."""
    key = getattr(wrapped, "__func__", wrapped)
    bug = _bug_present.get(key)
    if bug is None:
        bug = bool(source_has_state_comparison_bug(wrapped))
        _bug_present[key] = bug
        get_ledger().set_fact(LEDGER_PATH, "bug_present", bug)
    kv_cache = kwargs["kv_cache"] if "kv_cache" in kwargs else (args[4] if len(args) > 4 else None)
    metadata = kwargs["attn_metadata"] if "attn_metadata" in kwargs else (args[5] if len(args) > 5 else None)
    if metadata is not None and kv_cache is not None:
        ledger = get_ledger()
        strided = [t for t in kv_cache if hasattr(t, "is_contiguous") and not t.is_contiguous()]
        if not strided:
            ledger.count(LEDGER_PATH, "contiguous_calls")
        elif bug and _is_decode_only(metadata):
            ledger.count(LEDGER_PATH, "forced_copies", len(strided))
            ledger.count(LEDGER_PATH, "forced_copy_bytes", sum(t.numel() * t.element_size() for t in strided))
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name="fl_attention_state",
    summary="record (and count) vllm-plugin-FL's always-true attention-state comparison that forces KV copies",
    targets=(
        Target(module="vllm_fl.dispatch.backends.vendor.ascend.impl.attention",
               qualname="AscendAttentionBackendImpl.forward", wrapper=wrap_forward, stack="vllm-plugin-FL",
               distribution="vllm_fl", parameters=FORWARD_PARAMETERS),
    ),
)
