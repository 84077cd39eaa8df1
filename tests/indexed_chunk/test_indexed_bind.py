"""The host binder of the indexed route: the same binding as :mod:`inspect`, and the same errors as a call."""

from __future__ import annotations

import inspect

import pytest

from kda_patches.indexed_chunk.launch import bind_host_call


def host(k, w, u, g=None, initial_state=None, output_final_state=False, chunk_size=64):
    """A release-shaped host (positional-or-keyword parameters only)."""


def with_keyword_only(k, *, chunk_size=64):
    """Another kind of signature: bound by inspect."""


def inspect_binding(function, args, kwargs):
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@pytest.mark.parametrize(("args", "kwargs"), [
    ((1, 2, 3), {}), ((1,), {"w": 2, "u": 3, "chunk_size": 32}), ((), {"k": 1, "w": 2, "u": 3, "g": 4}),
    ((1, 2, 3, 4, 5, True, 16), {})])
def test_the_binding_is_inspects(args, kwargs) -> None:
    assert bind_host_call(host, args, kwargs).arguments == inspect_binding(host, args, kwargs)


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((1, 2, 3, 4, 5, 6, 7, 8), {}, "positional arguments"),
    ((1, 2, 3), {"h0": 1}, "unexpected keyword argument 'h0'"),
    ((1, 2, 3), {"w": 2}, "multiple values for argument 'w'"),
    ((1,), {"w": 2}, "missing required arguments: u")])
def test_a_call_the_host_would_refuse_is_refused_the_same_way(args, kwargs, message) -> None:
    with pytest.raises(TypeError):
        host(*args, **kwargs)
    with pytest.raises(TypeError, match=message):
        bind_host_call(host, args, kwargs)


def test_another_kind_of_signature_is_bound_by_inspect() -> None:
    assert bind_host_call(with_keyword_only, (1,), {}).arguments == {"k": 1, "chunk_size": 64}
    with pytest.raises(TypeError):
        bind_host_call(with_keyword_only, (1, 2), {})
