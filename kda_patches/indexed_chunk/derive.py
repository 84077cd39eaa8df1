"""Derive the indexed twin of a release's chunk-state kernel from its own source, by declared edits.

The release's kernel (vLLM's vendored FLA ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``, which the Qwen,
Olmo, Kimi Linear and Kimi K3 prefills all run, and vllm-ascend's own Triton twins of it) offsets a dense ``h0`` /
``ht`` by the packed row ``i_nh``, loads the initial state under ``USE_INITIAL_STATE`` and stores the final state in
its epilogue under ``STORE_FINAL_STATE``. Where the offset sits is the kernel's *shape*, declared per kernel
(:data:`KERNEL_SHAPES`; the edits below are one mechanism for every shape):

- :data:`OWN_BLOCK` (vLLM's FLA, vllm-ascend's KDA kernel): ``if GUARD: P = P + E`` is the only statement of its
  block, and one later ``if GUARD:`` block reads or writes ``P``;
- :data:`LEADING` (vllm-ascend's FLA kernel, ``[N, H, K, V]`` states in two 64-wide value halves):
  ``if GUARD: T = P + E`` is the first statement of the one block that reads or writes through the declared local
  ``T`` (``h0_ptr`` / ``ht_ptr``), and ``P`` appears nowhere else in it.

The twin is that source with exactly these edits (:class:`KernelDeclaration` names the parts):

1. the decorators are dropped: the twin is jitted here, under the release's own heuristics, without its autotuner
   (an autotuner's timing runs would read and write the cache again, and it compiles while serving), with the
   release's ``jit`` keywords and the four row arguments below never specialized (``do_not_specialize``: a row
   count that changes with the extensible cache's rebind, index vectors sliced at any offset -- none may compile
   another variant while serving);
2. four arguments follow the final state -- ``kda_rows`` (the sequences' cache rows), ``kda_flags`` (whether each
   has an initial state), ``kda_num_rows`` and ``kda_row_stride`` (the cache's ``shape[0]`` and ``stride(0)`` in
   items) -- and three constexprs end the list (``KDA_DST``, ``KDA_NAN_RULE``, ``KDA_NAN_BITS``: the exact FP32 to
   cache-dtype cast of :func:`~kda_patches.state_copy.casts.cast_bits`);
3. before the first offset, the sequence's row is read once: ``kda_valid`` (``0 <= row < num_rows``),
   ``kda_read`` (valid and flagged) and ``kda_safe_row`` (the row where valid, else 0);
4. each offset ``T = P + E`` of the initial and final state (``E`` naming the packed row; ``T`` is ``P`` in the
   own-block shape) becomes ``T = P + kda_safe_row * kda_row_stride + E'``, ``E'`` being ``E`` with the head index
   for the packed row: the head's slice of the cache row, whose inner ``[H, ...]`` is contiguous and laid out as
   the kernel's dense state (``state_layout``);
5. the initial-state load block runs only ``if kda_read`` (otherwise the state stays the zeros it starts as), and the
   final-state store block only ``if kda_valid``, each ``Y.to(P.dtype.element_ty)`` stored there becoming the
   exact cast of ``Y`` to the cache dtype -- for an FP32 cache (``KDA_DST == 0``) the store as written, the FP32 state
   bit for bit as torch's same-dtype ``.to()`` keeps it (no bit-pattern temporaries: Ascend A2/A3's unified buffer
   has no room for them beside the FP32 state tile); for a 16-bit cache ``kda_cast_bits`` (:func:`twin_cast`): where
   the installed Triton slices tensors in a kernel (triton-ascend) the same bits cast a slice of rows at a time, so
   that A2/A3's unified buffer holds one slice's bit temporaries, not a whole tile's; elsewhere (CUDA, the
   interpreter) the whole tile in one pass.

Anything else in the source is kept as it is. The twin runs in a copy of the kernel module's namespace taken when
it is derived (plus ``kda_cast_bits``, chosen then): nothing is added to the release's module, and a name the module
rebinds later is not seen by the twin. A source that is not of this shape (a block missing or doubled, the
state read or written elsewhere or past its offset, a name of the twin's already taken, a non-literal ``jit``
keyword, an undeclared shape) is refused with
:class:`DerivationRefused` naming the part, and nothing is built.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import linecache
import types
from dataclasses import dataclass, field, replace
from typing import Any

import triton

from kda_patches.routing.eras import FLA_CHUNK_STATE_HOST, FLA_CHUNK_STATE_KERNEL, FLA_CHUNK_STATE_MODULE
from kda_patches.state_copy.casts import cast_bits, cast_bits_sliced, slices_tensors

TWIN_PREFIX = "kda_"
ROW_ARGUMENTS = ("kda_rows", "kda_flags", "kda_num_rows", "kda_row_stride")
CAST_CONSTEXPRS = ("KDA_DST", "KDA_NAN_RULE", "KDA_NAN_BITS")
OWN_BLOCK = "own block"  # `if GUARD: P = P + E` alone in its block; the access in one later `if GUARD:` block
LEADING = "leading"  # `if GUARD: T = P + E` the first statement of the one block that accesses the state through T
OFFSET_FORMS = (OWN_BLOCK, LEADING)


class DerivationRefused(Exception):
    """The release's kernel source is not the declared shape; the message names the part and the release."""


@dataclass(frozen=True)
class KernelDeclaration:
    """The names an indexed twin is derived by (data; the mechanism is shared by every release).

    Attributes:
        module: the kernel's module (its released file is read through the loaded module).
        kernel: the kernel's name in that module (an autotuner, heuristics or jit object).
        host: the module's host function the consumers call (``chunk_gated_delta_rule_fwd_h``).
        initial, final: the kernel's initial- and final-state pointer arguments.
        use_initial, store_final: the constexprs that guard their blocks.
        packed_row, sequence, head: the kernel's packed ``sequence * H + head`` index and its two parts.
        consumers: modules that call ``host`` by their own global name (where the route finds the call).
        offset: where the offsets sit (:data:`OWN_BLOCK` or :data:`LEADING`).
        initial_target, final_target: :data:`LEADING` only: the locals the offsets assign (``h0_ptr``, ``ht_ptr``).
        state_layout: the dense state's layout, which the cache rows keep (the launch's precondition).
    """

    module: str
    kernel: str
    host: str
    initial: str = "h0"
    final: str = "ht"
    use_initial: str = "USE_INITIAL_STATE"
    store_final: str = "STORE_FINAL_STATE"
    packed_row: str = "i_nh"
    sequence: str = "i_n"
    head: str = "i_h"
    consumers: tuple[str, ...] = field(default=())
    offset: str = OWN_BLOCK
    initial_target: str = ""
    final_target: str = ""
    state_layout: str = "[N, H, V, K]"

    def target_of(self, pointer: str) -> str:
        """The local that ``pointer``'s offset assigns (``pointer`` itself in the own-block shape)."""
        target = self.initial_target if pointer == self.initial else self.final_target
        return target if self.offset == LEADING and target else pointer


# Every kernel shape the twin is derived for, by the name of the released kernel's family. ``module`` is the
# released module's own import name; a loader that executes the file under another name replaces it
# (:func:`declare`). vLLM's own FLA (every release 0.26 and later) is the default declaration.
KERNEL_SHAPES: dict[str, KernelDeclaration] = {
    "vllm-fla": KernelDeclaration(module=FLA_CHUNK_STATE_MODULE, kernel=FLA_CHUNK_STATE_KERNEL,
                                  host=FLA_CHUNK_STATE_HOST),
    "vllm-ascend-fla": KernelDeclaration(
        module="vllm_ascend.ops.triton.fla.chunk_delta_h", kernel="chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
        host="chunk_gated_delta_rule_fwd_h", offset=LEADING, initial_target="h0_ptr", final_target="ht_ptr",
        state_layout="[N, H, K, V]"),
    "vllm-ascend-kda": KernelDeclaration(
        module="vllm_ascend.ops.triton.kda.chunk_delta_h", kernel="chunk_gated_delta_rule_fwd_kernel_h_blockdim64_kda",
        host="chunk_gated_delta_rule_fwd_h_kda"),
}


def declare(shape: str, module: str) -> KernelDeclaration:
    """Return the declaration of kernel shape ``shape`` (a key of :data:`KERNEL_SHAPES`) for the module loaded as
    ``module``.

    Raises:
        KeyError: no such shape is declared.
    """
    return replace(KERNEL_SHAPES[shape], module=module)


@dataclass
class DerivedKernel:
    """An indexed twin and what it was derived from.

    Attributes:
        declaration: the declaration it follows.
        host: the release's host function (the naive twin calls it; its signature binds a call's arguments).
        jitted: the twin under the release's heuristics (launch with ``jitted[grid](**arguments)``).
        arg_names: the twin's parameters, in order.
        configs: the release autotuner's configs (``kwargs``, ``num_warps``, ``num_stages``), or ``[]``.
        heuristics: the constexpr names the release's heuristics compute.
        source: the twin's source text; ``source_sha256``: the release kernel's source digest.
    """

    declaration: KernelDeclaration
    host: Any
    jitted: Any
    arg_names: list[str]
    configs: list[dict[str, Any]]
    heuristics: tuple[str, ...]
    source: str
    source_sha256: str


def _refuse(declaration: KernelDeclaration, part: str, why: str) -> DerivationRefused:
    return DerivationRefused(f"{declaration.module}.{declaration.kernel}: {part}: {why}; the indexed twin is not "
                             "built (the seam keeps copying states through its plan)")


def unwrap_kernel(kernel: Any) -> tuple[types.FunctionType, list[Any], dict[str, Any]]:
    """Return ``(python function, autotune configs, heuristics values)`` of a release kernel object.

    Args:
        kernel: the module attribute: an ``Autotuner`` / ``Heuristics`` / ``JITFunction`` (or the interpreter's
            function) chain, each holding the next in ``.fn``.
    Returns:
        The undecorated function, the autotuner's ``configs`` (``[]`` without one) and the heuristics' ``values``
        (``{}`` without them).
    """
    configs: list[Any] = []
    heuristics: dict[str, Any] = {}
    current = kernel
    for _ in range(8):
        if isinstance(current, types.FunctionType):
            return current, configs, heuristics
        if hasattr(current, "configs") and not configs:
            configs = list(current.configs)
        if isinstance(getattr(current, "values", None), dict) and not heuristics:
            heuristics = dict(current.values)
        current = getattr(current, "fn", None)
    raise TypeError(f"{kernel!r} is not a Triton kernel chain ending in a Python function")


def _names(node: ast.AST) -> set[str]:
    return {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}


def _calls(node: ast.AST, attribute: str) -> list[ast.Call]:
    return [child for child in ast.walk(node) if isinstance(child, ast.Call)
            and isinstance(child.func, ast.Attribute) and child.func.attr == attribute]


def _guarded_by(statement: ast.stmt, constexpr: str) -> bool:
    return isinstance(statement, ast.If) and isinstance(statement.test, ast.Name) and statement.test.id == constexpr \
        and not statement.orelse


def _offset_of(statement: ast.stmt, target: str, pointer: str, packed_row: str) -> ast.expr | None:
    """``E`` of a statement ``target = pointer + E`` (E naming the packed row), else None."""
    if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
        return None
    if not (isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == target):
        return None
    value = statement.value
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add) and isinstance(value.left, ast.Name)
            and value.left.id == pointer and packed_row in _names(value.right)):
        return None
    return value.right


def _find_offset(statement: ast.If, declaration: KernelDeclaration, pointer: str) -> ast.expr | None:
    """The packed-row offset ``E`` a guarded block holds where the declared shape puts it, else None."""
    target = declaration.target_of(pointer)
    if declaration.offset == OWN_BLOCK and len(statement.body) != 1:
        return None
    return _offset_of(statement.body[0], target, pointer, declaration.packed_row)


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(self.new, node.ctx) if node.id == self.old else node


def _exact_store_casts(block: ast.If, declaration: KernelDeclaration) -> None:
    """Rewrite every ``tl.store(P, Y.to(P.dtype.element_ty), ...)`` of the store block to the exact cast."""
    stores = _calls(block, "store")
    if not stores:
        raise _refuse(declaration, f"the {declaration.store_final} block", "stores nothing")
    for store in stores:
        value = store.args[1] if len(store.args) > 1 else None
        if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "to"
                and len(value.args) == 1 and not value.keywords
                and ast.unparse(value.args[0]).endswith(".dtype.element_ty")):
            raise _refuse(declaration, f"the {declaration.store_final} block",
                          f"stores {ast.unparse(value) if value else 'nothing'} instead of a cast to the pointer's "
                          "element type")
        exact = ast.parse(f"kda_cast_bits(X, 0, KDA_DST, KDA_NAN_RULE, KDA_NAN_BITS).to({ast.unparse(value.args[0])},"
                          " bitcast=True)", mode="eval").body
        exact.func.value.args[0] = value.func.value
        # a constexpr choice: an FP32 cache keeps the store as written (FP32 to FP32 is the identity)
        store.args[1] = ast.IfExp(test=ast.parse("KDA_DST == 0", mode="eval").body, body=value, orelse=exact)


def _jit_keywords(definition: ast.FunctionDef, declaration: KernelDeclaration) -> dict[str, Any]:
    for decorator in definition.decorator_list:
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).split(".")[-1] == "jit":
            try:
                return {word.arg: ast.literal_eval(word.value) for word in decorator.keywords}
            except ValueError as error:
                raise _refuse(declaration, "the jit decorator", f"a keyword is not a literal ({error})") from None
    return {}


def edit_kernel_source(source: str, declaration: KernelDeclaration) -> tuple[ast.FunctionDef, dict[str, Any]]:
    """Apply the declared edits to the kernel's source; return the twin's definition and its jit keywords.

    Raises:
        DerivationRefused: the source is not the declared shape (the message names the part).
    """
    if declaration.offset not in OFFSET_FORMS or (declaration.offset == LEADING and not (
            declaration.initial_target and declaration.final_target)):
        raise _refuse(declaration, "the declaration", f"offset {declaration.offset!r} is not a declared shape "
                      f"({', '.join(OFFSET_FORMS)}; {LEADING!r} names both targets)")
    module = ast.parse(source)
    if len(module.body) != 1 or not isinstance(definition := module.body[0], ast.FunctionDef):
        raise _refuse(declaration, "the source", "is not one function definition")
    taken = sorted(name for name in _names(definition) | {a.arg for a in definition.args.args}
                   if name.lower().startswith(TWIN_PREFIX))
    if taken:
        raise _refuse(declaration, "the twin's names", f"{taken} already appear in the source")
    jit_keywords = _jit_keywords(definition, declaration)
    jit_keywords["do_not_specialize"] = [*jit_keywords.get("do_not_specialize", ()), *ROW_ARGUMENTS]
    definition.decorator_list = []
    parameters = [a.arg for a in definition.args.args]
    for pointer in (declaration.initial, declaration.final):
        if pointer not in parameters:
            raise _refuse(declaration, "the parameters", f"no {pointer!r} argument")
    offsets: dict[str, int] = {}
    blocks: dict[str, list[int]] = {declaration.initial: [], declaration.final: []}
    for position, statement in enumerate(definition.body):
        for pointer, guard in ((declaration.initial, declaration.use_initial),
                               (declaration.final, declaration.store_final)):
            if not _guarded_by(statement, guard):
                continue
            target = declaration.target_of(pointer)
            offset = _find_offset(statement, declaration, pointer)
            if offset is not None:
                if pointer in offsets:
                    raise _refuse(declaration, f"the {pointer} offset", "appears twice")
                offsets[pointer] = position
                replaced = _Rename(declaration.packed_row, declaration.head).visit(offset)
                statement.body[0].value = ast.parse(
                    f"{pointer} + kda_safe_row * kda_row_stride + ({ast.unparse(replaced)})", mode="eval").body
                if declaration.offset == LEADING:
                    blocks[pointer].append(position)
                    later = [item for item in statement.body[1:] if pointer in _names(item)]
                    if later:
                        raise _refuse(declaration, "the state pointers", f"{pointer!r} used past its offset to "
                                      f"{target!r}, at `{ast.unparse(later[0]).splitlines()[0]}`")
            elif {pointer, target} & _names(statement):
                blocks[pointer].append(position)
    for pointer in (declaration.initial, declaration.final):
        if pointer not in offsets:
            target = declaration.target_of(pointer)
            where = "alone in its block" if declaration.offset == OWN_BLOCK else "first in the block that uses it"
            raise _refuse(declaration, f"the {pointer} offset", f"no `if GUARD: {target} = {pointer} + <packed row "
                          f"{declaration.packed_row} offset>` {where}")
        if len(blocks[pointer]) != 1:
            raise _refuse(declaration, f"the {pointer} block", f"{len(blocks[pointer])} guarded blocks use it, "
                          "expected exactly one")
    load_at, store_at = blocks[declaration.initial][0], blocks[declaration.final][0]
    if not _calls(definition.body[load_at], "load"):
        raise _refuse(declaration, f"the {declaration.use_initial} block", "loads nothing")
    _exact_store_casts(definition.body[store_at], declaration)
    allowed = {offsets[declaration.initial], offsets[declaration.final], load_at, store_at}
    state_names = {declaration.initial, declaration.final, declaration.target_of(declaration.initial),
                   declaration.target_of(declaration.final)}
    for position, statement in enumerate(definition.body):
        used = _names(statement) & state_names
        if used and position not in allowed:
            raise _refuse(declaration, "the state pointers", f"{sorted(used)} used outside the declared blocks, at "
                          f"`{ast.unparse(statement).splitlines()[0]}`")
    for position, guard in ((load_at, "kda_read"), (store_at, "kda_valid")):
        block = definition.body[position]
        block.body = [ast.If(test=ast.Name(guard, ast.Load()), body=block.body, orelse=[])]
    prelude = ast.parse(
        f"kda_row = tl.load(kda_rows + {declaration.sequence}).to(tl.int64)\n"
        "kda_valid = (kda_row >= 0) & (kda_row < kda_num_rows)\n"
        f"kda_read = kda_valid & (tl.load(kda_flags + {declaration.sequence}).to(tl.int32) != 0)\n"
        "kda_safe_row = tl.where(kda_valid, kda_row, 0)\n").body
    first = min(offsets.values())
    definition.body[first:first] = prelude
    final_at = parameters.index(declaration.final) + 1
    definition.args.args[final_at:final_at] = [ast.arg(name) for name in ROW_ARGUMENTS]
    constexpr = ast.parse("tl.constexpr", mode="eval").body
    definition.args.args.extend(ast.arg(name, annotation=constexpr) for name in CAST_CONSTEXPRS)
    ast.fix_missing_locations(definition)
    return definition, jit_keywords


def twin_cast() -> Any:
    """The exact cast the twin's 16-bit store calls as ``kda_cast_bits``: :func:`~kda_patches.state_copy.casts.
    cast_bits_sliced` where the installed Triton slices tensors in a kernel (triton-ascend), else
    :func:`~kda_patches.state_copy.casts.cast_bits` (mainline Triton on CUDA and its interpreter: one whole-tile pass).
    """
    return cast_bits_sliced if slices_tensors() else cast_bits


def _compile_twin(definition: ast.FunctionDef, namespace: dict[str, Any], filename: str) -> types.FunctionType:
    text = ast.unparse(definition) + "\n"
    # Triton reads a kernel's source through inspect: the twin's text is registered where inspect looks
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    exec(compile(text, filename, "exec"), namespace)
    return namespace[definition.name]


def derive_indexed_kernel(module: types.ModuleType, declaration: KernelDeclaration, host: Any = None
                          ) -> DerivedKernel:
    """Build the indexed twin of ``declaration.kernel`` in ``module`` (the release's loaded kernel module).

    Args:
        module: the loaded module holding the release's kernel.
        declaration: the names of its parts.
        host: the release's own host function (default: ``module``'s attribute, which may be a wrapper of it).
    Returns:
        The :class:`DerivedKernel`.
    Raises:
        DerivationRefused: the kernel or its source is not the declared shape.
    """
    kernel = getattr(module, declaration.kernel, None)
    host = host if host is not None else getattr(module, declaration.host, None)
    if kernel is None or not callable(host):
        raise _refuse(declaration, "the module", f"has no {declaration.kernel} and {declaration.host}")
    try:
        function, configs, heuristics = unwrap_kernel(kernel)
        source = inspect.getsource(function)
    except (TypeError, OSError) as error:
        raise _refuse(declaration, "the kernel object", str(error)) from None
    dedented = inspect.cleandoc("\n" + source) if source.startswith((" ", "\t")) else source
    definition, jit_keywords = edit_kernel_source(dedented, declaration)
    digest = hashlib.sha256(source.encode()).hexdigest()
    namespace = dict(function.__globals__)
    namespace["kda_cast_bits"] = twin_cast()
    filename = f"<kda_patches indexed twin of {declaration.module}.{declaration.kernel} {digest[:12]}>"
    twin = _compile_twin(definition, namespace, filename)
    twin.__module__ = "kda_patches.indexed_chunk.twins"
    jitted = triton.jit(twin, **jit_keywords)
    if heuristics:
        jitted = triton.heuristics(heuristics)(jitted)
    return DerivedKernel(declaration=declaration, host=host, jitted=jitted,
                         arg_names=[a.arg for a in definition.args.args],
                         configs=[{"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages}
                                  for c in configs],
                         heuristics=tuple(heuristics), source=ast.unparse(definition), source_sha256=digest)
