"""The final-state cast folded into the scatter: exact FP32/BF16/FP16 conversions inside the kernels.

Upstream and the forks scatter ``last.to(cache_dtype)``. The scatter kernels read the final states in
their own dtype and write the cache dtype in one pass, with the conversion done on the bit patterns
(:func:`cast_bits`), because neither the Triton interpreter (its FP32->BF16 cast truncates or rounds
half up, and can turn a NaN into an infinity) nor every backend converts exactly like torch does:

- finite values and infinities: round to nearest even, subnormals kept (IEEE), as torch does on every
  device (widening casts are exact);
- NaN: torch's result differs by device and even by code path (CUDA ``cvt`` returns one canonical
  NaN, the CPU's vector path ``0xFFFF`` for BF16 but a quieted, sign-keeping NaN for FP16). So the
  NaN rule of each ``(final dtype, cache dtype)`` pair is decided at prepare by
  :func:`probe_nan_policy`, which casts a fixed set of NaN patterns with torch on the cache's device
  (a vector and single elements, to cover vector and scalar code paths) and picks the one rule of
  :data:`NAN_RULES` that reproduces every result; when none does (torch itself disagrees between its
  code paths, e.g. FP16->FP32 on the CPU), that final dtype is refused at prepare.

Where a target declares the compiler's own conversion of a pair exact
(:attr:`~kda_patches.state_copy.device.TargetFacts.hardware_casts`; the candidate is FP32 -> BF16 on SM90+, one
``cvt.rn``, declared once measured), the
scatter converts with it instead (:data:`CAST_HARDWARE`: a few instructions per item fewer, which is what a one-row
scatter's latency is made of). The plan proves it at prepare on every pattern of :func:`hardware_probe_bits` against
torch on the device and, where they differ, keeps the bit-pattern cast and says why (:class:`CastPolicy`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kda_patches.state_copy.errors import LayoutError, refuse

FINAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KIND_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernels' SRC/DST constexprs
NAN_CANONICAL, NAN_QUIET, NAN_PRESERVE = 0, 1, 2
NAN_RULES = {NAN_CANONICAL: "canonical", NAN_QUIET: "quiet", NAN_PRESERVE: "preserve"}
# the kernels' NAN_RULE value for the compiler's own round-to-nearest-even conversion (not a NaN rule of the
# bit-pattern cast: never in NAN_RULES, so the Ascend check, which compiles every rule, never compiles it)
CAST_HARDWARE = 3
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# (width, mantissa bits) of each format
_FORMAT = {torch.float32: (32, 23), torch.bfloat16: (16, 7), torch.float16: (16, 10)}
# NaN patterns of each source dtype probed at prepare: both signs, quiet and signalling, low and high payloads
PROBE_NANS = {
    torch.float32: (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FC00123, 0x7FFFFFFF, 0x7F812345,
                    0xFFA00000, 0x7FBFFFFF, 0xFFFFE000),
    torch.bfloat16: (0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FC1, 0x7FFF, 0xFFFF, 0x7FA5),
    torch.float16: (0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7E01, 0x7FFF, 0xFFFF, 0x7D55),
}


@triton.jit
def decode_f32_bits(x, SRC: tl.constexpr):
    """Return ``(bits, nan)``: ``x`` (FP32/BF16/FP16 by ``SRC`` 0/1/2) as FP32 bit patterns (int32),
    exact, NaN payloads moved to the top of the FP32 mantissa unquieted, and its NaN mask.

    Signed 32-bit throughout: every comparison is on a value already masked to 31 bits (the sign
    is tested apart), so signed and unsigned order agree; triton-ascend rejects unsigned 32-bit
    vector comparisons on A2/A3 (``patches/ASCEND_COMPILE.md``).
    """
    if SRC == 0:
        bits = x.to(tl.int32, bitcast=True)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
    elif SRC == 1:
        half = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits = half << 16  # BF16 is the top half of FP32: exact for every value
        nan = (half & 0x7FFF) > 0x7F80
    else:
        half = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        nan = (half & 0x7FFF) > 0x7C00
        widened = x.to(tl.float32).to(tl.int32, bitcast=True)  # exact for every non-NaN FP16
        nan_bits = ((half & 0x8000) << 16) | 0x7F800000 | ((half & 0x3FF) << 13)
        bits = tl.where(nan, nan_bits, widened)
    return bits, nan


@triton.jit
def encode_f32_bits(bits, nan, DST: tl.constexpr, NAN_RULE: tl.constexpr, NAN_BITS: tl.constexpr):
    """Round FP32 bit patterns (int32) to ``DST`` (0/1/2) to nearest even; NaN by the probed rule.

    Returns int32 for FP32, int16 for BF16/FP16 (bit patterns; the caller bitcasts them). The
    16-bit results are formed in int32 and truncated, so an arithmetic shift's sign fill never
    reaches them. One return statement: the compiler types every return of a function, taken
    branch or not. ``NAN_BITS`` is the canonical pattern as a signed value of the target width.
    """
    magnitude = bits & 0x7FFFFFFF
    sign16 = (bits >> 16) & 0x8000  # the sign bit in 16-bit position
    if DST == 0:
        if NAN_RULE == 0:
            nan_out = tl.full(bits.shape, NAN_BITS, tl.int32)
        elif NAN_RULE == 1:
            nan_out = bits | 0x00400000
        else:
            nan_out = bits
        out = tl.where(nan, nan_out, bits)
    elif DST == 1:
        # carries into the exponent, inf on overflow; only NaN lanes (replaced below) can wrap
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        payload = (magnitude & 0x7FFFFF) >> 16
        if NAN_RULE == 0:
            nan_out = tl.full(bits.shape, NAN_BITS, tl.int32)
        elif NAN_RULE == 1:
            nan_out = sign16 | 0x7FC0 | payload
        else:
            nan_out = sign16 | 0x7F80 | payload
        out = tl.where(nan, nan_out, rounded).to(tl.int16)
    else:
        # FP16: overflow to inf, normal rebias + round, subnormal by one exact FP32 add of 0.5
        normal = (magnitude - 0x38000000 + 0xFFF + ((magnitude >> 13) & 1)) >> 13
        small = magnitude < 0x38800000
        tiny = tl.where(small, magnitude, 0).to(tl.float32, bitcast=True)  # only subnormal-range values are added
        shifted = (tiny + 0.5).to(tl.int32, bitcast=True) - 0x3F000000
        finite = tl.where(magnitude >= 0x47800000, 0x7C00, tl.where(small, shifted, normal))
        payload = (magnitude & 0x7FFFFF) >> 13
        if NAN_RULE == 0:
            nan_out = tl.full(bits.shape, NAN_BITS, tl.int32)
        elif NAN_RULE == 1:
            nan_out = sign16 | 0x7E00 | payload
        else:
            nan_out = sign16 | 0x7C00 | payload
        out = tl.where(nan, nan_out, finite | sign16).to(tl.int16)
    return out


@triton.jit
def hardware_cast_bits(x, DST: tl.constexpr):
    """Return ``x`` converted by the compiler to ``DST`` (0/1/2), round to nearest even, as bit patterns."""
    if DST == 0:
        out = x.to(tl.float32).to(tl.int32, bitcast=True)
    elif DST == 1:
        out = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
    else:
        out = x.to(tl.float16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
    return out


@triton.jit
def cast_bits(x, SRC: tl.constexpr, DST: tl.constexpr, NAN_RULE: tl.constexpr, NAN_BITS: tl.constexpr):
    """Return ``x.to(DST)`` as ``DST`` bit patterns (int32 or int16), exactly as torch casts: by the bit patterns,
    or with ``NAN_RULE == CAST_HARDWARE`` by the compiler's conversion (only where the plan proved it equal)."""
    if NAN_RULE == 3:  # CAST_HARDWARE
        out = hardware_cast_bits(x, DST)
    else:
        bits, nan = decode_f32_bits(x, SRC)
        out = encode_f32_bits(bits, nan, DST, NAN_RULE, NAN_BITS)
    return out


# FP32 items per slice of :func:`cast_bits_sliced` (whole rows: a 128 x 64 state tile casts 16 rows at a time)
SLICE_ITEMS = tl.constexpr(1024)


def slices_tensors() -> bool:
    """Whether the installed Triton slices a tensor inside a kernel (triton-ascend's ``tl.extract_slice`` and
    ``tl.insert_slice``; mainline Triton and its interpreter have neither), i.e. whether :func:`cast_bits_sliced`
    compiles here."""
    return hasattr(tl, "extract_slice") and hasattr(tl, "insert_slice")


@triton.jit
def cast_bits_sliced(x, SRC: tl.constexpr, DST: tl.constexpr, NAN_RULE: tl.constexpr, NAN_BITS: tl.constexpr):
    """:func:`cast_bits` of a 2-D FP32 tile to a 16-bit ``DST``, :data:`SLICE_ITEMS` items (whole rows) at a time.

    The same bits as :func:`cast_bits` of the whole tile (each slice is cast by it), but only one slice's bit
    temporaries are live: the tile's own buffer, viewed as int32, receives each slice's 16-bit result in place
    (sign-extended), and is truncated to int16 once at the end. Ascend A2/A3's unified buffer holds a 128 x 64 FP32
    state's cast this way beside the kernel's other state half, and not as one whole-tile cast
    (``docs/results/ascend-compile``). Needs triton-ascend's tensor slicing (:func:`slices_tensors`). Any other
    case (a source other than FP32, an FP32 destination, :data:`CAST_HARDWARE`, a tile that is not 2-D or whose rows
    do not split into whole slices) is :func:`cast_bits` of the whole tile.
    """
    ROWS: tl.constexpr = x.shape[0] if len(x.shape) == 2 else 0
    COLS: tl.constexpr = x.shape[1] if len(x.shape) == 2 else 1
    STEP: tl.constexpr = SLICE_ITEMS // COLS if SLICE_ITEMS >= COLS else 1
    # two operands per boolean operator: Triton's code generator refuses a chain (A or B or C); NAN_RULE 3 is
    # CAST_HARDWARE
    if (SRC != 0 or DST == 0) or (NAN_RULE == 3 or (ROWS <= STEP or ROWS % STEP != 0)):
        out = cast_bits(x, SRC, DST, NAN_RULE, NAN_BITS)
    else:
        tile = x.to(tl.int32, bitcast=True)
        for index in tl.static_range(ROWS // STEP):
            part = tl.extract_slice(tile, [index * STEP, 0], [STEP, COLS], [1, 1]).to(tl.float32, bitcast=True)
            done = cast_bits(part, SRC, DST, NAN_RULE, NAN_BITS).to(tl.int32)
            tile = tl.insert_slice(tile, done, [index * STEP, 0], [STEP, COLS], [1, 1])
        out = tile.to(tl.int16)
    return out


def normalize_final_dtypes(final_dtypes: Any, cache_dtype: torch.dtype, layer: str | None = None
                           ) -> tuple[torch.dtype, ...]:
    """Return the final-state dtypes a plan prepares: deduplicated, in order; default ``(cache, float32)``.

    Raises:
        LayoutError: not a non-empty tuple/list of FP32/BF16/FP16 dtypes.
    """
    if final_dtypes is None:
        final_dtypes = (cache_dtype, torch.float32) if cache_dtype in KIND_CODES else (cache_dtype,)
    if isinstance(final_dtypes, torch.dtype) or not isinstance(final_dtypes, (tuple, list)) or not final_dtypes:
        refuse("final_dtype", f"final_dtypes must be a non-empty tuple of torch dtypes, got {final_dtypes!r}",
               layer, LayoutError)
    for dtype in final_dtypes:
        if dtype not in KIND_CODES and dtype != cache_dtype:
            refuse("final_dtype", f"final-state dtype {dtype!r} has no folded cast into the {cache_dtype} cache "
                   "(supported: torch.float32, torch.bfloat16, torch.float16)", layer, LayoutError)
    return tuple(dict.fromkeys(final_dtypes))


class CastPolicy:
    """How one ``(final dtype, cache dtype)`` pair is cast inside a scatter kernel.

    Attributes:
        source, target: the final and the cache dtype.
        nan_rule: ``NAN_CANONICAL``, ``NAN_QUIET`` or ``NAN_PRESERVE`` (ignored when ``identity``), or
            ``CAST_HARDWARE`` (the compiler's conversion; ``software`` then holds the probed bit-pattern rule).
        nan_bits: the canonical NaN pattern (``NAN_CANONICAL`` only; 0 otherwise).
        identity: same dtype: the kernel copies the bits (any dtype).
        software: with ``CAST_HARDWARE``: the bit-pattern policy the plan keeps if the compiler's conversion
            differs from torch on the device; None otherwise.
        hardware_refused: why a declared hardware cast was not used (the pattern where it differed), or None.
    """

    __slots__ = ("hardware_refused", "identity", "nan_bits", "nan_rule", "software", "source", "target")

    def __init__(self, source: torch.dtype, target: torch.dtype, nan_rule: int = NAN_PRESERVE,
                 nan_bits: int = 0, software: CastPolicy | None = None) -> None:
        self.source = source
        self.target = target
        self.identity = source == target
        self.nan_rule = nan_rule
        self.nan_bits = nan_bits
        self.software = software
        self.hardware_refused: str | None = None

    @property
    def hardware(self) -> bool:
        """Whether the scatter converts with the compiler's own conversion (:data:`CAST_HARDWARE`)."""
        return self.nan_rule == CAST_HARDWARE

    def with_hardware(self) -> CastPolicy:
        """Return a :data:`CAST_HARDWARE` policy for this pair that falls back to this one (a cast, not identity)."""
        return CastPolicy(self.source, self.target, CAST_HARDWARE, 0, software=self)

    def refuse_hardware(self, reason: str) -> CastPolicy:
        """Return the bit-pattern policy of a hardware one, recording ``reason`` on it (shown in :meth:`as_dict`)."""
        fallback = self.software or self
        fallback.hardware_refused = reason
        return fallback

    def constexprs(self) -> tuple[int, int, int, int]:
        """Return the kernel constexprs ``(SRC, DST, NAN_RULE, NAN_BITS)``; ``NAN_BITS`` signed (the kernels
        compute in int32: an FP32 pattern with the sign bit set is negative there)."""
        nan_bits = _signed(self.nan_bits, 32) if self.target == torch.float32 else self.nan_bits
        return KIND_CODES[self.source], KIND_CODES[self.target], self.nan_rule, nan_bits

    def as_dict(self) -> dict[str, Any]:
        """Return the policy as a JSON-serialisable dict (for the ledger)."""
        rule = "bit copy" if self.identity else (
            "hardware" if self.hardware else NAN_RULES[self.nan_rule])
        facts = {"final": dtype_name(self.source), "cache": dtype_name(self.target), "nan": rule,
                 "nan_bits": hex(self.nan_bits) if self.nan_rule == NAN_CANONICAL and not self.identity else None}
        if self.hardware:
            facts["conversion"] = "the compiler's round-to-nearest-even, equal to torch on every probed pattern"
        if self.hardware_refused:
            facts["hardware_refused"] = self.hardware_refused
        return facts


def dtype_name(dtype: torch.dtype) -> str:
    """Return ``"float32"`` for ``torch.float32`` (and so on)."""
    return str(dtype).removeprefix("torch.")


def expected_nan(pattern: int, source: torch.dtype, target: torch.dtype, rule: int, canonical: int) -> int:
    """Return the target bit pattern (unsigned) a NaN ``pattern`` of ``source`` gets under ``rule``."""
    width, mantissa = _FORMAT[source]
    target_width, target_mantissa = _FORMAT[target]
    if rule == NAN_CANONICAL:
        return canonical
    sign = (pattern >> (width - 1)) & 1
    payload = pattern & ((1 << mantissa) - 1)
    payload = payload << (target_mantissa - mantissa) if target_mantissa >= mantissa else \
        payload >> (mantissa - target_mantissa)
    if rule == NAN_QUIET:
        payload |= 1 << (target_mantissa - 1)
    exponent = ((1 << (target_width - 1 - target_mantissa)) - 1) << target_mantissa
    return (sign << (target_width - 1)) | exponent | payload


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` (FP32/BF16/FP16) viewed as its integer bit patterns (NaNs compare as bits)."""
    return tensor.view(_BITS[tensor.dtype])


def _signed(value: int, width: int) -> int:
    return value - (1 << width) if value >= 1 << (width - 1) else value


def _torch_cast_bits(patterns: list[int], source: torch.dtype, target: torch.dtype, device: torch.device
                     ) -> list[int]:
    width = _FORMAT[source][0]
    tensor = torch.tensor([_signed(p, width) for p in patterns], dtype=_BITS[source]).to(device).view(source)
    mask = (1 << _FORMAT[target][0]) - 1
    return [value & mask for value in tensor.to(target).view(_BITS[target]).cpu().tolist()]


def probe_nan_policy(source: torch.dtype, target: torch.dtype, device: torch.device,
                     layer: str | None = None) -> CastPolicy:
    """Decide how NaNs of ``source`` become ``target`` by asking torch on ``device``.

    Args:
        source: the final-state dtype (FP32/BF16/FP16).
        target: the cache dtype (FP32/BF16/FP16).
        device: the cache's device (torch's cast is run there).
        layer: layer name for error messages.
    Returns:
        The :class:`CastPolicy` (identity for equal dtypes).
    Raises:
        LayoutError: an unsupported dtype, or no rule reproduces torch's NaN results on this device.
    """
    if source == target:
        return CastPolicy(source, target)
    for dtype, role in ((source, "final-state"), (target, "cache")):
        if dtype not in KIND_CODES:
            refuse("final_dtype", f"{role} dtype {dtype} has no folded cast (FP32, BF16 and FP16 only)", layer,
                   LayoutError)
    patterns = list(PROBE_NANS[source])
    vector = (patterns * (67 // len(patterns) + 1))[:67]  # long enough for vector loops and their tails
    observed = _torch_cast_bits(vector, source, target, device)
    observed += [_torch_cast_bits([pattern], source, target, device)[0] for pattern in patterns]
    probes = vector + patterns
    for rule in (NAN_PRESERVE, NAN_QUIET, NAN_CANONICAL):
        canonical = observed[0] if rule == NAN_CANONICAL else 0
        if all(expected_nan(p, source, target, rule, canonical) == o for p, o in zip(probes, observed, strict=True)):
            return CastPolicy(source, target, rule, canonical)
    seen = sorted({hex(value) for value in observed})
    refuse("nan_policy", f"torch's own {dtype_name(source)} -> {dtype_name(target)} cast on {device} gives NaN "
           f"results {seen} that no single rule reproduces (its code paths disagree), so the folded cast could not "
           f"be bit-exact; leave {source} out of final_dtypes on this device", layer, LayoutError)



# FP32 patterns beyond the NaNs whose conversion is easiest to get wrong: signed zeros and infinities, the largest
# finite values (one rounds to infinity), ties to even downwards and upwards and just past them, subnormals
# (a converter that flushes them to zero fails here) and the smallest normal
FP32_EDGE_BITS = (0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000,
                  0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF, 0xBF808000, 0xBF818000, 0x00000001, 0x80000001,
                  0x00008000, 0x00018000, 0x00007FFF, 0x007FFFFF, 0x807FFFFF, 0x00800000, 0x33800000, 0x3F800000)


def hardware_probe_bits(source: torch.dtype, random_count: int = 4096, seed: int = 0) -> torch.Tensor:
    """Return the bit patterns of ``source`` (int32 or int16, CPU) a hardware cast is proven on: every NaN of
    :data:`PROBE_NANS`, every FP32 edge of :data:`FP32_EDGE_BITS` (FP32 sources), then ``random_count`` seeded
    random patterns (any sign, exponent and mantissa)."""
    width = _FORMAT[source][0]
    fixed = [_signed(p, width) for p in (*PROBE_NANS[source], *(FP32_EDGE_BITS if source == torch.float32 else ()))]
    generator = torch.Generator().manual_seed(seed)
    random = torch.randint(-(1 << (width - 1)), 1 << (width - 1), (random_count,), generator=generator,
                           dtype=torch.int64)
    return torch.cat([torch.tensor(fixed, dtype=torch.int64), random]).to(_BITS[source])
