"""Encode workload outputs as JSON and compare two of them, reporting the first difference.

Workloads return JSON-able values (dicts, lists, numbers, strings) that may contain tensors
(``torch.Tensor`` or ``numpy.ndarray``). :func:`encode_outputs` turns tensors into tagged records
``{"__tensor__": {"dtype", "shape", "data"}}`` (data flattened, bf16/fp16 widened to Python floats)
without importing torch or numpy itself. :func:`compare_outputs` walks two encoded values:
integers, booleans, strings, ``None``, shapes and dtypes compare exactly (token ids are exact);
floats compare with ``|a - b| <= atol + rtol * |b|`` (``b`` the baseline; NaN equals NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

TENSOR_TAG = "__tensor__"


@dataclass
class Difference:
    """One differing leaf: its path (``requests[4].token_ids[7]``), both values and why."""

    path: str
    baseline: Any
    patched: Any
    reason: str

    def describe(self) -> str:
        """Return a one-line human description."""
        return f"{self.path}: baseline {self.baseline!r}, patched {self.patched!r} ({self.reason})"


@dataclass
class Comparison:
    """Result of :func:`compare_outputs`.

    Attributes:
        compared: leaves compared (tensor elements count one each).
        differing: leaves that differ.
        first: the first difference in traversal order (dict keys sorted), or None.
        max_abs_diff: largest absolute difference seen between floats (0.0 when none).
        kinds: leaves compared per kind (``int``, ``float``, ``str``, ``bool``, ``None``, ``other``).
    """

    compared: int = 0
    differing: int = 0
    first: Difference | None = None
    max_abs_diff: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        """True when no leaf differs."""
        return self.differing == 0


def encode_tensor(value: Any) -> dict[str, Any]:
    """Return the tagged JSON record of a torch tensor or numpy array (data flattened)."""
    if hasattr(value, "detach"):  # torch.Tensor
        dtype = str(value.dtype).replace("torch.", "")
        flat = value.detach().cpu().reshape(-1)
        if value.is_floating_point() and flat.element_size() < 4:
            flat = flat.float()
        data = flat.tolist()
    else:  # numpy.ndarray
        dtype = str(value.dtype)
        data = value.reshape(-1).tolist()
    return {TENSOR_TAG: {"dtype": dtype, "shape": list(value.shape), "data": data}}


def _is_tensor(value: Any) -> bool:
    kind = type(value)
    module = kind.__module__.split(".")[0]
    return (module == "torch" and hasattr(value, "detach")) or (module == "numpy" and hasattr(value, "shape")
                                                                 and hasattr(value, "dtype"))


def encode_outputs(value: Any) -> Any:
    """Return ``value`` with tensors tagged and tuples turned into lists (JSON-able).

    Args:
        value: a workload's return value.
    Returns:
        A JSON-serialisable copy.
    Raises:
        TypeError: for a value that is neither JSON-able nor a tensor (names its type).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(key): encode_outputs(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_outputs(item) for item in value]
    if _is_tensor(value):
        if getattr(value, "shape", None) == () and not hasattr(value, "detach"):  # numpy scalar
            return value.item()
        return encode_tensor(value)
    raise TypeError(f"workload output of type {type(value).__module__}.{type(value).__qualname__} is not "
                    "JSON-able; return dicts, lists, numbers, strings, torch tensors or numpy arrays")


def _floats_close(baseline: float, patched: float, rtol: float, atol: float) -> bool:
    if math.isnan(baseline) or math.isnan(patched):
        return math.isnan(baseline) and math.isnan(patched)
    if baseline == patched:
        return True
    return abs(patched - baseline) <= atol + rtol * abs(baseline)


class _Walker:
    def __init__(self, rtol: float, atol: float) -> None:
        self.rtol = rtol
        self.atol = atol
        self.result = Comparison()

    def differ(self, path: str, baseline: Any, patched: Any, reason: str, count: int = 1) -> None:
        self.result.differing += count
        if self.result.first is None:
            self.result.first = Difference(path or "<root>", baseline, patched, reason)

    def leaf(self, path: str, baseline: Any, patched: Any) -> None:
        self.result.compared += 1
        kind = "None" if baseline is None else type(baseline).__name__
        kind = kind if kind in ("int", "float", "str", "bool", "None") else "other"
        self.result.kinds[kind] = self.result.kinds.get(kind, 0) + 1
        if isinstance(baseline, float) or isinstance(patched, float):
            numeric = (int, float)
            if (isinstance(baseline, numeric) and isinstance(patched, numeric)
                    and not isinstance(baseline, bool) and not isinstance(patched, bool)):
                if not (math.isnan(baseline) or math.isnan(patched)):
                    self.result.max_abs_diff = max(self.result.max_abs_diff, abs(patched - baseline))
                if not _floats_close(float(baseline), float(patched), self.rtol, self.atol):
                    self.differ(path, baseline, patched, f"not within rtol={self.rtol} atol={self.atol}")
                return
        if type(baseline) is not type(patched) or baseline != patched:
            self.differ(path, baseline, patched, "not equal")

    def tensor(self, path: str, baseline: dict[str, Any], patched: dict[str, Any]) -> None:
        for key in ("dtype", "shape"):
            if baseline[key] != patched[key]:
                self.result.compared += 1
                self.differ(f"{path}.{key}" if path else key, baseline[key], patched[key], "tensor metadata differs")
                return
        shape = baseline["shape"]
        for index, (left, right) in enumerate(zip(baseline["data"], patched["data"], strict=False)):
            self.leaf(f"{path}{_unravel(index, shape)}", left, right)

    def walk(self, path: str, baseline: Any, patched: Any) -> None:
        if isinstance(baseline, dict) and isinstance(patched, dict):
            if TENSOR_TAG in baseline and TENSOR_TAG in patched:
                self.tensor(path, baseline[TENSOR_TAG], patched[TENSOR_TAG])
                return
            for key in sorted(set(baseline) | set(patched)):
                child = f"{path}.{key}" if path else str(key)
                if key not in patched or key not in baseline:
                    self.result.compared += 1
                    self.differ(child, baseline.get(key, "<missing>"), patched.get(key, "<missing>"),
                                "key present on one side only")
                else:
                    self.walk(child, baseline[key], patched[key])
        elif isinstance(baseline, list) and isinstance(patched, list):
            for index, (left, right) in enumerate(zip(baseline, patched, strict=False)):
                self.walk(f"{path}[{index}]", left, right)
            if len(baseline) != len(patched):
                self.result.compared += 1
                self.differ(f"{path}[{min(len(baseline), len(patched))}]", f"len {len(baseline)}",
                            f"len {len(patched)}", "lengths differ")
        else:
            self.leaf(path, baseline, patched)


def _unravel(index: int, shape: list[int]) -> str:
    """Return ``[i, j, ...]`` of a flat index in a row-major ``shape``."""
    if not shape:
        return "[]"
    coords = []
    for size in reversed(shape):
        coords.append(index % size if size else 0)
        index = index // size if size else 0
    return "[" + ", ".join(str(c) for c in reversed(coords)) + "]"


def compare_outputs(baseline: Any, patched: Any, rtol: float = 0.0, atol: float = 0.0) -> Comparison:
    """Compare two encoded outputs (see the module docstring for the rules).

    Args:
        baseline: encoded outputs of the unpatched run (or the stored baseline).
        patched: encoded outputs of the patched run.
        rtol: relative tolerance for floats (tensor elements and plain floats).
        atol: absolute tolerance for floats.
    Returns:
        A :class:`Comparison` with counts and the first difference.
    """
    walker = _Walker(rtol, atol)
    walker.walk("", baseline, patched)
    return walker.result
