"""Aliasing checker: prove that a KV-cache layout keeps every block id's bytes to itself.

vLLM's hybrid allocator overlays cache groups on one raw storage: block ``b`` of a GDN layer and block
``b`` of a full-attention layer may occupy the same page, which is sound because the block pool gives a
block id to one group at a time. A layout is therefore safe when, across all views of one storage,

1. bytes addressed under two *different* block ids never overlap (any two block ids can be live at once);
2. bytes addressed under the *same* block id overlap only between layers of *different* groups (two
   layers or two states of one group hold that block together);
3. every addressed byte lies inside the storage.

Each (layer, state) view is described by a :class:`Footprint`: an affine family where block ``b``
addresses ``[base + b*stride + start, base + b*stride + start + length)`` for each of a few runs. The
proof never enumerates bytes. Pairs of runs whose spans are disjoint are skipped; pairs with equal block
strides are decided in O(1) each (vectorized over all pairs); pairs with different strides are decided
exactly in O(num_blocks) vectorized numpy work. Pure numpy: no torch, no vLLM.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

MAX_PAIR_WORK = 400_000_000  # block positions examined for unequal-stride pairs before giving up (unproven)
MAX_RUNS = 4096  # runs per storage; past it the pair table would not fit comfortably (unproven)


class Footprint:
    """Bytes that one (layer, state) view addresses for every block id.

    Attributes:
        layer: layer name (for reasons and witnesses).
        state: which state or part of the layer (``kv``, ``state0``, ``conv``...).
        group: KV-cache group id of the layer (block ids are owned per group).
        base: byte offset of block 0's origin inside the storage.
        stride: bytes between consecutive block ids (>= 0).
        num_blocks: how many block ids the view addresses (ids ``0..num_blocks-1``).
        runs: ``((start, length), ...)`` byte runs of one block relative to its origin, sorted, disjoint.
    """

    __slots__ = ("base", "group", "layer", "num_blocks", "runs", "state", "stride")

    def __init__(self, layer: str, state: str, group: int, base: int, stride: int, num_blocks: int,
                 runs: tuple[tuple[int, int], ...]) -> None:
        if stride < 0 or num_blocks < 0:
            raise ValueError(f"{layer}/{state}: negative stride or block count ({stride}, {num_blocks})")
        self.layer = layer
        self.state = state
        self.group = int(group)
        self.base = int(base)
        self.stride = int(stride)
        self.num_blocks = int(num_blocks)
        self.runs = tuple((int(start), int(length)) for start, length in runs if length > 0)

    def __repr__(self) -> str:
        return (f"Footprint({self.layer!r}, {self.state!r}, group={self.group}, base={self.base}, "
                f"stride={self.stride}, num_blocks={self.num_blocks}, runs={self.runs})")

    def block_bytes(self, block: int) -> list[tuple[int, int]]:
        """Return the absolute ``[start, end)`` byte ranges of ``block`` (for tests and witnesses)."""
        origin = self.base + block * self.stride
        return [(origin + start, origin + start + length) for start, length in self.runs]


class Verdict:
    """Outcome of a proof.

    Attributes:
        safe: True only when the layout is proven free of cross-block aliasing.
        status: ``accepted``, ``rejected`` (a witness overlap exists) or ``unproven`` (too costly/unknown).
        reason: one human-readable sentence.
        witness: for ``rejected``: the two (layer, state, block) that overlap and the first shared byte.
        seconds: time the proof took.
    """

    __slots__ = ("reason", "safe", "seconds", "status", "witness")

    def __init__(self, status: str, reason: str, witness: dict | None = None, seconds: float = 0.0) -> None:
        self.status = status
        self.safe = status == "accepted"
        self.reason = reason
        self.witness = witness
        self.seconds = seconds

    def __repr__(self) -> str:
        return f"Verdict({self.status!r}, {self.reason!r})"

    def as_fact(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict for the ledger."""
        fact: dict[str, Any] = {"verdict": self.status, "reason": self.reason,
                                "checker_ms": round(self.seconds * 1e3, 3)}
        if self.witness is not None:
            fact["witness"] = self.witness
        return fact


def _flatten(footprints: list[Footprint]) -> dict[str, np.ndarray]:
    """One row per (footprint, run): absolute start at block 0, length, stride, block count, group, owner."""
    rows = [(fp.base + start, length, fp.stride, fp.num_blocks, fp.group, index)
            for index, fp in enumerate(footprints) if fp.num_blocks > 0 for start, length in fp.runs]
    table = np.array(rows, dtype=np.int64).reshape(-1, 6)
    names = ("start", "length", "stride", "blocks", "group", "owner")
    return {name: table[:, column] for column, name in enumerate(names)}


def _witness(footprints: list[Footprint], fam: dict[str, np.ndarray], i: int, j: int, block_i: int,
             block_j: int) -> dict[str, Any]:
    start_i = int(fam["start"][i] + block_i * fam["stride"][i])
    start_j = int(fam["start"][j] + block_j * fam["stride"][j])
    return name_witness(footprints, {"owners": (int(fam["owner"][i]), int(fam["owner"][j])),
                                     "blocks": (int(block_i), int(block_j)), "byte": max(start_i, start_j)})


def name_witness(footprints: list[Footprint], witness: dict[str, Any]) -> dict[str, Any]:
    """Fill a witness's ``a``/``b`` entries (layer, state, group, block) from ``footprints``."""
    named = dict(witness)
    for key, owner, block in zip("ab", witness["owners"], witness["blocks"], strict=True):
        fp = footprints[owner]
        named[key] = {"layer": fp.layer, "state": fp.state, "group": fp.group, "block": block}
    return named


def _describe(witness: dict[str, Any]) -> str:
    a, b = witness["a"], witness["b"]
    kind = "block ids" if a["block"] != b["block"] else "layers of one group for block id"
    return (f"{kind} overlap: {a['layer']}[{a['state']}] block {a['block']} (group {a['group']}) and "
            f"{b['layer']}[{b['state']}] block {b['block']} (group {b['group']}) share byte {witness['byte']}")


def _equal_stride_conflicts(fam: dict[str, np.ndarray], pi: np.ndarray, pj: np.ndarray) -> tuple[int, int, int]:
    """Decide all equal-stride pairs at once; return ``(pair index, k, -)`` of the first conflict or -1.

    With ``c = b + k``, runs ``i`` (block ``b``) and ``j`` (block ``c``) overlap iff
    ``floor((a_i - a_j - l_j)/S) < k < ceil((a_i + l_i - a_j)/S)``, within the block ranges.
    """
    a_i, a_j = fam["start"][pi], fam["start"][pj]
    l_i, l_j = fam["length"][pi], fam["length"][pj]
    stride = fam["stride"][pi]
    safe_stride = np.where(stride == 0, 1, stride)
    k_lo = np.floor_divide(a_i - a_j - l_j, safe_stride) + 1
    k_hi = -np.floor_divide(-(a_i + l_i - a_j), safe_stride) - 1
    # stride 0: every block of a run sits at the same bytes; overlap is independent of k.
    overlap0 = (a_j < a_i + l_i) & (a_i < a_j + l_j)
    k_lo = np.where(stride == 0, np.where(overlap0, -(2 ** 62), 1), k_lo)
    k_hi = np.where(stride == 0, np.where(overlap0, 2 ** 62, 0), k_hi)
    lo = np.maximum(k_lo, -(fam["blocks"][pi] - 1))
    hi = np.minimum(k_hi, fam["blocks"][pj] - 1)
    has = lo <= hi
    nonzero = has & ~((lo == 0) & (hi == 0))
    same_block_clash = has & (lo <= 0) & (hi >= 0) & (fam["group"][pi] == fam["group"][pj]) & (pi != pj)
    conflict = nonzero | same_block_clash
    if not conflict.any():
        return -1, 0, 0
    index = int(np.flatnonzero(conflict)[0])
    if nonzero[index]:
        k = int(lo[index]) if lo[index] != 0 else int(hi[index])
    else:
        k = 0
    return index, k, 0


def _unequal_stride_conflict(fam: dict[str, np.ndarray], i: int, j: int, chunk: int = 1 << 20) -> tuple[int, int]:
    """Decide one pair with different strides exactly; return ``(block_i, block_j)`` of a conflict or (-1, -1)."""
    a_i, l_i, s_i, n_i = (int(fam[key][i]) for key in ("start", "length", "stride", "blocks"))
    a_j, l_j, s_j, n_j = (int(fam[key][j]) for key in ("start", "length", "stride", "blocks"))
    same_group = fam["group"][i] == fam["group"][j]
    for first in range(0, n_i, chunk):
        b = np.arange(first, min(n_i, first + chunk), dtype=np.int64)
        x = a_i + b * s_i
        if s_j == 0:
            hit = (a_j < x + l_i) & (x < a_j + l_j)
            c_lo = np.where(hit, 0, 1)
            c_hi = np.where(hit, n_j - 1, 0)
        else:
            c_lo = np.floor_divide(x - a_j - l_j, s_j) + 1
            c_hi = -np.floor_divide(-(x + l_i - a_j), s_j) - 1
        c_lo = np.maximum(c_lo, 0)
        c_hi = np.minimum(c_hi, n_j - 1)
        has = c_lo <= c_hi
        allowed = (c_lo == c_hi) & (c_lo == b) & (not same_group)
        conflict = has & ~allowed
        if conflict.any():
            k = int(np.flatnonzero(conflict)[0])
            if c_lo[k] != b[k] or c_lo[k] == c_hi[k]:
                return int(b[k]), int(c_lo[k])  # another block id, or the same id inside one group
            return int(b[k]), int(c_lo[k]) + 1
    return -1, -1


def check_footprints(footprints: list[Footprint], storage_nbytes: int | None = None,
                     max_pair_work: int = MAX_PAIR_WORK) -> Verdict:
    """Prove or refute that ``footprints`` (all views of one raw storage) never alias across block ids.

    Args:
        footprints: every (layer, state) view that addresses the storage, in the layout under test.
        storage_nbytes: size of the storage in bytes; None skips the bounds check.
        max_pair_work: budget of block positions for unequal-stride pairs; past it the verdict is unproven.
    Returns:
        A :class:`Verdict`: ``accepted`` only with a complete proof; ``rejected`` carries a witness.
    """
    began = time.perf_counter()

    def done(status: str, reason: str, witness: dict | None = None) -> Verdict:
        return Verdict(status, reason, witness, time.perf_counter() - began)

    fam = _flatten(footprints)
    count = len(fam["start"])
    if count == 0:
        return done("accepted", "no bytes addressed")
    if count > MAX_RUNS:
        return done("unproven", f"{count} byte runs on one storage, over the limit of {MAX_RUNS}")
    lo = fam["start"]
    hi = fam["start"] + (fam["blocks"] - 1) * fam["stride"] + fam["length"]
    if storage_nbytes is not None and (lo.min() < 0 or hi.max() > storage_nbytes):
        index = int(np.flatnonzero((lo < 0) | (hi > storage_nbytes))[0])
        owner = footprints[int(fam["owner"][index])]
        return done("rejected", f"{owner.layer}[{owner.state}] addresses bytes [{int(lo[index])}, {int(hi[index])}) "
                                f"outside the storage of {storage_nbytes} bytes")
    # Candidate pairs (i <= j) whose byte spans intersect.
    pi, pj = np.triu_indices(count)
    touching = (lo[pi] < hi[pj]) & (lo[pj] < hi[pi])
    pi, pj = pi[touching], pj[touching]
    equal = fam["stride"][pi] == fam["stride"][pj]
    eq_i, eq_j = pi[equal], pj[equal]
    index, k, _ = _equal_stride_conflicts(fam, eq_i, eq_j)
    if index >= 0:
        i, j = int(eq_i[index]), int(eq_j[index])
        block_i = max(0, -k)
        witness = _witness(footprints, fam, i, j, block_i, block_i + k)
        return done("rejected", _describe(witness), witness)
    un_i, un_j = pi[~equal], pj[~equal]
    # Iterate over the run with fewer blocks; bail out before spending more than the budget.
    work = int(np.minimum(fam["blocks"][un_i], fam["blocks"][un_j]).sum())
    if work > max_pair_work:
        return done("unproven", f"{len(un_i)} unequal-stride run pairs need {work} block positions, over the "
                                f"budget of {max_pair_work}")
    for i, j in zip(un_i.tolist(), un_j.tolist(), strict=True):
        if fam["blocks"][j] < fam["blocks"][i]:
            i, j = j, i
        block_i, block_j = _unequal_stride_conflict(fam, i, j)
        if block_i >= 0:
            witness = _witness(footprints, fam, i, j, block_i, block_j)
            return done("rejected", _describe(witness), witness)
    blocks = int(fam["blocks"].max())
    return done("accepted", f"proven: {len(footprints)} views, {count} runs, {len(eq_i)} equal-stride and "
                            f"{len(un_i)} unequal-stride overlapping run pairs, up to {blocks} blocks")


def footprint_signature(footprints: list[Footprint], storage_nbytes: int | None) -> tuple:
    """Return a hashable key under which two storages have the same verdict (layer names ignored).

    Groups are renumbered by first appearance: only equal/different matters to the proof.
    """
    renumber: dict[int, int] = {}
    key = []
    for fp in footprints:
        group = renumber.setdefault(fp.group, len(renumber))
        key.append((group, fp.base, fp.stride, fp.num_blocks, fp.runs))
    return (storage_nbytes, tuple(key))


class CheckerCache:
    """Memoizes verdicts of storages that share a signature (e.g. the 16 identical raw tensors of 0.13).

    A cached rejection is re-described with the names of the storage being checked.
    """

    def __init__(self) -> None:
        self._verdicts: dict[tuple, Verdict] = {}
        self.hits = 0
        self.seconds = 0.0

    def check(self, footprints: list[Footprint], storage_nbytes: int | None) -> Verdict:
        """Return the (possibly cached) verdict of ``footprints``."""
        key = footprint_signature(footprints, storage_nbytes)
        cached = self._verdicts.get(key)
        if cached is not None:
            self.hits += 1
            if cached.witness is None:
                return cached
            witness = name_witness(footprints, cached.witness)
            return Verdict(cached.status, _describe(witness), witness, 0.0)
        verdict = check_footprints(footprints, storage_nbytes)
        self.seconds += verdict.seconds
        self._verdicts[key] = verdict
        return verdict
