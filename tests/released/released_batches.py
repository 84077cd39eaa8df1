"""Every batch tests/released runs: which cases share one fresh process per side (issue 28).

Cases share a process when they load the same release files under the same module names with the same
switches: one vLLM source (the installed 0.32, or one release's layer files on it) runs all four upstream layers;
one vllm-ascend release runs its GDN and its Kimi cases -- except that the GDN prefill variant (the CANN fused
chunk present or not) is one per process, so vllm-ascend 0.29's ``triton`` case has a process of its own. Different
releases of the same module names never share a process. The test files take their cases from here
(declarations, not copies), and a batch asked for by several files runs once per pytest process
(:func:`released_ab.run_batch`): the routing-mechanism test reads the ledgers of batches the A/B tests run.
"""

from __future__ import annotations

from released_ab import AB, Batch, Side

# upstream vLLM: (kind, source, cache dtype, conv layout)
UPSTREAM_GDN_CASES = (("qwen", "installed", "float32", "SD"), ("qwen", "installed", "bfloat16", "DS"),
                      ("qwen", "0.33.0", "float32", "DS"), ("olmo", "installed", "bfloat16", "SD"),
                      ("olmo", "0.33.0", "float32", "DS"))
# Kimi Linear scatters ``recurrent_state[idx] = last`` without a cast: with a BF16 cache and the FP32 final
# state FLA returns, vLLM's own code raises (index_put dtype mismatch) while the routed scatter would cast,
# so that layer runs on FP32 caches here (the divergence is reported, not asserted).
UPSTREAM_KIMI_CASES = (("k3", "installed", "float32", "SD"), ("k3", "installed", "bfloat16", "DS"),
                       ("k3", "0.33.0", "bfloat16", "SD"), ("linear", "installed", "float32", "SD"),
                       ("linear", "0.33.0", "float32", "DS"))
UPSTREAM_SOURCES = ("installed", "0.33.0")

# vllm-ascend: (release, GDN prefill variant, cache dtype); Kimi (release, cache dtype)
ASCEND_GDN_CASES = (("0.26.0rc1", "triton", "float32"), ("0.27.1rc1", "fused", "bfloat16"),
                    ("0.28.0rc1", "triton", "bfloat16"), ("0.29.0rc1", "fused", "float32"),
                    ("0.29.0rc1", "triton", "float32"))
ASCEND_KIMI_CASES = (("0.26.0rc1", "float32"), ("0.27.1rc1", "bfloat16"), ("0.28.0rc1", "float32"),
                     ("0.29.0rc1", "bfloat16"))
# the process (variant) each release's Kimi case shares: its GDN case's
KIMI_VARIANT = {"0.26.0rc1": "triton", "0.27.1rc1": "fused", "0.28.0rc1": "triton", "0.29.0rc1": "fused"}
# vllm-ascend 0.30 (its own Kimi plan; GDN's FLA branch): GDN (release, cache dtype); Kimi releases (FP32 caches)
GDN030_CASES = (("0.30.0rc2", "float32"), ("0.30.0rc2", "bfloat16"), ("0.30.0rc1", "bfloat16"))
KIMI_FORK_RELEASES = ("0.30.0rc1", "0.30.0rc2")
# 0.30's sides: the baseline twice (is it deterministic across processes?), the switch's two choices
GDN030_SIDES = (("baseline", Side(False)), ("second", Side(False)), ("fork", Side(True)),
                ("overlay", Side(True, (("KDA_PATCHES_GDN_PLAN", "overlay"),))))
KIMI_FORK_SIDES = ("baseline", "fork")  # the fork's plan refuses CPU caches: the overlay standing aside only


# vLLM 0.34.0's layers (upstream034_child.py): the overlay off vs on in each GDN-ops choice
# (test_upstream034_layers), and the no-copy cases off vs KDA_PATCHES_STATE_IO=indexed (tests/indexed_chunk's
# test_indexed_034_layers), in one batch: one baseline process runs both files' cases
UPSTREAM034_CASES = ("qwen:float32:SD", "qwen:bfloat16:DS", "linear:float32:DS", "linear:bfloat16:SD",
                     "k3:float32:SD", "k3:bfloat16:DS", "olmo:bfloat16:SD", "olmo:float32:DS",
                     # each layer call captured under 0.34's own breakable CUDA graph (its default for both Kimi
                     # models on CUDA), then replayed: the replays are the served calls, the capture-time run a dummy's
                     "k3:bfloat16:SD:breakable", "linear:float32:DS:breakable",
                     # Qwen on 0.34's FlashInfer prefill backend (`auto` on SM90): the released
                     # _forward_flashinfer_prefill gathers and the seam scatters -- the seam stands aside on that
                     # backend, both copies upstream's
                     "qwen:bfloat16:DS:flashinfer",
                     # Kimi K3 on FlashKDA (0.34's `auto` on SM90+): its copies stand outside the backend branch,
                     # routed as ever
                     "k3:bfloat16:DS:flashkda")
# BF16 and FP32 caches, both conv layouts, every 0.34 seam once (each case costs the interpreter's chunk rule twice)
UPSTREAM034_INDEXED_CASES = ("qwen:bfloat16:DS:indexed", "linear:float32:DS:indexed", "k3:bfloat16:SD:indexed",
                             "olmo:float32:SD:indexed")
UPSTREAM034_SIDES = (("baseline", Side(False)), ("measured", Side(True)),
                     ("upstream", Side(True, (("KDA_PATCHES_GDN_OPS", "upstream"),))),
                     ("overlay", Side(True, (("KDA_PATCHES_GDN_OPS", "overlay"),))))
UPSTREAM034_INDEXED_SIDE = ("indexed", Side(True, (("KDA_PATCHES_STATE_IO", "indexed"),
                                                   ("KDA_PATCHES_GDN_OPS", "overlay"))))


def upstream034(root: str) -> Batch:
    """vLLM 0.34.0's layers (``root``: the release's folder), both files' cases in one batch: the layer cases on the
    baseline and the three GDN-ops sides, the no-copy cases on the baseline and the ``indexed`` side -- one baseline
    process for both (the layer cases first: their slots, so their layer names, are those of a batch of their own)."""
    layer_sides = tuple(side for side, _ in UPSTREAM034_SIDES)
    only = (*((case, layer_sides) for case in UPSTREAM034_CASES),
            *((case, ("baseline", UPSTREAM034_INDEXED_SIDE[0])) for case in UPSTREAM034_INDEXED_CASES))
    return Batch("vLLM 0.34.0's four seam layers, overlay off / on in each GDN-ops choice / no copy "
                 "(upstream034_child.py)", "upstream034_child.py", (root,),
                 (*UPSTREAM034_CASES, *UPSTREAM034_INDEXED_CASES), (*UPSTREAM034_SIDES, UPSTREAM034_INDEXED_SIDE),
                 only=only)


def upstream_case(kind: str, cache_dtype: str, conv_layout: str) -> str:
    """Return the case id of an upstream layer case (:mod:`upstream_child`)."""
    return f"{kind}:{cache_dtype}:{conv_layout}"


def upstream(source: str) -> Batch:
    """Every upstream case of ``source`` (``installed`` or a vLLM release), one process per side."""
    cases = tuple(upstream_case(kind, dtype, layout) for kind, case_source, dtype, layout
                  in (*UPSTREAM_GDN_CASES, *UPSTREAM_KIMI_CASES) if case_source == source)
    label = "the installed vLLM 0.32" if source == "installed" else f"vLLM {source}'s layer files on the installed 0.32"
    return Batch(f"upstream layers of {label} (upstream_child.py {source})", "upstream_child.py", (source,), cases)


def ascend(release: str, variant: str) -> Batch:
    """Every vllm-ascend ``release`` case whose process has the GDN prefill ``variant``, one process per side."""
    cases = [f"gdn:{dtype}" for case_release, case_variant, dtype in ASCEND_GDN_CASES
             if (case_release, case_variant) == (release, variant)]
    cases += [f"kimi:{dtype}" for case_release, dtype in ASCEND_KIMI_CASES
              if case_release == release and KIMI_VARIANT[release] == variant]
    title = f"vllm-ascend {release}, GDN prefill variant {variant} (ascend_child.py {release} {variant})"
    return Batch(title, "ascend_child.py", (release, variant), tuple(cases), AB)


def ascend030(release: str) -> Batch:
    """Every vllm-ascend 0.30 ``release`` case: GDN's FLA branch on four sides, the Kimi startup on two."""
    cases = tuple(f"gdn:{dtype}" for case_release, dtype in GDN030_CASES if case_release == release)
    kimi = ("kimi:float32",) if release in KIMI_FORK_RELEASES else ()
    title = f"vllm-ascend {release}, GDN prefill variant fla (ascend_child.py {release} fla)"
    return Batch(title, "ascend_child.py", (release, "fla"), cases + kimi, GDN030_SIDES,
                 only=tuple((case, KIMI_FORK_SIDES) for case in kimi))  # Kimi last: its startup raises there
