"""The indexed twins of vllm-ascend's chunk-state kernels, derived from each released file, as Ascend compile cases.

vllm-ascend ships its own Triton chunk-state kernels (``vllm_ascend/ops/triton/fla/chunk_delta_h.py``, the GDN
prefill's, and ``vllm_ascend/ops/triton/kda/chunk_delta_h.py``, the KDA prefill's). Each released file of
:data:`RELEASES` is executed from the release cache (its ``from .utils import ...`` resolved to the same release's
sibling file, ``from vllm.triton_utils import tl, triton`` to the installed Triton: on the Ascend check's
environment triton-ascend), and its kernel is derived into the indexed twin by
:func:`~kda_patches.indexed_chunk.derive.derive_indexed_kernel` under the shape :data:`KERNEL_FILES` declares for
it. The twins' code is the release's with the declared edits only; nothing of it is kept in the project.

:func:`twin_cases` turns the twins into compile cases: one per chip class, kernel source (the releases whose kernel
has that source share it), and cache dtype with the exact FP32 -> cache-dtype cast of each NaN rule the store can
be launched with (:data:`~kda_patches.state_copy.casts.NAN_RULES`; a FP32 cache stores the bits as they are). The
launch facts (pointer types, the heuristics' constexprs of a varlen prefill with an initial and a final state,
the chunk size and head shape) are those the releases' host functions launch with for the shape
:data:`TWIN_SHAPE`.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any

# vllm-ascend releases in the release cache whose kernel files are derived (every release that has them)
RELEASES = ("0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2")
DIST = "vllm-ascend"
# kernel shape (a key of derive.KERNEL_SHAPES) -> the released file holding it
KERNEL_FILES = {
    "vllm-ascend-fla": "vllm_ascend/ops/triton/fla/chunk_delta_h.py",
    "vllm-ascend-kda": "vllm_ascend/ops/triton/kda/chunk_delta_h.py",
}
# the per-rank prefill the cases are compiled for: 128 x 128 heads (the FLA kernel's only head size), 8 value heads
# and 8 key heads (Kimi Linear at TP4; the KDA kernel takes H and Hg as constexprs), 64-token chunks
TWIN_SHAPE = {"H": 8, "Hg": 8, "K": 128, "V": 128, "BT": 64, "BV": 64}
INPUT_TYPE = "*bf16"  # k, w, u and the per-chunk states h, v_new: the model dtype
CACHE_TYPES = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}
# the launch's pointer and scalar types by parameter (anything else is a constexpr)
_POINTER_TYPES = {"k": INPUT_TYPE, "v": INPUT_TYPE, "w": INPUT_TYPE, "v_new": INPUT_TYPE, "h": INPUT_TYPE,
                  "h_update": INPUT_TYPE, "g": "*fp32", "gk": "*fp32", "kda_rows": "*i32", "kda_flags": "*i1",
                  "cu_seqlens": "*i32", "chunk_offsets": "*i64", "kda_num_rows": "i32", "kda_row_stride": "i32",
                  "T": "i32", "H": "i32", "Hg": "i32", "K": "i32", "V": "i32"}
# the heuristics' constexprs of a varlen prefill with initial and final states, per shape (the FLA kernel's gate is
# g; the KDA kernel's is the per-key gk)
_HEURISTICS = {
    "vllm-ascend-fla": {"USE_G": True, "USE_INITIAL_STATE": True, "STORE_FINAL_STATE": True, "SAVE_NEW_VALUE": True,
                        "IS_VARLEN": True},
    "vllm-ascend-kda": {"USE_G": False, "USE_GK": True, "USE_INITIAL_STATE": True, "STORE_FINAL_STATE": True,
                        "SAVE_NEW_VALUE": True, "IS_VARLEN": True},
}


# The twins that do not fit A2/A3's unified buffer with the backend's own options (bishengir: "ub overflow"), by
# shape: (cache dtype, NaN rule). None since the 16-bit store casts in row slices on triton-ascend
# (``casts.cast_bits_sliced``, chosen by ``derive.twin_cast``): the exact FP32 -> 16-bit cast of a whole
# final-state tile at once outgrew it (the FLA kernel keeps two 128 x 64 FP32 halves live; 11 of the 14 twins
# overflowed), one slice's bit temporaries do not; an FP32 cache stores the state as written. The check compiles
# every case and reports a case that disagrees with this table either way; A5 fits every twin.
A2A3_OVERFLOWS: dict[str, tuple[tuple[str, str], ...]] = {}


def _private(text: str) -> str:
    return re.sub(r"\W", "_", text)


def load_kernel_module(root: pathlib.Path, relative: str) -> types.ModuleType:
    """Execute a released kernel file under a private package of its release folder and return the module.

    The file's folder becomes the package ``kda_release_<release>_<folder>`` (its ``__init__`` not executed), so
    ``from .utils import ...`` loads the same release's ``utils.py`` beside it; ``vllm.triton_utils`` is answered
    with the installed Triton for the import (:func:`~kda_patches.releases.load.triton_utils_shim`). A module
    already loaded is returned as it is.

    Args:
        root: the release folder (:func:`kda_patches.releases.fetch.release_dir`).
        relative: the kernel file, relative to ``root``.
    Returns:
        The module, registered in ``sys.modules`` (Triton reads a kernel's source through it).
    Raises:
        FileNotFoundError: the release lacks the file.
    """
    from kda_patches.releases.load import run_serving, triton_utils_shim

    path = pathlib.Path(root) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not in the release folder {root}")
    package = f"kda_release_{_private(pathlib.Path(root).name)}_{_private(str(pathlib.Path(relative).parent))}"
    name = f"{package}.{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    if package not in sys.modules:
        holder = types.ModuleType(package)
        holder.__path__ = [str(path.parent)]
        sys.modules[package] = holder
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    served = triton_utils_shim()
    served["vllm.triton_utils"].triton = _untimed_triton(served["vllm.triton_utils"].triton)
    run_serving(name, module, served, lambda: spec.loader.exec_module(module))
    return module


def _never_timed(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a released autotuner loaded by kda_patches.ascend_check.indexed_twins does not time configs "
                       "(its twins run one declared config)")


def _untimed_triton(triton: types.ModuleType) -> types.ModuleType:
    """``triton`` as the released file sees it, its ``autotune`` given a benchmarker that is never asked.

    triton-ascend's ``Autotuner`` asks the active driver for a benchmarker when it is built, and without an NPU
    there is none: the released module would not import. Its twin drops the autotuner anyway.
    """
    shim = types.ModuleType("triton")
    shim.__dict__.update(vars(triton))

    def autotune(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("do_bench", _never_timed)
        return triton.autotune(*args, **kwargs)

    shim.autotune = autotune
    return shim


def derive_release_twin(root: pathlib.Path, shape: str) -> Any:
    """Derive the indexed twin of the kernel of ``shape`` (a key of :data:`KERNEL_FILES`) in the release ``root``.

    Returns:
        The :class:`~kda_patches.indexed_chunk.derive.DerivedKernel`.
    Raises:
        DerivationRefused: the released kernel is not of the declared shape (the message names the part).
        FileNotFoundError: the release lacks the file.
    """
    from kda_patches.indexed_chunk.derive import declare, derive_indexed_kernel

    module = load_kernel_module(root, KERNEL_FILES[shape])
    return derive_indexed_kernel(module, declare(shape, module.__name__))


def release_roots(versions: tuple[str, ...] = RELEASES) -> dict[str, pathlib.Path]:
    """Return ``{version: release folder}`` (fetched into the release cache where missing)."""
    from kda_patches.releases.fetch import release_dir

    return {version: pathlib.Path(release_dir(DIST, version)) for version in versions}


@dataclass
class TwinCase:
    """One compile of an indexed twin for one chip class.

    Attributes:
        chip: ``"a2a3"`` or ``"a5"``.
        shape: the kernel shape (a key of :data:`KERNEL_FILES`).
        kernel_sha256: the released kernel's source digest (first 12 hex digits): one twin per distinct source.
        releases: the vllm-ascend releases whose kernel has that source.
        cache_dtype: the cache's dtype name; ``nan_rule``: the final store's NaN rule (``"bit copy"`` for FP32).
        kernel: the twin's JIT function; ``signature`` and ``constexprs`` as ``triton.compile`` takes them.
        twin: False for the release's own kernel (``cache_dtype`` FP32, as its host allocates the final state),
            compiled beside its twins as their baseline.
    """

    chip: str
    shape: str
    kernel_sha256: str
    releases: list[str] = field(default_factory=list)
    cache_dtype: str = ""
    nan_rule: str = ""
    kernel: Any = None
    signature: dict[str, str] = field(default_factory=dict)
    constexprs: dict[str, Any] = field(default_factory=dict)
    twin: bool = True

    @property
    def declared_fits(self) -> bool:
        """Whether :data:`A2A3_OVERFLOWS` declares that this case fits the chip's unified buffer."""
        return not self.twin or self.chip != "a2a3" or \
            (self.cache_dtype, self.nan_rule) not in A2A3_OVERFLOWS.get(self.shape, ())

    @property
    def name(self) -> str:
        """``<shape>@<kernel sha>`` (the matrix row's twin)."""
        return f"{self.shape}@{self.kernel_sha256}"


def _jit_function(jitted: Any) -> Any:
    """The JIT function under the twin's heuristics (``triton.compile`` takes the constexprs they would set)."""
    from triton.runtime.jit import JITFunction

    current = jitted
    while not isinstance(current, JITFunction):
        current = current.fn
    return current


def launch_facts(derived: Any, shape: str, cache_dtype: str, nan_rule: int) -> tuple[dict[str, str], dict[str, Any]]:
    """Return the twin's ``(signature, constexprs)`` for a cache of ``cache_dtype`` stored under ``nan_rule``.

    Args:
        derived: the twin (:func:`derive_release_twin`).
        shape: its kernel shape.
        cache_dtype: ``float32``, ``bfloat16`` or ``float16``.
        nan_rule: a key of :data:`~kda_patches.state_copy.casts.NAN_RULES` (ignored for a FP32 cache).
    Raises:
        KeyError: the twin has a parameter the launch facts do not type.
    """
    import torch

    from kda_patches.ascend_check.plan_variants import CANONICAL_NAN
    from kda_patches.state_copy import casts

    cache = getattr(torch, cache_dtype)
    rule = casts.NAN_CANONICAL if cache == torch.float32 else nan_rule
    policy = casts.CastPolicy(torch.float32, cache, rule, CANONICAL_NAN[cache] if rule == casts.NAN_CANONICAL else 0)
    _, dst, nan, bits = policy.constexprs()
    given = {**_HEURISTICS[shape], "KDA_DST": dst, "KDA_NAN_RULE": nan, "KDA_NAN_BITS": bits,
             **{name: value for name, value in TWIN_SHAPE.items()}}
    function = _jit_function(derived.jitted)
    constexpr_names = {parameter.name for parameter in function.params if parameter.is_constexpr}
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for name in derived.arg_names:
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[name] = given[name]
        elif name in ("h0", "ht"):
            signature[name] = CACHE_TYPES[cache_dtype]
        else:
            signature[name] = _POINTER_TYPES[name]
    return signature, constexprs


def twin_cases(chips: tuple[str, ...], roots: dict[str, pathlib.Path],
               cache_dtypes: tuple[str, ...] = tuple(CACHE_TYPES)) -> list[TwinCase]:
    """Return the compile cases of every twin of every release in ``roots``, per chip class.

    Args:
        chips: chip classes.
        roots: ``{version: release folder}`` (:func:`release_roots`).
        cache_dtypes: the cache dtypes whose twins are compiled (each with every NaN rule where it casts); the
            release's own kernel is compiled whatever they are.
    Returns:
        One :class:`TwinCase` per chip, shape, distinct kernel source, cache dtype and NaN rule, in a stable order.
    Raises:
        DerivationRefused: a released kernel is not of its declared shape.
    """
    from kda_patches.state_copy import casts

    twins: dict[tuple[str, str], tuple[Any, list[str]]] = {}
    for version, root in roots.items():
        for shape in KERNEL_FILES:
            derived = derive_release_twin(root, shape)
            key = (shape, derived.source_sha256[:12])
            twins.setdefault(key, (derived, []))[1].append(version)
    cases = []
    for chip in chips:
        for (shape, digest), (derived, versions) in sorted(twins.items()):
            release = _release_case(chip, shape, digest, derived)
            release.releases = list(versions)
            cases.append(release)
            for cache_dtype in cache_dtypes:
                rules = (None,) if cache_dtype == "float32" else tuple(casts.NAN_RULES)
                for rule in rules:
                    signature, constexprs = launch_facts(derived, shape, cache_dtype,
                                                         casts.NAN_CANONICAL if rule is None else rule)
                    cases.append(TwinCase(chip, shape, digest, list(versions), cache_dtype,
                                          "bit copy" if rule is None else casts.NAN_RULES[rule],
                                          _jit_function(derived.jitted), signature, constexprs))
    return cases



def _release_case(chip: str, shape: str, digest: str, derived: Any) -> TwinCase:
    """The release's own kernel at its twins' launch facts (a FP32 initial and final state, as its host launches)."""
    signature, constexprs = launch_facts(derived, shape, "float32", 0)
    module = sys.modules[derived.declaration.module]
    kernel = _jit_function(getattr(module, derived.declaration.kernel))
    names = {parameter.name for parameter in kernel.params}
    return TwinCase(chip, shape, digest, [], "float32", "release kernel", kernel,
                    {name: kind for name, kind in signature.items() if name in names},
                    {name: value for name, value in constexprs.items() if name in names}, twin=False)
