"""Triton kernels that copy recurrent-state rows between a cache and a packed tensor.

Two kernels, each serving both directions through the ``SCATTER`` constexpr:

- :func:`copy_rows_kernel` (the fused plan): typed elements, one program per
  ``(payload tile, selected row)``; gather reads cache row ``indices[s]`` into packed row ``s``,
  scatter reads packed row ``s`` in the final-state dtype and writes cache row ``indices[s]`` in the
  cache dtype (the cast folded in: :func:`~kda_patches.state_copy.casts.cast_bits`).
- :func:`copy_row_bytes_kernel` (the fallback plan): the same semantics on raw bytes (any dtype),
  over a flat 1-D grid in which one row is split into ``TILES`` byte tiles, so that one row is
  copied by many programs (a one-program-per-row loop is several times slower).
- :func:`scatter_cast_items_kernel` (the fallback plan's scatter when the final-state dtype differs
  from the cache dtype): the byte kernel's flat grid and masks, on typed items, with the folded cast.

The three share :func:`selected_row_mask` (which rows are valid, and a safe row for the masked-off ones)
and the two fallback kernels :func:`flat_tile` (their flat grid).

Shared contract (checked on the host by :mod:`kda_patches.state_copy.layout` before launch):

- A cache row ``r`` is ``PAYLOAD`` contiguous items starting at ``cache_ptr + r * ROW_STRIDE``,
  with ``ROW_STRIDE >= PAYLOAD``; the page gap between rows is never read or written. The storage
  offset is already folded into ``cache_ptr`` (``tensor.data_ptr()``).
- Every address product is formed in int64 (program ids and index values are promoted first), so
  INT32 index vectors and pages more than 4 GiB apart are addressed correctly.
- A row index is valid when ``0 <= index < num_rows`` (and, for gather, its flag is true), where
  ``num_rows`` is the cache's ``shape[0]`` at the call. Gather writes zeros for invalid rows and
  writes every packed row; scatter skips invalid rows. Valid scatter destinations must be unique
  (caller precondition, never checked here).
- ``num_rows`` is the one runtime scalar (:data:`ROWS_ARGUMENT`, right after ``flag_ptr``): listed in
  ``do_not_specialize``, so Triton neither folds its value nor specializes it on 1 or on divisibility
  by 16. A host int below ``2**31`` is typed ``i32`` (:data:`ROWS_TYPE`; no cache of recurrent states
  comes near that many rows, and a compiled launch cannot pass more), so every row count compiles
  to the same code and a cache rebound to another ``shape[0]`` (vLLM 0.34's extensible KV cache) keeps
  the compiled variants. Every other layout number (row stride, payload, block, tiles) is a constexpr of
  the cache layout; the selected count is the grid, never an argument.

Scatter loads: a scatter reads its packed row whole, whatever the row's index says (the packed tensor is
``[S, PAYLOAD]``, so every packed item is in bounds), and masks only the cache store by validity. Masking the load
by the index too would make it wait for the index load: two dependent memory round trips instead of two
overlapping ones, which is most of a one-row scatter's device time (H200, ``scripts/gpu/launch_shape_probe.py``).

Pinned scatter loads: the kernel issues that unmasked load, but the compiler may still sink it. When a thread
holds one vector of the row (a same-dtype scatter at 8 warps), SM90's ptxas turns the index-guarded store into an
early exit and moves the packed load below it, so the load waits for the index again
(``scripts/gpu/sass_order.py``; ``tests/state_copy/test_state_copy_sass.py`` cross-compiles every SM90 variant and
reads the order). A volatile load must be issued on every path, so ``PIN_LOAD`` keeps it ahead of the exit.

Scalar row checks (the fused kernel): a program's row index, its validity and its safe row are scalars, and the
store or load mask is one comparison of the int32 tile offsets with a scalar limit (the payload for a valid row,
0 for an invalid one), so the per-item work is what upstream's unchecked kernels do plus one 32-bit comparison;
the index is never broadcast to an int64 vector with a select and a multiply per item (graph replay against
upstream 0.34's kernels: the one-row FP32 scatter went from behind them to at parity; ``docs/results/launch-shape/``).
The fallback kernels, which have no upstream counterpart to match, keep the vector form of
:func:`selected_row_mask`.

Masks are built from vectors only (a ``vector & scalar`` mask fails under ``TRITON_INTERPRET=1``).
What compiles for Ascend is measured, not assumed: every variant the plans prepare is compiled for
A2/A3 and A5 with triton-ascend and bishengir in the test suite (``make ascend-check``), and the result
is ``patches/ASCEND_COMPILE.md``; the block each variant gets there is capped by the chip's unified
buffer (:class:`~kda_patches.state_copy.device.TargetFacts`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda_patches.state_copy.casts import cast_bits

ROWS_ARGUMENT = "num_rows"  # the kernels' one runtime scalar, right after the four pointers
ROWS_INDEX = 4  # its position in every kernel's parameter list (a compiled launch passes arguments in order)
ROWS_TYPE = "i32"  # what Triton types a host row count below 2**31 as (never specialized on its value)


@triton.jit
def selected_row_mask(index_ptr, flag_ptr, row, num_rows, BLOCK: tl.constexpr, SKIP_FLAGS: tl.constexpr):
    """Return ``(valid, safe_row)`` of selected row ``row``, each broadcast to ``[BLOCK]``.

    Args:
        index_ptr: ``*int32`` or ``*int64``, the selected rows' cache indices.
        flag_ptr: ``*int1``, the selected rows' flags; read only when ``SKIP_FLAGS`` is false.
        row: the selected row (int64 scalar).
        num_rows: the cache's row count ``N`` at this call (int32 scalar, promoted to int64 here).
        BLOCK: the tile length.
        SKIP_FLAGS: true for scatters (flags never suppress a write).
    Returns:
        ``valid``: int1, ``0 <= index < num_rows`` (and the flag set, unless skipped); ``safe_row``: int64,
        the index where valid, else 0 (an in-bounds row, so masked-off addresses stay inside the cache).
    """
    cache_row = tl.full([BLOCK], 0, tl.int64) + tl.load(index_ptr + row).to(tl.int64)
    valid = (cache_row >= 0) & (cache_row < num_rows.to(tl.int64))
    if not SKIP_FLAGS:
        flag = tl.full([BLOCK], 0, tl.int32) + tl.load(flag_ptr + row).to(tl.int32)
        valid = valid & (flag != 0)
    return valid, tl.where(valid, cache_row, 0)


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """With ``PDL``: wait until the previous kernel on the stream has finished and its writes are visible, then let
    the next one start (``griddepcontrol``, NVIDIA SM90+; the ``launch_pdl`` compile option launches the kernel
    early). The same instructions as Triton's ``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents``, written here
    because triton-ascend has no ``tl.extra.cuda`` and compiles this kernel too (``PDL`` False there: no code)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def flat_tile(TILES: tl.constexpr, BLOCK: tl.constexpr):
    """Return ``(row, offsets)`` of this program in a flat ``(S * TILES,)`` grid: byte or item tile
    ``program % TILES`` of selected row ``program // TILES`` (int64 scalar, ``[BLOCK]`` int64 offsets)."""
    program = tl.program_id(0).to(tl.int64)
    return program // TILES, (program % TILES) * BLOCK + tl.arange(0, BLOCK)


@triton.jit(do_not_specialize=[ROWS_ARGUMENT])
def copy_rows_kernel(
    cache_ptr,
    packed_ptr,
    index_ptr,
    flag_ptr,
    num_rows,
    ROW_STRIDE: tl.constexpr,
    PAYLOAD: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,
    SCATTER: tl.constexpr,
    STREAM: tl.constexpr,
    SRC: tl.constexpr,
    DST: tl.constexpr,
    NAN_RULE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    PDL: tl.constexpr,
    PIN_LOAD: tl.constexpr,
):
    """Copy one ``BLOCK``-element tile of one selected row (fused plan).

    Grid: ``(cdiv(PAYLOAD, BLOCK), S)``; program ``(t, s)`` copies elements
    ``[t * BLOCK, (t + 1) * BLOCK)`` of selected row ``s``.

    Args:
        cache_ptr: ``*T`` (T = float32 or bfloat16), the cache ``[num_rows, H, V, K]``: inner
            ``[H, V, K]`` dense (``PAYLOAD`` items), row stride ``ROW_STRIDE`` items; alignment is
            whatever the cache signature recorded (the plan compiles for that class).
        packed_ptr: ``*T`` for gather (the output) or ``*F`` for scatter (the input in the final-state
            dtype F: float32, bfloat16 or float16), contiguous ``[S, PAYLOAD]``, 16-byte aligned.
        index_ptr: ``*int32`` or ``*int64``, contiguous ``[S]``, 16-byte aligned; any values
            (negative or ``>= num_rows`` mean invalid).
        flag_ptr: ``*int1`` (torch.bool), contiguous ``[>= S]``, 16-byte aligned; read by gather
            only (false clears the packed row); scatter never reads it.
        num_rows: the cache's row count ``N`` (its ``shape[0]`` at this call), an ``i32`` runtime scalar.
        ROW_STRIDE: ``cache.stride(0)`` in items (``>= PAYLOAD``).
        PAYLOAD: items per row (``H * V * K``).
        BLOCK: items per program (power of two).
        EVEN: ``PAYLOAD % BLOCK == 0`` (drops the tail mask).
        SCATTER: False gathers (cache -> packed), True scatters (packed -> cache).
        STREAM: mark the cache side ``evict_first`` (the reads of a gather, the writes of a scatter), so
            cache rows do not push the packed or final states out of the L2. The plan decides it per
            direction at prepare (:class:`~kda_patches.state_copy.plan.FusedStatePlan`), and only where
            the target's compiler keeps the hint (triton-ascend drops it).
        SRC, DST: scatter only: kind codes (0 FP32, 1 BF16, 2 FP16) of F and T; equal codes copy bits.
        NAN_RULE, NAN_BITS: scatter only: the NaN rule probed at prepare (:mod:`~kda_patches.state_copy.casts`),
            or ``NAN_RULE == CAST_HARDWARE`` (3): the compiler's own conversion, where the target declares it and the
            plan proved it equal to torch.
        PDL: compiled with ``launch_pdl`` (programmatic dependent launch, :func:`pdl_prologue`): only where the
            target honours it (:data:`~kda_patches.state_copy.device.PDL`) and the plan asked for it.
        PIN_LOAD: scatter only: read the packed row with a volatile load, which the compiler must issue on every
            path, where the target declares it (:attr:`~kda_patches.state_copy.device.TargetFacts.pinned_scatter_load`;
            see "Pinned scatter loads").
    """
    row = tl.program_id(1).to(tl.int64)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # int32 within a row (see "Scalar row checks")
    pdl_prologue(PDL)  # after the address arithmetic (no memory), before the first load
    index = tl.load(index_ptr + row).to(tl.int64)
    valid = (index >= 0) & (index < num_rows.to(tl.int64))
    if not SCATTER:
        valid = valid & (tl.load(flag_ptr + row).to(tl.int32) != 0)
    copy_mask = offsets < tl.where(valid, PAYLOAD, 0)  # all of a valid row's payload, nothing of an invalid one
    cache_items = cache_ptr + tl.where(valid, index, 0) * ROW_STRIDE + offsets
    packed_items = packed_ptr + row * PAYLOAD + offsets
    in_payload = offsets < PAYLOAD
    if SCATTER:
        # the packed row is always in bounds: its load must not wait for the index (see "Scatter loads")
        if EVEN:
            values = tl.load(packed_items, volatile=PIN_LOAD)
        else:
            values = tl.load(packed_items, mask=in_payload, volatile=PIN_LOAD)
        if SRC != DST:
            values = cast_bits(values, SRC, DST, NAN_RULE, NAN_BITS).to(cache_ptr.dtype.element_ty, bitcast=True)
        if STREAM:
            tl.store(cache_items, values, mask=copy_mask, eviction_policy="evict_first")
        else:
            tl.store(cache_items, values, mask=copy_mask)
    else:
        if STREAM:
            values = tl.load(cache_items, mask=copy_mask, other=0, eviction_policy="evict_first")
        else:
            values = tl.load(cache_items, mask=copy_mask, other=0)
        if EVEN:
            tl.store(packed_items, values)
        else:
            tl.store(packed_items, values, mask=in_payload)


@triton.jit(do_not_specialize=[ROWS_ARGUMENT])
def copy_row_bytes_kernel(
    cache_ptr,
    packed_ptr,
    index_ptr,
    flag_ptr,
    num_rows,
    ROW_STRIDE: tl.constexpr,
    PAYLOAD: tl.constexpr,
    TILES: tl.constexpr,
    BLOCK: tl.constexpr,
    SCATTER: tl.constexpr,
):
    """Copy one ``BLOCK``-byte tile of one selected row as raw bytes (fallback plan).

    Grid: ``(S * TILES,)``; program ``p`` copies byte tile ``p % TILES`` of selected row
    ``p // TILES``. A scatter whose final states are not in the cache dtype runs
    :func:`scatter_cast_items_kernel` instead (bytes cannot be cast).

    Args:
        cache_ptr: ``*uint8``, the cache bytes: row ``r`` (``0 <= r < num_rows``) is ``PAYLOAD`` contiguous
            bytes at ``cache_ptr + r * ROW_STRIDE``; alignment is whatever the cache signature recorded.
        packed_ptr: ``*uint8``, contiguous ``[S, PAYLOAD]`` bytes, 16-byte aligned (gather output or
            scatter input already in the cache dtype).
        index_ptr: ``*int32`` or ``*int64``, contiguous ``[S]``, 16-byte aligned.
        flag_ptr: ``*int1`` (torch.bool), contiguous ``[>= S]``, 16-byte aligned; gather only.
        num_rows: the cache's row count ``N`` (its ``shape[0]`` at this call), an ``i32`` runtime scalar.
        ROW_STRIDE: ``cache.stride(0) * element_size`` in bytes (``>= PAYLOAD``).
        PAYLOAD: bytes per row.
        TILES: ``cdiv(PAYLOAD, BLOCK)``.
        BLOCK: bytes per program (power of two).
        SCATTER: False gathers (cache -> packed), True scatters (packed -> cache).
    """
    row, offsets = flat_tile(TILES, BLOCK)
    in_payload = offsets < PAYLOAD
    valid, safe_row = selected_row_mask(index_ptr, flag_ptr, row, num_rows, BLOCK, SCATTER)
    copy_mask = valid & in_payload
    cache_bytes = cache_ptr + safe_row * ROW_STRIDE + offsets
    packed_bytes = packed_ptr + row * PAYLOAD + offsets
    if SCATTER:
        values = tl.load(packed_bytes, mask=in_payload)  # independent of the index (see "Scatter loads")
        tl.store(cache_bytes, values, mask=copy_mask)
    else:
        values = tl.load(cache_bytes, mask=copy_mask, other=0)
        tl.store(packed_bytes, values, mask=in_payload)


@triton.jit(do_not_specialize=[ROWS_ARGUMENT])
def scatter_cast_items_kernel(
    cache_ptr,
    packed_ptr,
    index_ptr,
    flag_ptr,
    num_rows,
    ROW_STRIDE: tl.constexpr,
    PAYLOAD: tl.constexpr,
    TILES: tl.constexpr,
    BLOCK: tl.constexpr,
    SRC: tl.constexpr,
    DST: tl.constexpr,
    NAN_RULE: tl.constexpr,
    NAN_BITS: tl.constexpr,
):
    """Scatter one ``BLOCK``-item tile of one selected row, casting F -> T (fallback plan, typed).

    Grid: ``(S * TILES,)``, as :func:`copy_row_bytes_kernel`; invalid indices are skipped.

    Args:
        cache_ptr: ``*T`` (float32, bfloat16 or float16): row ``r`` (``0 <= r < num_rows``) is ``PAYLOAD``
            contiguous items at ``cache_ptr + r * ROW_STRIDE``; alignment is whatever the cache signature recorded.
        packed_ptr: ``*F`` (float32, bfloat16 or float16, not T), contiguous ``[S, PAYLOAD]``, 16-byte aligned.
        index_ptr: ``*int32`` or ``*int64``, contiguous ``[S]``, 16-byte aligned.
        flag_ptr: ``*int1``, never read (kept so every variant has the same launch signature).
        num_rows: the cache's row count ``N`` (its ``shape[0]`` at this call), an ``i32`` runtime scalar.
        ROW_STRIDE: ``cache.stride(0)`` in items (``>= PAYLOAD``).
        PAYLOAD: items per row.
        TILES: ``cdiv(PAYLOAD, BLOCK)``.
        BLOCK: items per program (power of two).
        SRC, DST, NAN_RULE, NAN_BITS: the folded cast (:func:`~kda_patches.state_copy.casts.cast_bits`).
    """
    row, offsets = flat_tile(TILES, BLOCK)
    in_payload = offsets < PAYLOAD
    valid, safe_row = selected_row_mask(index_ptr, flag_ptr, row, num_rows, BLOCK, True)
    copy_mask = valid & in_payload
    values = tl.load(packed_ptr + row * PAYLOAD + offsets, mask=in_payload)  # independent of the index
    values = cast_bits(values, SRC, DST, NAN_RULE, NAN_BITS).to(cache_ptr.dtype.element_ty, bitcast=True)
    tl.store(cache_ptr + safe_row * ROW_STRIDE + offsets, values, mask=copy_mask)
