"""vllm-ascend's chunk-state kernels derive into indexed twins; each refusal of their shape is decided by one part.

Released code read: ``vllm_ascend/ops/triton/fla/chunk_delta_h.py`` (the :data:`~derive.LEADING` shape: ``[N, H, K,
V]`` states, two 64-wide value halves, the offsets leading their blocks) and ``vllm_ascend/ops/triton/kda/
chunk_delta_h.py`` (the own-block shape of vLLM's FLA, ``[N, H, V, K]``) of every vllm-ascend release that has them,
executed from the release cache with the installed Triton.

Not run here: the twins themselves. Both kernels load and store through block pointers (``tl.make_block_ptr``), and
this environment's Triton interpreter (3.9) has removed them ("Block pointers have been removed in favor of the
tensor descriptor API"), so the bit-equality of twin and gather -> release host -> scatter that
``test_indexed_chunk_kernel.py`` shows for vLLM's masked-pointer kernel cannot be run on this CPU; the twins are
compiled for A2/A3 and A5 by the Ascend check instead (``tests/ascend_check``).
"""

from __future__ import annotations

import ast

import pytest

from kda_patches.ascend_check.indexed_twins import KERNEL_FILES, RELEASES, derive_release_twin, release_roots
from kda_patches.indexed_chunk.derive import (
    KERNEL_SHAPES,
    LEADING,
    DerivationRefused,
    declare,
    derive_indexed_kernel,
    edit_kernel_source,
)


@pytest.fixture(scope="module")
def roots() -> dict:
    return release_roots()


@pytest.mark.parametrize("shape", sorted(KERNEL_FILES))
def test_every_released_kernel_derives_its_indexed_twin(roots: dict, shape: str) -> None:
    """Every release's kernel derives; the offsets address the sequence's cache row by head, the read is flag-gated,
    every final store is the exact cast under ``kda_valid``; the parameters gain the rows and the cast constexprs."""
    digests = set()
    for version in RELEASES:
        derived = derive_release_twin(roots[version], shape)
        text = derived.source
        digests.add(derived.source_sha256)
        target = KERNEL_SHAPES[shape].target_of
        for pointer in ("h0", "ht"):
            assert f"{target(pointer)} = {pointer} + kda_safe_row * kda_row_stride + i_h * " in text, version
        assert "i_nh" not in "".join(line for line in text.splitlines() if "kda_safe_row * kda_row_stride" in line)
        assert "if kda_read:" in text and "if kda_valid:" in text, version
        stores = [line for line in text.splitlines() if "tl.store(p_ht" in line]
        assert stores and all("kda_cast_bits(" in line and "bitcast=True" in line for line in stores), version
        assert derived.arg_names[derived.arg_names.index("ht") + 1:][:4] == \
            ["kda_rows", "kda_flags", "kda_num_rows", "kda_row_stride"]
        assert derived.arg_names[-3:] == ["KDA_DST", "KDA_NAN_RULE", "KDA_NAN_BITS"]
        assert derived.configs == ([] if shape == "vllm-ascend-fla" else
                                   [{"kwargs": {"BV": 64}, "num_warps": 4, "num_stages": 3}])
    assert len(digests) == 1  # one kernel source across the releases (0.30 changed only the FLA host)


def test_a_kernel_declared_with_the_other_shape_is_refused(roots: dict) -> None:
    """The FLA kernel is not of the own-block shape, the KDA kernel not of the leading one: the offset is named."""
    from kda_patches.ascend_check.indexed_twins import load_kernel_module

    root = roots[RELEASES[-1]]
    fla = load_kernel_module(root, KERNEL_FILES["vllm-ascend-fla"])
    kda = load_kernel_module(root, KERNEL_FILES["vllm-ascend-kda"])
    as_own_block = declare("vllm-ascend-kda", fla.__name__)
    as_own_block = type(as_own_block)(**{**as_own_block.__dict__, "kernel": KERNEL_SHAPES["vllm-ascend-fla"].kernel,
                                         "host": KERNEL_SHAPES["vllm-ascend-fla"].host})
    with pytest.raises(DerivationRefused, match="the h0 offset"):
        derive_indexed_kernel(fla, as_own_block)
    as_leading = declare("vllm-ascend-fla", kda.__name__)
    as_leading = type(as_leading)(**{**as_leading.__dict__, "kernel": KERNEL_SHAPES["vllm-ascend-kda"].kernel,
                                     "host": KERNEL_SHAPES["vllm-ascend-kda"].host})
    with pytest.raises(DerivationRefused, match="the h0 offset"):
        derive_indexed_kernel(kda, as_leading)


DECLARATION = declare("vllm-ascend-fla", "tests.ascend_kernel")
# A small kernel of the leading shape: each part the declaration names once (the offsets leading their blocks).
BASE = '''
@triton.jit(do_not_specialize=["T", "K", "V"])
def kernel(x, h0, ht, T, H, K, V, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr):
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    b_h = tl.zeros([128, 64], dtype=tl.float32)
    o = tl.arange(0, 128)[:, None] * V + tl.arange(0, 64)[None, :]
    if USE_INITIAL_STATE:
        h0_ptr = h0 + i_nh * K * V
        b_h += tl.load(h0_ptr + o).to(tl.float32)
    b_h += tl.load(x + o)
    if STORE_FINAL_STATE:
        ht_ptr = ht + i_nh * K * V
        p_ht = tl.make_block_ptr(ht_ptr, (K, V), (V, 1), (0, 0), (128, 64), (1, 0))
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), boundary_check=(0, 1))
'''


def derive(source: str, declaration=DECLARATION) -> str:
    definition, _ = edit_kernel_source(source.strip() + "\n", declaration)
    return ast.unparse(definition)


def test_the_base_kernel_of_the_leading_shape_derives() -> None:
    text = derive(BASE)
    assert DECLARATION.offset == LEADING
    assert "h0_ptr = h0 + kda_safe_row * kda_row_stride + i_h * K * V" in text
    assert "ht_ptr = ht + kda_safe_row * kda_row_stride + i_h * K * V" in text
    lines = text.splitlines()
    read = lines.index("    if USE_INITIAL_STATE:")
    assert lines[read + 1] == "        if kda_read:" and "kda_safe_row = " in lines[read - 1]
    assert "        if kda_valid:" in lines and "kda_cast_bits(b_h, 0, KDA_DST" in text


@pytest.mark.parametrize(("edit", "part"), [
    (("        h0_ptr = h0 + i_nh * K * V\n", "        h0_ptr = h0 + i_n * K * V\n"),
     "the h0 offset"),  # the offset does not name the packed row
    (("        h0_ptr = h0 + i_nh * K * V\n        b_h += tl.load(h0_ptr + o).to(tl.float32)\n",
      "        b_h += tl.load(x + o)\n        h0_ptr = h0 + i_nh * K * V\n"
      "        b_h += tl.load(h0_ptr + o).to(tl.float32)\n"), "the h0 offset"),  # not leading its block
    (("    if STORE_FINAL_STATE:\n", "    if STORE_FINAL_STATE:\n        ht_ptr = ht + i_nh * K * V\n"
      "        tl.store(ht_ptr + o, b_h.to(ht_ptr.dtype.element_ty))\n    if STORE_FINAL_STATE:\n"),
     "the ht offset"),  # a second block of its own offset
    (("        b_h += tl.load(h0_ptr + o).to(tl.float32)\n", "        b_h += tl.load(h0 + o).to(tl.float32)\n"),
     "the state pointers"),  # h0 read past its offset, at the packed row's address
    (("    b_h += tl.load(x + o)\n", "    b_h += tl.load(x + o) + tl.load(ht_ptr)\n"), "the state pointers"),
    (("    b_h += tl.load(x + o)\n", "    kda_extra = 1\n    b_h += tl.load(x + o)\n"), "the twin's names"),
    (("tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), boundary_check=(0, 1))",
      "tl.store(p_ht, b_h, boundary_check=(0, 1))"), "the STORE_FINAL_STATE block"),
    (('@triton.jit(do_not_specialize=["T", "K", "V"])', "@triton.jit(do_not_specialize=NAMES)"), "the jit decorator"),
    (("        b_h += tl.load(h0_ptr + o).to(tl.float32)\n", "        b_h += h0_ptr\n"), "the USE_INITIAL_STATE block"),
    (("    if STORE_FINAL_STATE:\n        ht_ptr",
      "    if STORE_FINAL_STATE:\n        tl.debug_barrier()\n        ht_ptr"), "the ht offset"),  # not leading
    (("def kernel(x, h0, ht,", "def kernel(x, h_init, ht,"), "the parameters"),
])
def test_a_source_not_of_the_leading_shape_is_refused_naming_the_part(edit: tuple[str, str], part: str) -> None:
    old, new = edit
    assert old in BASE
    with pytest.raises(DerivationRefused, match=part) as refused:
        derive(BASE.replace(old, new, 1))
    assert "tests.ascend_kernel.chunk_gated_delta_rule_fwd_kernel_h_blockdim64" in str(refused.value)
    assert "keeps copying" in str(refused.value)


@pytest.mark.parametrize("change", [{"offset": "inline"}, {"final_target": ""}])
def test_an_undeclared_shape_is_refused_naming_the_declaration(change: dict) -> None:
    declaration = type(DECLARATION)(**{**DECLARATION.__dict__, **change})
    with pytest.raises(DerivationRefused, match="the declaration"):
        derive(BASE, declaration)
