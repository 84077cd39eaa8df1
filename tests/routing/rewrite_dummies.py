"""Seam functions for the rewrite tests: one valid body and variants that each differ from it in one place.

Every layer's ``forward(indices, flags)`` gathers rows of ``self.kv_cache[1]``, clears the rows without an
initial state, computes ``final = 0.5 * initial + 1`` in float32 and scatters it back; it returns the gathered
(cleared) states' float32 copy so a wrong clear shows in the output. ``BODY_RUNS`` counts entries into a body
(a refused call must not have run any of it).
"""

from __future__ import annotations

import functools

import torch

BODY_RUNS = {"count": 0}


def passthrough(function):
    """A decorator that returns the function itself (vLLM's ``eager_break_during_capture`` when disabled)."""
    return function


def wrapping(function):
    """A decorator that returns another function (closure-free, ``functools.wraps``): the twin would drop it."""
    def wrapper(*args, _function=function, **kwargs):
        return _function(*args, **kwargs)
    return functools.update_wrapper(wrapper, function)


class Layer:
    def __init__(self) -> None:
        self.prefix = "model.layers.0.attn"
        self.kv_cache: tuple = ()


class Valid(Layer):
    def forward(self, indices, flags):
        BODY_RUNS["count"] += 1
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class ClearWithOne(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 1
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class ClearNotNext(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        flags = flags.logical_not()  # the clear below reads other flags than the gather's statement saw
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class ClearReadsGathered(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~(initial.flatten(1)[:, 0] > 0), ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class CastToOther(Layer):
    """Stores ``final.to(torch.bfloat16)``: torch's index_put refuses it unless the cache is BF16."""

    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(torch.bfloat16)
        return initial.float()


class CastToOtherTensorsDtype(Layer):
    """Stores ``final.to(other.dtype)`` where ``other`` is not the cache (the conv state: BF16)."""

    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        other = self.kv_cache[0]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(other.dtype)
        return initial.float()


class CastToDevice(Layer):
    """Stores ``final.to(ssm_state.device)``: a float32 source, whatever the cache's dtype."""

    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.device)
        return initial.float()


class CastOfAnExpression(Layer):
    """Casts a computed copy (vllm-ascend's transposed-copy form): left as written."""

    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = (final * 1).to(ssm_state.dtype)
        return initial.float()


class ReadsARow(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1 + ssm_state[0].float()
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class SlicedGather(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[: indices.shape[0]]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class NoScatter(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state.index_copy_(0, indices.long(), final.to(ssm_state.dtype))
        return initial.float()


class InPlaceOperator(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        ssm_state += 0
        return initial.float()


class TransposedOtherAxes(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices].transpose(0, 1).contiguous()
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.transpose(0, 1).to(ssm_state.dtype)
        return initial.float()


class TransposedLastTwo(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices].transpose(-1, -2).contiguous()
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.transpose(-1, -2).contiguous().to(ssm_state.dtype)
        return initial.float()


class UsesSuper(Valid):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        super().__init__()
        return initial.float()


class PassthroughDecorated(Layer):
    @passthrough
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class WrapperDecorated(Layer):
    @wrapping
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class NameMangled(Layer):
    __scale = 0.5

    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * self.__scale + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class TakesRouteName(Layer):
    def forward(self, indices, flags, _kda_route=None):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class RebindsTheCache(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        if indices.shape[0] > 2:
            ssm_state = self.kv_cache[1][:]  # a view: another tensor object over the same rows
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class CallsItselfFirst(Layer):
    """Runs its own seam once, nested, before its copy (a nested seam call runs as written, uncounted)."""

    def forward(self, indices, flags, nested=False):
        if not nested:
            self.forward(indices[:1], flags[:1], nested=True)
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class PrefillBranch(Layer):
    """Copies only when asked to (``flags is not None``): a call without the copy runs nothing of it."""

    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        if flags is None:
            return ssm_state.flatten(1).sum(-1)
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


class Raises(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices]
        initial[~flags, ...] = 0
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        raise ValueError("the chunk kernel failed")


def clear_rows(packed, flags):
    """A module-level clear (vllm-ascend's ``clear_ssm_states`` form): zero the rows whose flag is 0/False."""
    CLEAR_ROWS["count"] += 1
    packed[torch.as_tensor(flags) == 0] = 0


CLEAR_ROWS = {"count": 0}


class FunctionClear(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = ssm_state[indices].contiguous()
        clear_rows(initial, flags)
        final = initial.float() * 0.5 + 1
        ssm_state[indices] = final.to(ssm_state.dtype)
        return initial.float()


KERNEL_RUNS = {"gather": 0, "scatter": 0}


def gather_rows(state, indices, flags, *, output_dtype=None, layout=None):
    """The fork's gather kernel (vllm-ascend 0.30 ``gather_ssm_states``): flag-false rows zero, optional dtype."""
    KERNEL_RUNS["gather"] += 1
    packed = torch.Tensor.__getitem__(state, indices).clone()
    packed[~flags] = 0
    return packed if output_dtype is None else packed.to(output_dtype)


def scatter_rows(state, indices, values):
    """The fork's scatter kernel (``scatter_ssm_states_``): stores ``values`` cast to the cache dtype."""
    KERNEL_RUNS["scatter"] += 1
    torch.Tensor.__setitem__(state, indices, values.to(state.dtype))


class KernelCopies(Layer):
    """vllm-ascend 0.30's three prefill branches: the fork's kernels (cast by the store, or before it, or a
    gather into another dtype), and the CPU branch that indexes the cache and clears with a function."""

    def forward(self, indices, flags, branch="store_cast", gather_dtype=None):
        ssm_state = self.kv_cache[1]
        if branch == "store_cast":
            initial = gather_rows(ssm_state, indices, flags)
            final = initial.float() * 0.5 + 1
            scatter_rows(ssm_state, indices, final)
        elif branch == "gather_dtype":
            initial = gather_rows(ssm_state, indices, flags, output_dtype=gather_dtype)
            final = initial.float() * 0.5 + 1
            scatter_rows(ssm_state, indices, final.to(ssm_state.dtype).contiguous())
        else:
            initial = ssm_state[indices].transpose(-1, -2).contiguous()
            clear_rows(initial, flags)
            final = initial.float() * 0.5 + 1
            ssm_state[indices] = final.transpose(-1, -2).contiguous().to(ssm_state.dtype)
        return initial.float()


class KernelCopiesOtherKeyword(Layer):
    def forward(self, indices, flags):
        ssm_state = self.kv_cache[1]
        initial = gather_rows(ssm_state, indices, flags, layout="other")
        scatter_rows(ssm_state, indices, initial.float() * 0.5 + 1)
        return initial.float()
