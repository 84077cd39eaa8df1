"""Named code shapes: what a patch's wrapper relies on in the code it wraps, checked on released source.

A wrapper that routes a copy by intercepting ``recurrent_state[state_indices]`` only works if the wrapped
body still gathers that way; a signature fingerprint cannot see that. A :class:`Shape` is a named predicate
over a release's source (``ast`` only); a patch record lists, per target, the names of the shapes its wrapper
relies on (``Target.shapes``), and ``kda-patches conformance`` checks each one on every release it reads.

The shapes are data: :data:`SHAPES` maps a name to a :class:`Shape` built from a few predicates over the
target's function body (:func:`gathers`, :func:`scatters`, :func:`calls`, :func:`reads_attribute`) or over the
release (:func:`module_exists`, :func:`class_attribute`, :func:`any_calls`, :func:`all_of`), plus
:func:`clears_by_mask` for the native boolean-mask clear. A patch owner adds
a shape by adding one entry here and naming it in the record.

Each predicate returns a :class:`ShapeResult`: ``ok`` and the evidence (``file:line`` of the match, or what was
looked for and where when it is missing), so a report says exactly what changed in a release.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable, Iterator

from kda_patches.releases.source import Definition, ReleaseSource, dotted_name

TYPE_CHECKING = False
if TYPE_CHECKING:
    from kda_patches.registry import Target


@dataclasses.dataclass(frozen=True)
class ShapeResult:
    """The outcome of one shape check: ``ok`` and the evidence (where it matched, or what is missing)."""

    ok: bool
    evidence: str


@dataclasses.dataclass(frozen=True)
class ShapeContext:
    """What a predicate reads: the release, the target (may be None for release-level shapes), its definition."""

    source: ReleaseSource
    target: Target | None
    definition: Definition | None


Predicate = Callable[[ShapeContext], ShapeResult]


@dataclasses.dataclass(frozen=True)
class Shape:
    """A named code shape: ``description`` says in words what it requires; ``predicate`` checks it."""

    name: str
    description: str
    predicate: Predicate

    def check(self, context: ShapeContext) -> ShapeResult:
        """Run the predicate on ``context`` and return its result."""
        return self.predicate(context)


def _where(definition: Definition, node: ast.AST) -> str:
    return f"{definition.relative_path}:{getattr(node, 'lineno', '?')}"


def _body_nodes(context: ShapeContext) -> tuple[Definition, Iterator[ast.AST]] | ShapeResult:
    definition = context.definition
    if definition is None or definition.kind != "function":
        name = context.target.key if context.target is not None else "the target"
        return ShapeResult(False, f"{name} is not a function in this release")
    return definition, ast.walk(definition.node)


def _is_name(node: ast.AST, name: str | None) -> bool:
    return name is None or dotted_name(node) == name


def body_match(match: Callable[[ast.AST], str | None], missing: Callable[[str], str]) -> Predicate:
    """A predicate that holds when ``match`` describes some node of the target function's body.

    Args:
        match: node -> the evidence text when the node is the wanted shape, else None.
        missing: the function's qualname -> what to say when no node matched.
    Returns:
        The predicate; its evidence is ``path:line`` plus ``match``'s text, or ``missing``'s.
    """
    def predicate(context: ShapeContext) -> ShapeResult:
        found = _body_nodes(context)
        if isinstance(found, ShapeResult):
            return found
        definition, nodes = found
        for node in nodes:
            evidence = match(node)
            if evidence is not None:
                return ShapeResult(True, f"{_where(definition, node)} {evidence}")
        return ShapeResult(False, missing(definition.qualname))
    return predicate


def gathers(container: str, index: str) -> Predicate:
    """Body reads ``container[index]`` (a gather by an index tensor), e.g. ``recurrent_state[state_indices]``."""
    def match(node: ast.AST) -> str | None:
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and _is_name(node.value, container) and _is_name(node.slice, index):
            return ast.unparse(node)
        return None
    return body_match(match, lambda qualname: f"no `{container}[{index}]` read in {qualname}")


def scatters(container: str, index: str | None = None) -> Predicate:
    """Body assigns ``container[index] = ...`` (a scatter by index assignment; ``index`` None: any index)."""
    def match(node: ast.AST) -> str | None:
        for target in node.targets if isinstance(node, ast.Assign) else []:
            if isinstance(target, ast.Subscript) and _is_name(target.value, container) \
                    and _is_name(target.slice, index):
                return f"{ast.unparse(target)} = ..."
        return None
    return body_match(match, lambda qualname: f"no `{container}[{index or '...'}] = ...` in {qualname}")


def calls(function: str, args: tuple[str | None, ...] | None = None) -> Predicate:
    """Body calls ``function``; ``args``: the positional arguments' names (None = any expression there)."""
    def match(node: ast.AST) -> str | None:
        if isinstance(node, ast.Call) and dotted_name(node.func) == function and (
                args is None or (len(node.args) == len(args)
                                 and all(_is_name(a, n) for a, n in zip(node.args, args, strict=True)))):
            return ast.unparse(node)
        return None
    wanted = f"{function}({', '.join(a or '_' for a in args)})" if args is not None else f"{function}(...)"
    return body_match(match, lambda qualname: f"no call `{wanted}` in {qualname}")


def scatters_cast_result(container: str, index: str, chunk: str, position: int, final: str = "last_recurrent_state"
                          ) -> Predicate:
    """Body assigns ``final`` from element ``position`` of a call to ``chunk`` and scatters it cast as one
    statement: ``container[index] = final.to(container.dtype)`` (what ``Seam.final`` folds into the scatter)."""
    def unpacked_from_chunk(node: ast.AST) -> bool:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and dotted_name(node.value.func) == chunk):
            return False
        for target in node.targets:
            elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else []
            if len(elements) > position and _is_name(elements[position], final):
                return True
        return False

    def scatter_of_cast(node: ast.AST) -> bool:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and not node.value.keywords
                and len(node.value.args) == 1 and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "to" and _is_name(node.value.func.value, final)
                and dotted_name(node.value.args[0]) == f"{container}.dtype"):
            return False
        return any(isinstance(target, ast.Subscript) and _is_name(target.value, container)
                   and _is_name(target.slice, index) for target in node.targets)

    def predicate(context: ShapeContext) -> ShapeResult:
        found = _body_nodes(context)
        if isinstance(found, ShapeResult):
            return found
        definition, nodes = found
        nodes = list(nodes)
        source = next((node for node in nodes if unpacked_from_chunk(node)), None)
        scatter = next((node for node in nodes if scatter_of_cast(node)), None)
        if source is None or scatter is None:
            missing = [] if source is not None else [f"`..., {final}, ... = {chunk}(...)` (element {position})"]
            missing += [] if scatter is not None else [f"`{container}[{index}] = {final}.to({container}.dtype)`"]
            return ShapeResult(False, f"no {' and no '.join(missing)} in {definition.qualname}")
        return ShapeResult(True, f"{_where(definition, source)} {final} = {chunk}(...)[{position}]; "
                                 f"{_where(definition, scatter)} {ast.unparse(scatter)}")
    return predicate


def _is_mask_clear(target: ast.AST, container: str, flags: str) -> bool:
    """``container[~flags, ...]`` (the ``...`` optional) as an assignment target."""
    if not (isinstance(target, ast.Subscript) and _is_name(target.value, container)):
        return False
    parts = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
    head, rest = parts[0], parts[1:]
    return isinstance(head, ast.UnaryOp) and isinstance(head.op, ast.Invert) and _is_name(head.operand, flags) \
        and all(isinstance(part, ast.Constant) and part.value is Ellipsis for part in rest)


def clears_by_mask(container: str, flags: str) -> Predicate:
    """Body zeroes rows by a negated boolean mask: ``container[~flags, ...] = 0`` (the native clear)."""
    def match(node: ast.AST) -> str | None:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value == 0 \
                and any(_is_mask_clear(target, container, flags) for target in node.targets):
            return ast.unparse(node)
        return None
    return body_match(match, lambda qualname: f"no `{container}[~{flags}, ...] = 0` in {qualname}")


def reads_attribute(dotted: str) -> Predicate:
    """Body reads the attribute chain ``dotted`` (e.g. ``self.kv_cache``)."""
    def match(node: ast.AST) -> str | None:
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and dotted_name(node) == dotted:
            return dotted
        return None
    return body_match(match, lambda qualname: f"no read of `{dotted}` in {qualname}")


def module_exists(module: str) -> Predicate:
    """The release ships module ``module``."""
    def predicate(context: ShapeContext) -> ShapeResult:
        path = context.source.module_path(module)
        return ShapeResult(path is not None, f"{module} is {'shipped' if path else 'absent'}")
    return predicate


def class_attribute(module: str, attribute: str, value: object) -> Predicate:
    """Some class of ``module`` sets ``attribute = value`` (a literal) in its own body."""
    def predicate(context: ShapeContext) -> ShapeResult:
        for info in context.source.classes_defining(module, attribute):
            node = context.source.class_attribute(module, f"{info.name}.{attribute}")
            if isinstance(node, ast.Constant) and node.value == value:
                return ShapeResult(True, f"{module}.{info.name}.{attribute} = {value!r}")
        return ShapeResult(False, f"no class of {module} sets {attribute} = {value!r}")
    return predicate


def any_calls(module: str, qualname: str, function: str) -> Predicate:
    """The function ``module:qualname`` of the release calls ``function`` (any arguments)."""
    check = calls(function)

    def predicate(context: ShapeContext) -> ShapeResult:
        definition = context.source.resolve(module, qualname)
        result = check(ShapeContext(context.source, None, definition))
        if definition is None:
            return ShapeResult(False, f"{module}:{qualname} is absent")
        return result
    return predicate


def all_of(*predicates: Predicate) -> Predicate:
    """Every predicate holds; the evidence lists each (the first missing one first when any is missing)."""
    def predicate(context: ShapeContext) -> ShapeResult:
        results = [check(context) for check in predicates]
        missing = [r.evidence for r in results if not r.ok]
        return ShapeResult(not missing, "; ".join(missing or [r.evidence for r in results]))
    return predicate


def derives_indexed_twin(kernel: str) -> Predicate:
    """The kernel ``kernel`` of the target's module is of the shape :mod:`kda_patches.indexed_chunk.derive` edits
    (its initial/final-state offsets, load and store blocks): the indexed twin can be derived from it."""
    def predicate(context: ShapeContext) -> ShapeResult:
        from kda_patches.indexed_chunk.derive import DerivationRefused, KernelDeclaration, edit_kernel_source

        module = context.definition.module if context.definition is not None else context.target.module
        definition = context.source.resolve(module, kernel)
        if definition is None or not isinstance(definition.node, ast.FunctionDef):
            return ShapeResult(False, f"{module}:{kernel} is absent or not a function")
        try:
            edit_kernel_source(ast.unparse(definition.node), KernelDeclaration(module=module, kernel=kernel,
                                                                               host=context.target.qualname))
        except DerivationRefused as refused:
            return ShapeResult(False, str(refused))
        return ShapeResult(True, f"{definition.relative_path}:{definition.node.lineno} {kernel} derives its twin")
    return predicate


def _shapes(*shapes: Shape) -> dict[str, Shape]:
    return {shape.name: shape for shape in shapes}


_ASCEND_KIMI = "vllm_ascend.ops.kimi_kda"
_RUNNERS = (("vllm_ascend.worker.model_runner_v1", "NPUModelRunner.initialize_kv_cache"),
            ("vllm_ascend.worker.v2.model_runner", "NPUModelRunner.initialize_kv_cache"))

SHAPES: dict[str, Shape] = _shapes(
    Shape("gather:recurrent_state[state_indices]",
          "the prefill gathers the initial state by indexing `recurrent_state[state_indices]`",
          gathers("recurrent_state", "state_indices")),
    Shape("clear:clear_ssm_states(_, has_initial_state)",
          "the prefill clears rows without initial state by calling `clear_ssm_states(gathered, has_initial_state)`",
          calls("clear_ssm_states", (None, "has_initial_state"))),
    Shape("scatter:recurrent_state[state_indices]=",
          "the prefill scatters the final state by index assignment `recurrent_state[state_indices] = ...`",
          scatters("recurrent_state", "state_indices")),
    *(Shape(f"gather:ssm_state[{index}]", f"the prefill gathers the initial state by indexing `ssm_state[{index}]`",
            gathers("ssm_state", index)) for index in ("prefill_state_indices", "non_spec_state_indices_tensor")),
    *(Shape(f"scatter:ssm_state[{index}]=",
            f"the prefill scatters the final state by index assignment `ssm_state[{index}] = ...`",
            scatters("ssm_state", index)) for index in ("prefill_state_indices", "non_spec_state_indices_tensor")),
    *(Shape(f"clear:initial_state[~{flags}, ...]=0",
            f"the prefill clears rows without initial state natively: `initial_state[~{flags}, ...] = 0`",
            clears_by_mask("initial_state", flags)) for flags in ("prefill_has_initial_state", "has_initial_state")),
    Shape("clear:clear_ssm_states(_, prefill_has_initial_state)",
          "the prefill clears rows without initial state by calling "
          "`clear_ssm_states(initial_state, prefill_has_initial_state)`",
          calls("clear_ssm_states", (None, "prefill_has_initial_state"))),
    *(Shape(f"fold:ssm_state[{index}]={chunk}(...)[1].to(ssm_state.dtype)",
            f"the prefill's final state is element 1 of `{chunk}(...)`, scattered cast in one statement "
            f"`ssm_state[{index}] = last_recurrent_state.to(ssm_state.dtype)` (the cast the plan's scatter folds)",
            scatters_cast_result("ssm_state", index, chunk, 1))
      for index, chunk in (("prefill_state_indices", "self.chunk_gated_delta_rule"),
                           ("non_spec_state_indices_tensor", "chunk_gated_delta_rule"),
                           ("prefill_state_indices", "AscendGatedDeltaNetAttention._chunk_gated_delta_rule_fused"))),
    Shape("read:self.kv_cache",
          "the layer reads its cache tensors from `self.kv_cache` (the seam swaps slot 1 for the call)",
          reads_attribute("self.kv_cache")),
    Shape("gather:gather_initial_states(recurrent_state, ...)",
          "the prefill gathers through the module-level `gather_initial_states(recurrent_state, indices, flags)`",
          calls("gather_initial_states", ("recurrent_state", None, None))),
    Shape("gather:gather_ssm_states(ssm_state, ...)",
          "the prefill gathers through the fork's kernel `gather_ssm_states(ssm_state, indices, flags)`",
          calls("gather_ssm_states", ("ssm_state", None, None))),
    Shape("scatter:scatter_ssm_states_(ssm_state, ...)",
          "the prefill scatters through the fork's kernel `scatter_ssm_states_(ssm_state, indices, final)`",
          calls("scatter_ssm_states_", ("ssm_state", None, None))),
    Shape("gather:gather_initial_states(ssm_state, ...)",
          "the prefill gathers through upstream's warmed Triton op `gather_initial_states(ssm_state, indices, "
          "flags)` (vLLM >= 0.34 Qwen GDN)",
          calls("gather_initial_states", ("ssm_state", None, None))),
    *(Shape(f"scatter:scatter_states({state}, ...)",
            f"the prefill scatters through upstream's warmed Triton op `scatter_states({state}, final, indices)` "
            "(vLLM >= 0.34; the cast happens in its store)",
            calls("scatter_states", (state, None, None)))
      for state in ("ssm_state", "recurrent_state")),
    Shape("scatter:recurrent_state[...]=",
          "the prefill scatters the final state by index assignment `recurrent_state[...] = ...`",
          scatters("recurrent_state")),
    Shape("fork:kda_state_copy_plan",
          "the fork ships its own Kimi state-copy plan: `vllm_ascend.ops.kda_state_copy_plan`, a Kimi class with "
          "`_requires_kda_state_copy = True`, and both runners' `initialize_kv_cache` call "
          "`initialize_kda_state_copy`",
          all_of(module_exists("vllm_ascend.ops.kda_state_copy_plan"),
                 class_attribute(_ASCEND_KIMI, "_requires_kda_state_copy", True),
                 *(any_calls(module, qualname, "initialize_kda_state_copy") for module, qualname in _RUNNERS))),
    Shape("verify:npu_reshape_views_bound",
          "a read-only verifier: the fork's `NPUModelRunner.initialize_kv_cache_tensors` builds the KV-cache views "
          "with `self._reshape_kv_cache_tensors` and binds them with `bind_kv_cache`, so the views the wrapper proves "
          "as the reshape returns them are the ones served; proven, they are kept untouched (status: \"upstream "
          "layout proven\"); an overlap or a view out of its storage refuses to start (verdicts per model and TP: "
          "docs/results/ascend-kv-layout/README.md)",
          all_of(*(any_calls(_RUNNERS[0][0], "NPUModelRunner.initialize_kv_cache_tensors", function)
                   for function in ("self._reshape_kv_cache_tensors", "bind_kv_cache")))),
    Shape("verify:extend_kv_cache_binds_committed_views",
          "a read-only verifier: vLLM's `extend_kv_cache` rebuilds the layers' views over the committed bytes with "
          "`kv_cache.committed_views` and binds them with `bind_kv_caches`, so the views the wrapper proves after it "
          "returns are the ones served; proven, nothing changes (status: \"upstream layout proven\"); an overlap or "
          "a view out of its storage refuses to go on (verdicts per model and TP, before and after the rebind: "
          "docs/results/ascend-kv-layout/README.md)",
          all_of(*(any_calls("vllm.v1.worker.extensible_kv_cache", "extend_kv_cache", function)
                   for function in ("kv_cache.committed_views", "bind_kv_caches")))),
    Shape("indexed:chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
          "the chunk-state kernel beside the wrapped host function has the declared shape (dense `h0`/`ht` offset by "
          "the packed row, a guarded load block and a guarded store block casting to the pointer's element type), "
          "so its indexed twin is derived from it (KDA_PATCHES_STATE_IO=indexed)",
          derives_indexed_twin("chunk_gated_delta_rule_fwd_kernel_h_blockdim64")),
    Shape("unpads:m.unpadded(_, num_actual_reqs)",
          "the GDN builder builds from the first `num_actual_reqs` rows only (`m = m.unpadded(..., num_actual_reqs)`), "
          "as gdn_host_flags' flags do",
          calls("m.unpadded", (None, "num_actual_reqs"))),
)


def check_shape(name: str, source: ReleaseSource, target: Target | None = None,
                definition: Definition | None = None) -> ShapeResult:
    """Check the registered shape ``name`` on a release (for ``target`` and its resolved ``definition``).

    Raises:
        KeyError: ``name`` is not in :data:`SHAPES` (the message lists the known names).
    """
    shape = SHAPES.get(name)
    if shape is None:
        raise KeyError(f"unknown code shape {name!r}; known shapes: {sorted(SHAPES)}")
    return shape.check(ShapeContext(source, target, definition))
