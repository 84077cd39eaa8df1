"""Output encoding and comparison: exact integers, tolerant floats, first-difference paths."""

from __future__ import annotations

import math

import numpy
import pytest
import torch

from kda_patches.regress.compare import TENSOR_TAG, compare_outputs, encode_outputs


def test_equal_nested_outputs_count_every_leaf() -> None:
    value = {"requests": [{"token_ids": [1, 2, 3], "name": "a"}, {"token_ids": [4], "name": "b"}], "ok": True}
    result = compare_outputs(encode_outputs(value), encode_outputs(value))
    assert result.equal and result.first is None
    assert result.compared == 7 and result.kinds == {"int": 4, "str": 2, "bool": 1}


def test_first_difference_names_the_path_and_both_values() -> None:
    baseline = {"requests": [{"token_ids": [1, 2, 3]}, {"token_ids": [4, 5, 6]}]}
    patched = {"requests": [{"token_ids": [1, 2, 3]}, {"token_ids": [4, 9, 7]}]}
    result = compare_outputs(baseline, patched)
    assert not result.equal and result.differing == 2
    assert result.first.path == "requests[1].token_ids[1]"
    assert (result.first.baseline, result.first.patched) == (5, 9)
    assert "requests[1].token_ids[1]: baseline 5, patched 9" in result.first.describe()


def test_lengths_keys_and_types_are_compared() -> None:
    assert compare_outputs([1, 2, 3], [1, 2]).first.path == "[2]"
    missing = compare_outputs({"a": 1, "b": 2}, {"a": 1})
    assert missing.first.path == "b" and "one side only" in missing.first.reason
    assert not compare_outputs({"x": 1}, {"x": True}).equal  # bool is not an int here
    assert not compare_outputs({"x": 1}, {"x": "1"}).equal


def test_integers_are_exact_even_with_tolerances() -> None:
    assert not compare_outputs([100], [101], rtol=0.5, atol=10).equal


def test_float_tolerances() -> None:
    assert not compare_outputs([1.0], [1.0 + 1e-6]).equal
    assert compare_outputs([1.0], [1.0 + 1e-6], atol=1e-5).equal
    assert compare_outputs([1000.0], [1000.001], rtol=1e-5).equal
    assert not compare_outputs([1000.0], [1000.1], rtol=1e-5).equal
    assert compare_outputs([math.nan], [math.nan]).equal
    assert not compare_outputs([math.nan], [0.0], atol=1e9).equal
    result = compare_outputs([1.0, 2.0], [1.5, 2.0], atol=1.0)
    assert result.equal and result.max_abs_diff == pytest.approx(0.5)


def test_torch_and_numpy_tensors_are_tagged() -> None:
    encoded = encode_outputs({"t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
                              "n": numpy.ones((2,), dtype=numpy.int64), "s": numpy.float32(0.5)})
    assert encoded["t"][TENSOR_TAG] == {"dtype": "bfloat16", "shape": [2, 3], "data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}
    assert encoded["n"][TENSOR_TAG] == {"dtype": "int64", "shape": [2], "data": [1, 1]}
    assert encoded["s"] == 0.5


def test_tensor_difference_reports_element_index_and_tolerance() -> None:
    baseline = encode_outputs({"logits": torch.zeros(2, 3)})
    patched = encode_outputs({"logits": torch.tensor([[0.0, 0.0, 0.0], [0.0, 1e-4, 0.0]])})
    result = compare_outputs(baseline, patched)
    assert result.first.path == "logits[1, 1]" and result.differing == 1 and result.compared == 6
    assert compare_outputs(baseline, patched, atol=1e-3).equal


def test_tensor_dtype_or_shape_mismatch_is_a_difference() -> None:
    left = encode_outputs(torch.zeros(2, 3))
    assert compare_outputs(left, encode_outputs(torch.zeros(3, 2))).first.path == "shape"
    assert compare_outputs(left, encode_outputs(torch.zeros(2, 3, dtype=torch.float64))).first.path == "dtype"


def test_unsupported_output_type_is_refused() -> None:
    with pytest.raises(TypeError, match="not JSON-able"):
        encode_outputs({"x": object()})
