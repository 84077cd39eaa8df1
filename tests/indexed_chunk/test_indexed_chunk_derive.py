"""The derivation's refusals, each decided by one edit of a small kernel of the declared shape.

The base source has every part the declaration names (the offsets, the guarded load and store blocks); each test
breaks exactly one part, and the base source itself derives (so the part alone decides the refusal).
"""

from __future__ import annotations

import ast

import pytest

from kda_patches.indexed_chunk.derive import DerivationRefused, KernelDeclaration, edit_kernel_source

DECLARATION = KernelDeclaration(module="tests.kernel", kernel="kernel", host="host")
BASE = '''
@triton.jit(do_not_specialize=["T"])
def kernel(x, h0, ht, T, H: tl.constexpr, V: tl.constexpr, K: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
           STORE_FINAL_STATE: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    b_h = tl.zeros([V, K], dtype=tl.float32)
    if USE_INITIAL_STATE:
        h0 = h0 + i_nh.to(tl.int64) * V * K
    if STORE_FINAL_STATE:
        ht = ht + i_nh.to(tl.int64) * V * K
    o = tl.arange(0, V)[:, None] * K + tl.arange(0, K)[None, :]
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + o).to(tl.float32)
    b_h += tl.load(x + o)
    if STORE_FINAL_STATE:
        tl.store(ht + o, b_h.to(ht.dtype.element_ty))
'''


def derive(source: str) -> tuple[str, dict]:
    definition, keywords = edit_kernel_source(source.strip() + "\n", DECLARATION)
    return ast.unparse(definition), keywords


def test_the_base_kernel_derives_with_every_edit() -> None:
    text, keywords = derive(BASE)
    # the release's own keywords, and the twin's row arguments never specialized (no variant per cache size/offset)
    assert keywords == {"do_not_specialize": ["T", "kda_rows", "kda_flags", "kda_num_rows", "kda_row_stride"]}
    assert "h0 = h0 + kda_safe_row * kda_row_stride + i_h.to(tl.int64) * V * K" in text
    assert "ht = ht + kda_safe_row * kda_row_stride + i_h.to(tl.int64) * V * K" in text
    assert "if kda_read:" in text and "if kda_valid:" in text and "kda_cast_bits(b_h, 0, KDA_DST" in text
    assert "def kernel(x, h0, ht, kda_rows, kda_flags, kda_num_rows, kda_row_stride, T," in text
    assert text.rstrip().endswith("bitcast=True))") and "@" not in text.splitlines()[0]


@pytest.mark.parametrize(("edit", "part"), [
    (("        h0 = h0 + i_nh.to(tl.int64) * V * K\n", "        h0 = h0 + i_n.to(tl.int64) * V * K\n"),
     "the h0 offset"),  # the offset does not name the packed row
    (("    if STORE_FINAL_STATE:\n        ht = ht + i_nh.to(tl.int64) * V * K\n",
      "    if STORE_FINAL_STATE:\n        ht = ht + i_nh.to(tl.int64) * V * K\n"
      "    if STORE_FINAL_STATE:\n        ht = ht + i_nh.to(tl.int64) * V * K\n"), "the ht offset"),  # twice
    (("    b_h += tl.load(x + o)\n", "    b_h += tl.load(x + o) + tl.load(h0)\n"), "the state pointers"),
    (("    b_h += tl.load(x + o)\n", "    kda_extra = 1\n    b_h += tl.load(x + o)\n"), "the twin's names"),
    (("tl.store(ht + o, b_h.to(ht.dtype.element_ty))", "tl.store(ht + o, b_h)"), "the STORE_FINAL_STATE block"),
    (('@triton.jit(do_not_specialize=["T"])', "@triton.jit(do_not_specialize=NAMES)"), "the jit decorator"),
    (("        b_h += tl.load(h0 + o).to(tl.float32)\n", "        b_h += h0\n"), "the USE_INITIAL_STATE block"),
])
def test_a_source_not_of_the_declared_shape_is_refused_naming_the_part(edit: tuple[str, str], part: str) -> None:
    old, new = edit
    assert old in BASE
    with pytest.raises(DerivationRefused, match=part) as refused:
        derive(BASE.replace(old, new, 1))
    assert "tests.kernel.kernel" in str(refused.value) and "keeps copying" in str(refused.value)


def write_release(root, kernel_source: str):
    """A release of one module ``fla.chunk_delta_h`` holding ``kernel_source`` and a host function."""
    from kda_patches.releases.source import ReleaseSource

    (root / "fla").mkdir()
    (root / "fla" / "__init__.py").write_text("")
    (root / "fla" / "chunk_delta_h.py").write_text(kernel_source.strip() + "\n\n\ndef host(k, w, u):\n    pass\n")
    return ReleaseSource(root)


@pytest.mark.parametrize("breaks", [False, True])
def test_conformance_checks_that_the_release_kernel_derives(tmp_path, breaks: bool) -> None:
    """The shape the no-copy target declares holds exactly when the kernel beside its host function derives."""
    from kda_patches.registry import Target
    from kda_patches.releases.shapes import check_shape

    source = BASE.replace("tl.store(ht + o, b_h.to(ht.dtype.element_ty))", "tl.store(ht + o, b_h)") if breaks \
        else BASE
    kernel = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
    release = write_release(tmp_path, source.replace("def kernel(", f"def {kernel}("))
    target = Target("fla.chunk_delta_h", "host", lambda wrapped, instance, args, kwargs: None)
    result = check_shape(f"indexed:{kernel}", release, target,
                         release.resolve("fla.chunk_delta_h", "host"))
    assert result.ok is not breaks, result.evidence
    assert ("STORE_FINAL_STATE block" in result.evidence) is breaks
