"""Read-only verifier of vLLM 0.34's extensible KV cache after ``extend_kv_cache`` rebinds every layer's views.

vLLM 0.34 reserves address space for the KV cache, commits a prefix during warmup and, once the final block count
is known, ``extend_kv_cache`` rebuilds every layer's views over the committed bytes (``committed_views``, one tensor
per layer over its segment) and binds them again. The overlay changes nothing there. ``kv_cache_layout`` wraps
``extend_kv_cache`` and, as soon as it returns, :func:`verify_rebind` hands the views now bound to the layers -- the
ones every request is served with -- to the aliasing checker, described per address space as the CPU proof of the
released code describes them (:func:`~kda_patches.kv_layout.upstream034_proof.describe_address_spaces`; table in
``docs/results/ascend-kv-layout``) and ranked as the vllm-ascend verifier ranks them. The verdict alone decides
(:func:`~kda_patches.kv_layout.ascend_verify.action_for`), never a list of releases or models:

- ``proven``: nothing is changed; the ledger says "upstream layout proven" and what was checked (fact
  ``upstream_layout``, and the ``summary`` in mode ``verify``).
- ``overlap found`` or ``out of storage``: :class:`~kda_patches.kv_layout.ascend_verify.LayoutRefused` stops the
  engine before it serves a request, naming the release, the model, the two views, the shared byte and how far each
  view advances per block id.
- ``not checkable``: the views are kept with one WARNING ("upstream layout not proven"); under
  ``KDA_PATCHES_STRICT=1`` the refusal instead.

Why a verifier and no adapter: the CPU proof finds every released layout of the three models at TP 1/2/4/8 proven
before and after the rebind (the committed table), so there is nothing to move; the rebind only re-views the same
bytes with the final block count. The proof at run time covers what the table cannot: this process's own model,
TP, block size and layout.

Imports torch (through the view descriptions); imported by the wrapper at startup only.
"""

from __future__ import annotations

from typing import Any

from kda_patches.kv_layout.ascend_verdict import ranked_verdict
from kda_patches.kv_layout.ascend_verify import record_verdict

SECTION = "kv_cache_layout"
FACT = "upstream_layout"
TABLE = "docs/results/ascend-kv-layout/README.md"
FIX = (f"report it with the witness above; the released layouts of Kimi K3, Qwen3.6-27B and Qwen3-Next at TP "
       f"1/2/4/8 are proven before and after the rebind ({TABLE}, `python -m kda_patches.kv_layout.ascend_proof`), "
       "so a configuration outside them (model, TP, block size, VLLM_KV_CACHE_LAYOUT) or code that rebinds the "
       "views differently is what collides. KDA_PATCHES_DISABLE=kv_cache_layout serves the layout unchecked, "
       "overlap included")


def bound_views(runner: Any) -> tuple[Any, dict[str, Any]]:
    """``(kv_cache_config, layer -> bound cache)`` of a runner after the rebind: every layer of a KV cache group
    that the static forward context holds with a bound cache (state tuples as lists)."""
    config = runner.kv_cache_config
    context = runner.compilation_config.static_forward_context
    views = {}
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            bound = getattr(context.get(name), "kv_cache", None)
            if bound is None:
                continue
            views[name] = list(bound) if isinstance(bound, tuple) else bound
    return config, views


def verify_rebind(kv_cache_config: Any, views: dict[str, Any], release: str, model: str,
                  strict: bool) -> dict[str, Any]:
    """Prove the views bound after the rebind, record the verdict, and refuse to go on when they can collide.

    Args:
        kv_cache_config: the runner's ``KVCacheConfig`` after the rebind (its ``num_blocks`` the final count).
        views: layer -> the tensor, or list of state tensors, bound to it (:func:`bound_views`).
        release: the installed vLLM, for messages (``vLLM 0.34.0``).
        model: the served model, for messages.
        strict: ``KDA_PATCHES_STRICT=1``.

    Returns:
        The fact recorded under ``kv_cache_layout.upstream_layout``.

    Raises:
        LayoutRefused: an overlap or a view out of its storage, or not checkable under STRICT.
    """
    from kda_patches.kv_layout.upstream034_proof import describe_address_spaces

    num_blocks = kv_cache_config.num_blocks
    witness = None
    try:
        described = describe_address_spaces(kv_cache_config, views)
        spaces = {key: value for key, value in described.items() if key[0] == "space"}
        verdict, detail, witness, num_spaces, num_views = ranked_verdict(spaces)
        if verdict == "proven":
            verdict, detail, witness, _, _ = ranked_verdict({key: value for key, value in described.items()
                                                             if key[0] == "own"})
    except Exception as error:  # a view the checker cannot describe: unproven, never a crash of the verifier
        verdict, detail, num_spaces, num_views = "not checkable", f"views: {type(error).__name__}: {error}", 0, 0
    checked = (f"{num_views} views of {len(views)} layers in {num_spaces} address space(s) after extend_kv_cache, "
               f"block ids 0-{num_blocks - 1}, by the aliasing checker")
    return record_verdict(verdict, detail, witness, release=release, model=model, checked=checked, strict=strict,
                          fact_key=FACT, era="vllm-0.34-extensible", storages=num_spaces, layers=len(views), fix=FIX,
                          refusing="refusing to serve", subject="the KV-cache views extend_kv_cache bound",
                          kept="the views are kept unchecked (KDA_PATCHES_STRICT=1 refuses instead)",
                          where=" after extend_kv_cache", counter="rebinds_verified")
