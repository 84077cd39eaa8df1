"""State-copy plans: compiled per cache layout at startup, sealed, then launched without the JIT.

Lifecycle (seed 000, DESIGN §4.1): :meth:`StateCopyPlan.prepare` checks the cache layout, snapshots
the compiler configuration, decides the folded cast of every final-state dtype the model can produce
(``final_dtypes``, :mod:`~kda_patches.state_copy.casts`) and compiles exactly ``2 + 2 * F`` variants
for ``F`` final dtypes: two gathers (INT32/INT64 indices), shared by every final dtype, and two scatters
(INT32/INT64) per final dtype. The issue's "four per final dtype" counts the gathers with each final
dtype; compiled once, they make 4 variants for one final dtype, 6 for the default BF16 cache (BF16 and
FP32 finals), 8 for three. All are compiled on disposable one-row scratch that keeps the cache's 16-byte
alignment class and never aliases the live cache; each runs once on that scratch and its result is
checked against torch (the scatters against torch's ``.to()`` cast, bit for bit). :meth:`~StateCopyPlan.seal`
checks that the configuration did not drift and that no JIT pre-run hook appeared. Only a sealed
plan launches, and only for a cache with the prepared signature (device, dtype, inner shape ``[H, V, K]``,
strides, ``data_ptr % 16``), at most ``max_selected`` rows, same-device INT32/INT64 indices, and final
states of a prepared final dtype (any other is refused before launch: final dtypes are decided at startup).

The cache's row count is not in the signature: each launch passes the cache's ``shape[0]`` at that call
as the kernels' runtime bound ``num_rows`` (never specialized), so an index is valid when
``0 <= index < state.shape[0]`` of the tensor passed, and a cache rebound to another row count over the
same pages (vLLM 0.34's ``extend_kv_cache``) is served by the same compiled variants:
:meth:`StateCopyPlan.check_cache` re-validates it without compiling.

:class:`FusedStatePlan` runs the typed tiled kernel; :class:`FallbackStatePlan` the masked byte-copy
kernel (any dtype). Worker-level initialization (dedup, all-or-nothing publishing) and per-layer
bindings live in :mod:`kda_patches.state_copy.worker` and are re-exported here.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

import torch
import triton

from kda_patches.state_copy import casts, kernels, layout
from kda_patches.state_copy.device import (
    EVICT_FIRST,
    PDL,
    PDL_WHERE_AVAILABLE,
    PLAN_FALLBACK,
    PLAN_FUSED,
    BulkScatter,
    TargetFacts,
    device_kind,
    interpreter_active,
    synchronize,
    target_facts,
)
from kda_patches.state_copy.errors import StateCopyRefused, refuse
from kda_patches.state_copy.kernels import ROWS_ARGUMENT, ROWS_INDEX, ROWS_TYPE
from kda_patches.state_copy.variants import (
    POINTER_TYPES,
    compile_variant,
    describe_drift,
    pre_run_hook_count,
    snapshot_configuration,
)

MAX_GRID_ROWS = 65535  # grid dimension 1 limit: the fused plan puts selected rows there
BULK = "bulk"  # the last element of a bulk scatter's variant key (TargetFacts.bulk_scatter)
NO_BULK_ROWS = MAX_GRID_ROWS + 1  # no call selects this many rows: a plan without bulk scatters never takes them



def _same_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Return whether two tensors hold the same bytes (NaN payloads and -0.0 included)."""
    return torch.equal(first.reshape(-1).view(torch.uint8), second.reshape(-1).view(torch.uint8))


class StateCopyPlan:
    """Compiled state-copy table for one cache signature (shared by every layer with that signature).

    Use :meth:`prepare`, then :meth:`seal`. The plan keeps no live tensors, streams or data pointers:
    only the layout numbers, the compiled variants and a read-only all-true flag vector. No row count is
    compiled or checked: each call bounds the indices by the ``shape[0]`` of the cache it is given (the
    last shape seen is kept only so that a call with the same shape skips the inner-shape comparison).

    Attributes:
        kind: ``"fused"`` or ``"fallback"``.
        layout: the :class:`~kda_patches.state_copy.layout.CacheLayout` it was prepared for.
        signature: the cache signature it launches for (:func:`~kda_patches.state_copy.layout.cache_signature`:
            no row count).
        max_selected: the most rows one call may select.
    """

    kind: ClassVar[str] = ""
    kernel: ClassVar[Any] = None

    def __init__(self, state: torch.Tensor, max_selected: int, block_bytes: int | None, num_warps: int | None,
                 layer: str | None, stream: bool = False,
                 final_dtypes: tuple[torch.dtype, ...] | None = None, target: TargetFacts | None = None,
                 pdl: bool | str = False) -> None:
        wanted = casts.normalize_final_dtypes(final_dtypes, state.dtype, layer)
        target = target or target_facts(state.device)
        policies = {dtype: casts.probe_nan_policy(dtype, state.dtype, state.device, layer) for dtype in wanted}
        policies = {dtype: policy.with_hardware() if self._hardware_declared(policy, target) else policy
                    for dtype, policy in policies.items()}
        self._set_up(state, max_selected, block_bytes, num_warps, layer, stream, policies, target, pdl)
        self.signature = layout.cache_signature(state)
        self._alignment = self.signature[-1]
        self._check_device = state.device.type == "cuda"
        self._device_index = state.device.index if state.device.index is not None else (
            torch.cuda.current_device() if self._check_device else None)
        self._configuration = snapshot_configuration()
        for kernel in self._kernels:
            if pre_run_hook_count(kernel):
                refuse("jit_hook", f"{kernel.__name__} carries JIT pre-run hooks before prepare; remove them "
                       "(they would never run on direct launches)", layer)
        self._interpreted = interpreter_active()
        self._true_flags = torch.ones(max(self.max_selected, 1), dtype=torch.bool, device=state.device)
        self._variants: dict[tuple[Any, ...], Any] = {}
        self._compile_on_scratch(layer)
        self._gathers = {dtype: self._variants[("gather", dtype)] for dtype in layout.INDEX_DTYPES}
        self._scatters = {final: {dtype: self._variants[("scatter", dtype, final)] for dtype in layout.INDEX_DTYPES}
                          for final in self.final_dtypes}
        # many-row scatters of the cache dtype launch their own shape (TargetFacts.bulk_scatter), if prepared
        bulk_keys = {dtype: ("scatter", dtype, self._dtype, BULK) for dtype in layout.INDEX_DTYPES}
        self._bulk_scatters = {dtype: self._variants[key] for dtype, key in bulk_keys.items() if key in self._variants}
        self._bulk_min_rows = self._bulk.min_rows if self._bulk_scatters else NO_BULK_ROWS

    def _set_up(self, state: torch.Tensor, max_selected: int, block_bytes: int | None, num_warps: int | None,
                layer: str | None, stream: bool, policies: dict[torch.dtype, casts.CastPolicy],
                target: TargetFacts, pdl: bool | str = False) -> None:
        """Decide everything but the compiled code, from tensor metadata only (a ``meta`` tensor will do)."""
        self.layout = layout.describe_layout(state, layer)
        self.final_dtypes = tuple(policies)
        self._casts = dict(policies)
        if not 0 <= max_selected <= MAX_GRID_ROWS:
            refuse("max_selected", f"max_selected must be in [0, {MAX_GRID_ROWS}], got {max_selected}", layer)
        self.max_selected = int(max_selected)
        self.sealed = False
        self._device = state.device
        self._dtype = state.dtype
        self._shape = state.shape  # the last shape a call passed with (only to skip re-checking the inner shape)
        self._strides = tuple(state.stride())
        self._inner = self.layout.inner_shape
        self.target = target
        self._hints_dropped: list[str] = []
        if stream and not target.honours(EVICT_FIRST):
            self._hints_dropped.append(f"gather evict_first (stream=True): {target.name}'s compiler drops it")
        self._stream = bool(stream) and target.honours(EVICT_FIRST)
        if not (isinstance(pdl, bool) or pdl == PDL_WHERE_AVAILABLE):
            refuse("pdl", f"pdl must be True, False or {PDL_WHERE_AVAILABLE!r}, got {pdl!r}", layer)
        available = target.honours(PDL) and self._launch_option_pdl()
        if pdl is True and not available:
            self._hints_dropped.append(f"pdl: {target.name} has no programmatic dependent launch for this plan kind"
                                       if target.honours(PDL) else
                                       f"pdl: {target.name} has no programmatic dependent launch")
        self._pdl = available and pdl is not False
        self._scatter_evict_first = self._scatter_hint(target)
        self._bulk: BulkScatter | None = None  # a kind that has bulk scatters sets it in _configure
        self._num_warps = self._configure(block_bytes, num_warps, layer)
        self._kernels = tuple(dict.fromkeys(self._variant_kernel(key) for key in self._variant_keys()))

    @classmethod
    def variant_specs(cls, state: torch.Tensor, max_selected: int, target: TargetFacts,
                      policies: dict[torch.dtype, casts.CastPolicy], block_bytes: int | None = None,
                      num_warps: int | None = None, stream: bool = False,
                      pdl: bool | str = False) -> list[dict[str, Any]]:
        """Return the variants :meth:`prepare` would compile for ``state`` on ``target``, compiling nothing.

        For checking a compiler that cannot run here (``make ascend-check``): the block, constexprs and
        pointer types are decided by the same code as :meth:`prepare`.

        Args:
            state: a cache with the live layout; only its metadata is read (a ``meta`` tensor will do).
            max_selected: as for :meth:`prepare`.
            target: the compiler target (:mod:`~kda_patches.state_copy.device`).
            policies: final dtype -> its :class:`~kda_patches.state_copy.casts.CastPolicy` (on a device
                that cannot run torch here, every NaN rule is a separate policy to check).
            block_bytes, num_warps, stream, pdl: as for :meth:`prepare`.
        Returns:
            One dict per variant: ``name``, ``kernel`` (the JIT function), ``final`` (a scatter's final dtype,
            None for a gather), ``pointers`` (the four pointer dtypes: cache, packed, indices, flags), ``scalars``
            (the runtime scalar after them -> its Triton type: ``{"num_rows": "i32"}``), ``signature`` (every
            parameter -> its type as ``triton.compile`` takes it, in parameter order), ``constexprs`` (parameter
            name -> value), ``num_warps``, ``family`` (the :attr:`TargetFacts.block_limits` key) and
            ``launch_pdl``.
        """
        plan = cls.__new__(cls)
        plan._set_up(state, max_selected, block_bytes, num_warps, None, stream, policies, target, pdl)
        specs = []
        for key in plan._variant_keys():
            kernel = plan._variant_kernel(key)
            takes_bytes = kernel is kernels.copy_row_bytes_kernel
            source = plan._dtype if key[0] == "gather" else key[2]
            pointers = (*((torch.uint8, torch.uint8) if takes_bytes else (plan._dtype, source)), key[1], torch.bool)
            names = kernel.arg_names[ROWS_INDEX + 1:]  # after the four pointers and num_rows
            constexprs = dict(zip(names, plan._variant_constexprs(key), strict=True))
            signature = {name: POINTER_TYPES[dtype]
                         for name, dtype in zip(kernel.arg_names[:ROWS_INDEX], pointers, strict=True)}
            signature.update({ROWS_ARGUMENT: ROWS_TYPE}, **dict.fromkeys(constexprs, "constexpr"))
            specs.append({"name": plan._variant_name(key), "kernel": kernel,
                          "final": key[2] if key[0] == "scatter" else None, "pointers": pointers,
                          "scalars": {ROWS_ARGUMENT: ROWS_TYPE}, "signature": signature, "constexprs": constexprs,
                          "num_warps": plan._variant_warps(key), "family": plan._variant_family(key),
                          "launch_pdl": plan._pdl})
        return specs

    @classmethod
    def prepare(cls, state: torch.Tensor, max_selected: int, block_bytes: int | None = None,
                num_warps: int | None = None, layer: str | None = None, stream: bool = False,
                final_dtypes: tuple[torch.dtype, ...] | None = None,
                target: TargetFacts | None = None, pdl: bool | str = False) -> StateCopyPlan:
        """Compile and test-run the ``2 + 2 * len(final_dtypes)`` variants for ``state``'s layout on scratch.

        Args:
            state: the live cache ``[N, H, V, K]`` (only its metadata and alignment class are used).
            max_selected: the most rows one call may select (``max_num_seqs``).
            block_bytes: bytes per program (default: the kind's default).
            num_warps: warps per program (default: the kind's default).
            layer: layer name for error messages.
            stream: fused plan only: also mark the gather's cache reads ``evict_first`` (an experiment;
                off). The scatter's cache writes are marked wherever the target keeps the hint
                (``FusedStatePlan``); where it does not, the request is recorded as dropped.
            final_dtypes: the dtypes the scatter's final states may have (FP32, BF16, FP16); default
                ``(cache dtype, torch.float32)`` deduplicated.
            target: the compiler target (default: the device's, :func:`~kda_patches.state_copy.device.target_facts`);
                its unified-buffer limits cap the block.
            pdl: fused plan only: ``True`` compiles with programmatic dependent launch where the target honours
                it (:data:`~kda_patches.state_copy.device.PDL`, NVIDIA SM90+) and records the request as dropped
                elsewhere; ``"auto"`` (:data:`~kda_patches.state_copy.device.PDL_WHERE_AVAILABLE`, serving's
                default) compiles it where the target and plan kind have it and records nothing elsewhere;
                ``False`` launches plainly.
        Returns:
            An unsealed plan.
        Raises:
            StateCopyError: layout refused, a final dtype without an exact cast, a block over the
                target's unified-buffer limit, hooks present, or a variant failed on scratch.
        """
        return cls(state, max_selected, block_bytes, num_warps, layer, stream, final_dtypes, target, pdl)

    # -- preparation ------------------------------------------------------------------------
    @staticmethod
    def _hardware_declared(policy: casts.CastPolicy, target: TargetFacts) -> bool:
        """Return whether ``target`` declares the compiler's conversion for ``policy``'s pair (a cast, not a copy)."""
        pair = f"{casts.dtype_name(policy.source)}->{casts.dtype_name(policy.target)}"
        return not policy.identity and pair in target.hardware_casts

    def _scatter_hint(self, target: TargetFacts) -> bool:
        """Return whether the scatter's cache writes carry ``evict_first`` (only the fused kernel has the option)."""
        return False

    def _launch_option_pdl(self) -> bool:
        """Return whether this plan kind's kernels take programmatic dependent launch (only the fused kernel)."""
        return False

    def _configure(self, block_bytes: int | None, num_warps: int | None, layer: str | None) -> int:
        """Fix the tile configuration (the grid is the same for every variant); return the warps."""
        raise NotImplementedError

    def _variant_family(self, key: tuple[Any, ...]) -> str:
        """Return the :attr:`TargetFacts.block_limits` family of the variant ``key``."""
        raise NotImplementedError

    def _variant_name(self, key: tuple[Any, ...]) -> str:
        return f"{self.kind}/{key[0]}/{casts.dtype_name(key[1])}" + (
            f"/{casts.dtype_name(key[2])}" if key[0] == "scatter" else "") + ("/bulk" if key[3:] == (BULK,) else "")

    def _limit_block(self, block: int, item_bytes: int, families: list[tuple[str, int]], explicit: bool,
                     layer: str | None) -> int:
        """Return ``block`` (items of ``item_bytes``) capped by the target's unified-buffer limits.

        Args:
            block: the block the plan would take (a power of two).
            item_bytes: bytes per item of ``block``.
            families: ``(family, bytes per family item)`` of every variant the plan compiles.
            explicit: the caller asked for this block (then a block over a limit is refused, not capped).
            layer: layer name for error messages.
        Returns:
            The block; :attr:`block_limited_by` names the family that capped it (None when none did).
        """
        self.block_limited_by = None
        for family, family_item_bytes in dict.fromkeys(families):
            limit = self.target.block_limit(family)
            if limit is None:
                continue
            limit_items = max(limit * family_item_bytes // item_bytes, 1)
            if block > limit_items:
                if explicit:
                    refuse("block", f"a block of {block * item_bytes} bytes exceeds what {family} fits into "
                           f"{self.target.name}'s unified buffer ({limit_items * item_bytes} bytes, "
                           "patches/ASCEND_COMPILE.md); leave block_bytes unset or lower it", layer)
                block = triton.next_power_of_2(limit_items + 1) // 2  # the largest power of two within the limit
                self.block_limited_by = family
        return block

    def _variant_kernel(self, key: tuple[Any, ...]) -> Any:
        """Return the ``@triton.jit`` kernel of the variant ``key`` (``(op, index dtype[, final dtype])``)."""
        raise NotImplementedError

    def _variant_constexprs(self, key: tuple[Any, ...]) -> tuple[Any, ...]:
        """Return the kernel constexprs of the variant ``key``, in parameter order (after ``num_rows``)."""
        raise NotImplementedError

    def _variant_warps(self, key: tuple[Any, ...]) -> int:
        """Return the warps the variant ``key`` compiles with: the plan's, unless a kind decides per variant."""
        return self._num_warps

    def _grid(self, count: int, source: torch.dtype | None = None) -> tuple[int, int]:
        """Return the launch grid of ``count`` selected rows for variants reading ``source`` items (the final
        dtype of a scatter; None: the cache dtype, a gather's)."""
        raise NotImplementedError

    def _variant_keys(self) -> list[tuple[Any, ...]]:
        """Return every variant key: gathers per index dtype, scatters per (index dtype, final dtype), and the
        bulk scatters of the cache dtype (``(..., BULK)``) where the plan has a bulk shape."""
        keys: list[tuple[Any, ...]] = []
        for index_dtype in layout.INDEX_DTYPES:
            keys.append(("gather", index_dtype))
            keys.extend(("scatter", index_dtype, final) for final in self.final_dtypes)
            if self._bulk is not None and self._dtype in self.final_dtypes:
                keys.append(("scatter", index_dtype, self._dtype, BULK))
        return keys

    def _build_scratch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return a one-row scratch cache (same alignment class, own storage) and a scratch packed row."""
        nbytes = self.layout.payload * self.layout.element_size
        raw = torch.empty(nbytes + 2 * layout.ALIGNMENT, dtype=torch.uint8, device=self._device)
        shift = (self._alignment - raw.data_ptr()) % layout.ALIGNMENT
        cache = raw[shift:shift + nbytes].view(self._dtype).view(1, *self._inner)
        packed = torch.empty((1, *self._inner), dtype=self._dtype, device=self._device)
        return cache, packed

    def _compile_on_scratch(self, layer: str | None) -> None:
        cache, packed = self._build_scratch()
        pattern = torch.arange(self.layout.payload, device=self._device) % 251 - 125
        stored = pattern.to(self._dtype)
        # scatter sources with fractions, so the scratch run also checks the rounding of the folded cast
        finals = {dtype: (pattern * 0.3183099).to(dtype).view(1, *self._inner) for dtype in self.final_dtypes}
        for key in self._variant_keys():
            policy = self._casts[key[2]] if key[0] == "scatter" else None
            if policy is None or not policy.hardware:
                variant = self._compile_key(key, cache, packed, stored, finals, layer)
            else:
                try:
                    variant = self._compile_key(key, cache, packed, stored, finals, layer)
                    differs = self._hardware_cast_differs(variant, key, cache)
                except StateCopyRefused as exc:
                    differs = (f"the compiler's conversion failed its scratch check ({exc}): the bit-pattern cast "
                               "is kept")
                if differs:  # keep the bit-pattern cast for this final dtype and say why; the variants of the
                    # final dtype after this one (the other index dtype) compile with it too
                    self._casts[key[2]] = policy.refuse_hardware(differs)
                    variant = self._compile_key(key, cache, packed, stored, finals, layer)
            self._variants[key] = variant

    def _compile_key(self, key: tuple[Any, ...], cache: torch.Tensor, packed: torch.Tensor, stored: torch.Tensor,
                     finals: dict[torch.dtype, torch.Tensor], layer: str | None) -> Any:
        """Compile the variant ``key`` and check it on scratch (a one-row copy against torch); return it."""
        op, index_dtype = key[0], key[1]
        name = self._variant_name(key)
        indices = torch.zeros(1, dtype=index_dtype, device=self._device)
        source = packed if op == "gather" else finals[key[2]]
        cache.view(-1).copy_(stored)
        packed.fill_(0)
        if op == "scatter":
            cache.view(-1).fill_(0)
        try:
            variant = compile_variant(name, self._variant_kernel(key), (cache, source, indices, self._true_flags),
                                      self._variant_constexprs(key), self._variant_warps(key), self._interpreted,
                                      self._variant_kernel(key) is kernels.copy_row_bytes_kernel, self._pdl)
            variant.launch(self._grid(1, source.dtype), cache, source, indices, self._true_flags, cache.shape[0])
            synchronize(self._device)
        except Exception as exc:
            refuse("prepare", f"variant {name} failed to compile or run on scratch: {exc!r}", layer)
        expected = stored if op == "gather" else source.view(-1).to(self._dtype)
        written = packed if op == "gather" else cache
        untouched = cache if op == "gather" else stored  # a gather must not write the cache
        if not (_same_bytes(written, expected) and _same_bytes(untouched, stored)):
            refuse("prepare", f"variant {name} produced wrong bytes on scratch", layer)
        return variant

    def _hardware_cast_differs(self, variant: Any, key: tuple[Any, ...], cache: torch.Tensor) -> str | None:
        """Scatter every pattern of :func:`~kda_patches.state_copy.casts.hardware_probe_bits` through ``variant``
        (a :data:`~kda_patches.state_copy.casts.CAST_HARDWARE` scatter) into the scratch row, a payload at a time;
        return the first pattern whose cache bits differ from torch's own cast on the device, or None."""
        source = key[2]
        values = casts.hardware_probe_bits(source).to(self._device).view(source)
        expected = values.to(self._dtype)
        indices = torch.zeros(1, dtype=key[1], device=self._device)
        payload = self.layout.payload
        bits = casts.bit_view
        for start in range(0, values.shape[0], payload):
            chunk = values[start:start + payload]
            row = torch.zeros(payload, dtype=source, device=self._device)
            row[:chunk.shape[0]] = chunk
            cache.view(-1).fill_(0)
            variant.launch(self._grid(1, source), cache, row.view(1, *self._inner), indices, self._true_flags, 1)
            synchronize(self._device)
            written, wanted = bits(cache.view(-1)[:chunk.shape[0]]), bits(expected[start:start + chunk.shape[0]])
            wrong = (written != wanted).nonzero()
            if wrong.numel():
                at = int(wrong[0, 0])
                width = 8 * source.itemsize
                return (f"the compiler's {casts.dtype_name(source)} -> {casts.dtype_name(self._dtype)} conversion "
                        f"gives {int(written[at]) & 0xFFFFFFFF:#x} for {int(bits(chunk)[at]) & ((1 << width) - 1):#x} "
                        f"where torch gives {int(wanted[at]) & 0xFFFFFFFF:#x}: the bit-pattern cast is kept")
        return None

    def seal(self) -> StateCopyPlan:
        """Freeze the plan: refuse if the compiler configuration drifted or a JIT pre-run hook appeared.

        Returns:
            The plan itself (sealed).
        Raises:
            StateCopyRefused: with what changed and that the worker must restart.
        """
        drift = describe_drift(self._configuration, snapshot_configuration())
        if drift:
            refuse("config_drift", "compiler configuration changed between prepare and seal ("
                   + "; ".join(drift) + "); restart the worker so the plan is prepared again")
        for kernel in self._kernels:
            if pre_run_hook_count(kernel):
                refuse("jit_hook", f"a JIT pre-run hook appeared on {kernel.__name__} before seal; remove it")
        self.sealed = True
        return self

    def check_cache(self, state: torch.Tensor, layer: str | None = None) -> None:
        """Re-validate the plan for ``state`` (a cache rebound after prepare) without compiling anything.

        Accepts any row count ``shape[0]`` (the kernels take it per launch), and any row stride for a one-row
        cache (:func:`~kda_patches.state_copy.layout.serves_signature`); everything else the compiled variants
        depend on must be what they were prepared for.

        Args:
            state: the rebound cache ``[N, H, V, K]``.
            layer: layer name for error messages.
        Raises:
            StateCopyRefused: ``signature``, naming each fact that changed (a different pointer alignment,
                stride, inner shape, dtype or device needs a plan prepared for it: restart the worker).
        """
        found = layout.cache_signature(state) if isinstance(state, torch.Tensor) and state.dim() == 4 else None
        if found is None or not layout.serves_signature(self.signature, state):
            change = (layout.describe_signature_change(self.signature, found) if found is not None else
                      f"not a [N, H, V, K] tensor: {type(state).__name__} "
                      f"{tuple(state.shape) if isinstance(state, torch.Tensor) else ''}")
            refuse("signature", f"the rebound cache does not match the compiled plan ({change}); only the row count "
                   "may change after prepare: rebind the same pages with the same strides, or restart the worker "
                   "so the plans are prepared for the new layout", layer)

    def variant_names(self) -> list[str]:
        """Return the names of the compiled variants (``2 + 2 * len(final_dtypes)``)."""
        return sorted(variant.name for variant in self._variants.values())

    # -- serving ----------------------------------------------------------------------------
    def _check_call(self, state: torch.Tensor, indices: torch.Tensor, layer: str | None) -> torch.Tensor:
        """Refuse a launch that breaks the sealed contract; return the indices in launchable form."""
        if not self.sealed:
            refuse("unsealed", "the state-copy plan is not sealed; call seal() after prepare() (the worker "
                   "initialization does this) before serving", layer)
        # any row count: the launch passes this cache's shape[0] as the kernels' bound
        if (state.dtype != self._dtype or (state.shape != self._shape and not self._other_rows(state))
                or (state.stride() != self._strides and not layout.serves_signature(self.signature, state))
                or state.device != self._device or state.data_ptr() % 16 != self._alignment):
            found = layout.cache_signature(state) if state.dim() == 4 else f"shape {tuple(state.shape)}"
            change = layout.describe_signature_change(self.signature, found) if state.dim() == 4 else found
            refuse("signature", f"cache signature changed since prepare ({change}; only the row count may "
                   f"change): prepared {self.signature}, got {found}; re-initialize the plans after re-binding "
                   "the KV cache to another layout", layer)
        for kernel in self._kernels:
            if kernel.pre_run_hooks:
                refuse("jit_hook", f"a JIT pre-run hook appeared on {kernel.__name__} after seal; state-copy "
                       "launches bypass the JIT, so remove the hook or restart without it", layer)
        if self._check_device and torch._C._cuda_getDevice() != self._device_index:
            refuse("device", f"current CUDA device is {torch.cuda.current_device()}, plan is for "
                   f"{self._device}; call under torch.cuda.device({self._device_index})", layer)
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype not in layout.INDEX_DTYPES \
                or indices.device != self._device:
            layout.check_indices(indices, self._device, layer)
        if indices.shape[0] > self.max_selected:
            refuse("too_many_rows", f"{indices.shape[0]} selected rows exceed max_selected={self.max_selected}; "
                   "raise max_num_seqs at startup (plans are prepared for it) or split the batch", layer)
        if not indices.is_contiguous() or indices.data_ptr() % 16:
            indices = indices.clone(memory_format=torch.contiguous_format)
        return indices

    def _other_rows(self, state: torch.Tensor) -> bool:
        """The per-call check's slow path, for a shape other than the last call's: accept (and remember) it when
        only the row count differs, i.e. the inner ``[H, V, K]`` is the prepared one."""
        if state.shape[1:] != self._inner:
            return False
        self._shape = state.shape
        return True

    def gather(self, state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None = None,
               layer: str | None = None) -> torch.Tensor:
        """Gather cache rows into a new packed tensor (semantics of :func:`naive.gather_states`).

        Args:
            state: the cache (must match the prepared signature).
            indices: ``[S]`` int32/int64 rows on the cache's device (invalid values give zero rows).
            flags: optional ``[S]`` torch.bool; false rows give zero rows.
            layer: layer name for error messages.
        Returns:
            ``[S, H, V, K]`` contiguous, cache dtype.
        """
        if torch.compiler.is_compiling():
            refuse_traced("gather", layer)
        return self.gather_eager(state, indices, flags, layer)

    def gather_eager(self, state: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor | None = None,
                     layer: str | None = None) -> torch.Tensor:
        """:meth:`gather` for a caller that already knows it is not being traced (the binding checked)."""
        indices = self._check_call(state, indices, layer)
        count = indices.shape[0]
        if flags is None:
            flags = self._true_flags
        else:
            if flags.dim() != 1 or flags.shape[0] != count or flags.dtype != torch.bool or flags.device != self._device:
                layout.check_flags(flags, count, self._device, layer)
            if not flags.is_contiguous() or flags.data_ptr() % 16:
                flags = flags.clone(memory_format=torch.contiguous_format)
        packed = state.new_empty((count, *self._inner))  # the prepared dtype and device: _check_call checked both
        if count:
            self._gathers[indices.dtype].launch(self._grid(count, None), state, packed, indices, flags, state.shape[0])
        return packed

    def scatter(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor,
                layer: str | None = None) -> None:
        """Write packed rows into the cache, cast to its dtype in the same pass (semantics of
        :func:`naive.scatter_states`: bit for bit torch's ``packed.to(state.dtype)``).

        Args:
            state: the cache (must match the prepared signature), modified in place.
            packed: ``[S, H, V, K]`` final states in one of the prepared ``final_dtypes``.
            indices: ``[S]`` int32/int64 destination rows; invalid ones are skipped; valid ones unique.
            layer: layer name for error messages.
        Raises:
            StateCopyRefused: ``final_dtype`` when ``packed.dtype`` was not prepared (nothing is launched).
        """
        if torch.compiler.is_compiling():
            refuse_traced("scatter", layer)
        self.scatter_eager(state, packed, indices, layer)

    def scatter_eager(self, state: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor,
                      layer: str | None = None) -> None:
        """:meth:`scatter` for a caller that already knows it is not being traced (the binding checked)."""
        indices = self._check_call(state, indices, layer)
        count = indices.shape[0]
        if not isinstance(packed, torch.Tensor) or packed.shape != (count, *self._inner) \
                or packed.device != self._device or packed.dtype not in casts.KIND_CODES:
            layout.check_packed(packed, count, state, layer)
        scatters = self._scatters.get(packed.dtype)
        if scatters is None:
            refuse("final_dtype", f"final states of dtype {packed.dtype} were not prepared for this layer's plan "
                   f"(prepared: {', '.join(map(casts.dtype_name, self.final_dtypes))}); final dtypes are decided "
                   "at startup: pass them in final_dtypes to initialize()", layer)
        if not count:
            return
        if not packed.is_contiguous() or packed.data_ptr() % 16:
            packed = packed.clone(memory_format=torch.contiguous_format)
        if count >= self._bulk_min_rows and packed.dtype == self._dtype:
            scatters = self._bulk_scatters
        scatters[indices.dtype].launch(
            self._grid(count, packed.dtype), state, packed, indices, self._true_flags, state.shape[0]
        )

    def describe(self) -> dict[str, Any]:
        """Return the plan as a JSON-serialisable dict (for the ledger and the benchmark)."""
        return {"kind": self.kind, "sealed": self.sealed, "max_selected": self.max_selected,
                "device_kind": device_kind(self._device), "layout": self.layout.as_dict(),
                "row_bound": f"{ROWS_ARGUMENT} ({ROWS_TYPE}): the cache's shape[0] at each launch",
                "alignment": self._alignment, "num_warps": self._num_warps, "stream": self._stream,
                "scatter_evict_first": self._scatter_evict_first, "pdl": self._pdl, "target": self.target.name,
                "block": self._block_facts(), "block_limited_by": self.block_limited_by,
                "memory_hints": self.memory_hints(),
                "launch_entry": "+".join(sorted({variant.entry for variant in self._variants.values()})),
                "final_dtypes": [casts.dtype_name(dtype) for dtype in self.final_dtypes],
                "casts": [policy.as_dict() for policy in self._casts.values()],
                "constexprs": {variant.name: [str(v) for v in self._variant_constexprs(key)]
                               for key, variant in self._variants.items()},
                "variants": self.variant_names()}


    def memory_hints(self) -> dict[str, Any]:
        """Return which memory hints the plan's kernels carry and which the target keeps (plan facts, ledger)."""
        return {"target_honours": list(self.target.honoured_hints), "gather_evict_first": self._stream,
                "scatter_evict_first": self._scatter_evict_first, "dropped": list(self._hints_dropped)}

    def _block_facts(self) -> dict[str, int]:
        raise NotImplementedError


class FusedStatePlan(StateCopyPlan):
    """Typed tiled copy (FP32/BF16): one program per (payload tile, selected row)."""

    kind = PLAN_FUSED
    kernel = kernels.copy_rows_kernel
    # 32 bytes per thread at 4 warps. H200 tile sweep (docs/results/h200-gdn-state-copy run 8): 2-3 % faster
    # than 8 KiB tiles for both copies at >= 64 rows in 20 of 24 cases (16-64 KiB tiles were no faster than 8 KiB)
    DEFAULT_BLOCK_BYTES = 4096
    DEFAULT_NUM_WARPS = 4

    def _scatter_hint(self, target: TargetFacts) -> bool:
        # H200 (docs/results/h200-gdn-state-copy run 11): evict_first on the scatter's cache writes keeps the
        # final states in the L2: -7 to -11 % for the L2-sized BF16 64-row scatters, within 0.5 % elsewhere.
        # On the gather's cache reads it cost 2 % at 256 rows, so that stays the stream experiment. Only where
        # the compiler keeps the hint (CUDA; triton-ascend's adapter drops it: patches/ASCEND_COMPILE.md).
        return target.honours(EVICT_FIRST)

    def _launch_option_pdl(self) -> bool:
        return True

    def _variant_family(self, key: tuple[Any, ...]) -> str:
        source = self._dtype if key[0] == "gather" else key[2]
        return f"fused/{casts.dtype_name(source)}->{casts.dtype_name(self._dtype)}"

    def _configure(self, block_bytes: int | None, num_warps: int | None, layer: str | None) -> int:
        items = max((block_bytes or self.DEFAULT_BLOCK_BYTES) // self.layout.element_size, 16)
        block = min(triton.next_power_of_2(items), triton.next_power_of_2(self.layout.payload))
        size = self.layout.element_size
        block = self._limit_block(block, size, [(self._variant_family(key), size) for key in self._variant_keys()],
                                  block_bytes is not None, layer)
        self._block = block
        # per source dtype (the cache's for gathers and same-dtype scatters, each final dtype's for its scatters):
        # the block in cache items, its tile count and the layout constexprs. Only a target that sizes tiles by
        # the widest item gives a wider final dtype a smaller block (never above the limited one).
        self._blocks = {source: max(block * size // max(size, source.itemsize), 16)
                        if self.target.tile_by_widest_item else block
                        for source in dict.fromkeys((self._dtype, *self.final_dtypes))}
        self._tiles = {source: triton.cdiv(self.layout.payload, items) for source, items in self._blocks.items()}
        self._tiles[None] = self._tiles[self._dtype]
        self._bases = {source: (self.layout.row_stride, self.layout.payload, items, self.layout.payload % items == 0)
                       for source, items in self._blocks.items()}
        # measured with programmatic dependent launch: a plan of a PDL target that launches without it keeps its
        # warps, which lead at 64-256 rows (TargetFacts.widened_scatter_warps)
        measured_launch = self._pdl or not self.target.honours(PDL)
        target_warps = measured_launch and not num_warps  # warps the caller chose apply to every variant
        self._widened_warps = self.target.widened_scatter_warps if target_warps else None
        self._gather_warps = self.target.gather_warps.get(casts.dtype_name(self._dtype)) if target_warps else None
        bulk = self.target.bulk_scatter
        if bulk and not num_warps and self.max_selected >= bulk.min_rows \
                and casts.dtype_name(self._dtype) in bulk.cache_dtypes:
            self._bulk = bulk
        return num_warps or (self.DEFAULT_NUM_WARPS if block >= 1024 else 2)

    def _variant_kernel(self, key: tuple[Any, ...]) -> Any:
        return kernels.copy_rows_kernel

    def _variant_warps(self, key: tuple[Any, ...]) -> int:
        # a scatter whose tile the target narrowed for wider finals takes the target's warps for it
        # (TargetFacts.widened_scatter_warps), unless the caller chose the warps
        if key[0] == "scatter" and self._widened_warps and self._blocks[key[2]] != self._block:
            return self._widened_warps
        if key[3:] == (BULK,):
            return self._bulk.num_warps
        if key[0] == "gather" and self._gather_warps:  # TargetFacts.gather_warps, for this cache dtype
            return self._gather_warps
        return self._num_warps

    def _block_facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"items": self._block, "bytes": self._block * self.layout.element_size}
        narrower = {casts.dtype_name(source): items for source, items in self._blocks.items() if items != self._block}
        if narrower:  # the scatters of these final dtypes move fewer cache items per program
            facts["scatter_items"] = narrower
            if self._widened_warps:
                facts["scatter_warps"] = {name: self._widened_warps for name in narrower}
        if self._gather_warps:  # the gathers launch with the target's warps for this cache dtype
            facts["gather_warps"] = self._gather_warps
        if self.target.pinned_scatter_load:  # the scatters' packed loads are volatile (kernels.py, "Pinned ...")
            facts["scatter_load"] = "pinned"
        if self._bulk is not None:  # from this many rows, same-dtype scatters launch the bulk variants
            facts["bulk_scatter"] = {"min_rows": self._bulk.min_rows, "num_warps": self._bulk.num_warps,
                                     "evict_first": self._bulk_evict_first()}
        return facts

    def _bulk_evict_first(self) -> bool:
        return bool(self._bulk and self._bulk.evict_first and self.target.honours(EVICT_FIRST))

    def _variant_constexprs(self, key: tuple[Any, ...]) -> tuple[Any, ...]:
        if key[0] == "gather":
            code = casts.KIND_CODES.get(self._dtype, 0)
            return (*self._bases[self._dtype], False, self._stream, code, code, 0, 0, self._pdl, False)
        evict_first = self._bulk_evict_first() if key[3:] == (BULK,) else self._scatter_evict_first
        return (*self._bases[key[2]], True, evict_first, *self._casts[key[2]].constexprs(), self._pdl,
                self.target.pinned_scatter_load)

    def _grid(self, count: int, source: torch.dtype | None = None) -> tuple[int, int]:
        return (self._tiles[source], count)


class FallbackStatePlan(StateCopyPlan):
    """Masked byte copy (any dtype): a flat grid in which each row is split over many programs.

    A scatter whose final dtype differs from the cache dtype cannot be a byte copy: it runs the typed
    masked variant :func:`~kda_patches.state_copy.kernels.scatter_cast_items_kernel` (same grid, same
    masks, the folded cast), so the semantics are the byte copy's plus torch's cast.
    """

    kind = PLAN_FALLBACK
    kernel = kernels.copy_row_bytes_kernel
    DEFAULT_BLOCK_BYTES = 16384
    DEFAULT_NUM_WARPS = 8

    def _variant_family(self, key: tuple[Any, ...]) -> str:
        if key[0] == "scatter" and not self._casts[key[2]].identity:
            return f"cast_items/{casts.dtype_name(key[2])}->{casts.dtype_name(self._dtype)}"
        return "bytes"

    def _configure(self, block_bytes: int | None, num_warps: int | None, layer: str | None) -> int:
        size = self.layout.element_size
        payload_bytes = self.layout.payload * size
        block = min(triton.next_power_of_2(max(block_bytes or self.DEFAULT_BLOCK_BYTES, 16)),
                    triton.next_power_of_2(payload_bytes))
        # one block for every variant (they share the grid): the byte copy's items are bytes, the cast
        # scatter's are cache items
        families = [(family, 1 if family == "bytes" else size)
                    for family in (self._variant_family(key) for key in self._variant_keys())]
        block = self._limit_block(block, 1, families, block_bytes is not None, layer)
        self._block = block
        self._tiles = triton.cdiv(payload_bytes, block)
        self._bytes_base = (self.layout.row_stride * size, payload_bytes, self._tiles, block)
        # the typed cast scatter covers the same bytes per program, so its grid is the byte kernel's
        self._items_base = (self.layout.row_stride, self.layout.payload, self._tiles, max(block // size, 1))
        return num_warps or (self.DEFAULT_NUM_WARPS if block >= 8192 else 4)

    def _variant_kernel(self, key: tuple[Any, ...]) -> Any:
        if key[0] == "scatter" and not self._casts[key[2]].identity:
            return kernels.scatter_cast_items_kernel
        return kernels.copy_row_bytes_kernel

    def _block_facts(self) -> dict[str, int]:
        return {"bytes": self._block, "cast_items": max(self._block // self.layout.element_size, 1)}

    def _variant_constexprs(self, key: tuple[Any, ...]) -> tuple[Any, ...]:
        if key[0] == "gather":
            return (*self._bytes_base, False)
        policy = self._casts[key[2]]
        if policy.identity:
            return (*self._bytes_base, True)
        return (*self._items_base, *policy.constexprs())

    def _grid(self, count: int, source: torch.dtype | None = None) -> tuple[int, int]:
        return (count * self._tiles, 1)  # one grid for every variant (the cast scatter's items cover its bytes)


@torch.compiler.disable(reason="an unbound plan cannot be traced; use the LayerStatePlan binding from initialize()")
def refuse_traced(op: str, layer: str | None) -> NoReturn:
    """Refuse an unbound plan's ``op`` met while torch.compile traces it.

    Never traced itself: Dynamo cannot follow the refusal into the ledger's lock or the error's constructor and
    would report those instead. With ``fullgraph=True`` the trace stops here with this decorator's reason; otherwise
    the graph breaks and this runs eagerly, recorded in the ledger like every refusal.
    """
    refuse("compile", "an unbound plan cannot be traced; use the LayerStatePlan binding from initialize(), which "
           f"calls the kda_patches::state_{op} custom op", layer)


PLAN_CLASSES: dict[str, type[StateCopyPlan]] = {PLAN_FUSED: FusedStatePlan, PLAN_FALLBACK: FallbackStatePlan}


def __getattr__(name: str) -> Any:
    """Re-export the worker-level API (``initialize``, ``LayerStatePlan``) without an import cycle."""
    if name in ("initialize", "LayerStatePlan"):
        from kda_patches.state_copy import worker

        return getattr(worker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
