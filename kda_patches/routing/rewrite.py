"""Rewrite a seam's released function once, at apply time, so its state copy calls the plan directly.

The routed alias (:mod:`kda_patches.routing.alias`) finds the fork's gather, clear, scatter and cast at run
time through tensor subclasses, and pays for that in every call (several times the twin's host time on a GPU
host, ``docs/results/route-host-costs/``). The
copy lines of a released seam are known statically: ``kda-patches conformance`` already checks their
shapes. This module reads the function's source, finds exactly those lines, and compiles a twin of the
function in which they call the call's :class:`~kda_patches.routing.direct.DirectRoute` instead:

- the **gather** ``X = S[I]`` -- optionally followed by row-preserving ``.contiguous()`` /
  ``.transpose(-1, -2)`` -- becomes ``X = _kda_route.gather(S, I, F)``; with a declared gather function,
  ``X = G(S, I, F)`` becomes ``X = _kda_route.gather_function(G, S, I, F)`` (keywords: only ``output_dtype=``,
  passed on and checked per call; a seam with a gather function rewrites index gathers too only when it also
  declares a scatter function);
- the **clear** that directly follows a subscript gather is removed and its flags ``F`` go to the gather,
  only when it is exactly ``X[~F, ...] = 0`` / ``X[~F] = 0`` (native) or ``clear_function(X, F)``, and ``F``
  does not read ``X``; when the flags cannot be folded at run time the route runs that clear as written
  (the function clear through the name the fork's call would have looked up);
- the **scatter** ``S[J] = V`` becomes ``_kda_route.scatter(S, J, V)``, or, where the seam declares its
  final state (``Seam.final``, the seams whose alias folds the cast) and ``V`` is ``E.to(S.dtype)`` of a
  plain name ``E``, ``_kda_route.scatter_cast(S, J, E)`` (the plan casts inside its copy). A cast of an
  expression (vllm-ascend's ``last.transpose(-1, -2).contiguous().to(...)``) or to any other dtype stays
  as written; with a declared scatter function (vllm-ascend 0.30's ``scatter_ssm_states_``), the statement
  ``F(S, J, V)`` becomes ``_kda_route.scatter_function(F, S, J, V)`` (``F(S, V, J)``, vLLM 0.34's
  ``scatter_states``, ``_kda_route.scatter_function_value_first(F, S, V, J)``). Such a seam has no alias: when its
  rewrite is refused, the routing fact warns that every prefill call will be reported bypassed.

A re-application of the same function (revert, register again) reuses its twin (:func:`build_twin`).

The twin has the original's globals (the module's live namespace), defaults, name and line numbers, plus one
positional-only first parameter ``_kda_route``: ``twin(route, self, *args, **kwargs)``. A function this
module cannot rewrite exactly -- no source, a closure (``super()``), a decorator that returned another
object (an eager-break decorator of :data:`EAGER_BREAK_WRAPPERS` is not: the twin is built from the function it
wrapped and the seam's wrapper re-applies the decorator, :func:`find_eager_break`), a name-mangled
identifier, a source file that no longer compiles to the loaded function's bytecode, a clear that is not the
folded form, another index read or write of the cache -- is refused with the reason; the seam then routes
through the alias, and the ledger fact ``routing <target>`` of the seam's section says which mechanism each
seam runs.
"""

from __future__ import annotations

import ast
import inspect
import types
from typing import Any

from kda_patches.routing.seams import CLEAR_FUNCTION, CLEAR_NATIVE, CLEAR_NONE, Argument, Seam, capture_section

ROUTE_PARAMETER = "_kda_route"
_SCOPE = "_kda_class_scope"  # the class body a method's source is parsed in
_ROW_PRESERVING = ("contiguous", "transpose")
# keywords a declared gather function may be called with: vllm-ascend 0.30's gather_ssm_states(..., output_dtype=)
# gathers into another dtype; the route sends it to the plan only when that is the cache's own dtype
GATHER_KEYWORDS = ("output_dtype",)
_FUTURE_FLAGS = 0
for _feature in ("annotations", "division", "generator_stop"):
    import __future__

    _FUTURE_FLAGS |= getattr(__future__, _feature).compiler_flag


# decorators that make a function an eager break of vLLM's breakable CUDA-graph capture (a capture records a
# closure over the *undecorated* function and replays that, so a wrapper around the decorated one is never reached
# again): ``module:qualname`` of the wrapper the decorator returns -> the decorator's name in that module. A seam's
# wrapper re-applies the decorator to its own routed entry (:func:`find_eager_break`), so what a capture records
# and replays is the routed call.
EAGER_BREAK_WRAPPERS = {
    "vllm.compilation.breakable_cudagraph:eager_break_during_capture.<locals>.wrapper": "eager_break_during_capture",
}


class EagerBreak:
    """A seam function as an eager-break decorator returned it.

    Attributes:
        decorator: the decorator itself, found in the wrapper's own module (its code holds the wrapper's).
        inner: the undecorated function the wrapper calls (what a capture records; the twin is built from it).
        name: ``module.decorator`` (ledger).
    """

    __slots__ = ("decorator", "inner", "name")

    def __init__(self, decorator: Any, inner: types.FunctionType, name: str) -> None:
        self.decorator = decorator
        self.inner = inner
        self.name = name


def find_eager_break(function: Any) -> EagerBreak | None:
    """Return how ``function`` was made an eager break, or None when it is not a declared decorator's wrapper.

    The decorator is read from the function object: its code is one of :data:`EAGER_BREAK_WRAPPERS`, the
    decorator of that name in the wrapper's module made it (the wrapper's code is a constant of the decorator's),
    and the function its closure calls is its ``__wrapped__``. A wrapper that does not prove all three is
    treated as any other decorated function (no twin; under capture its calls are reported bypassed).
    """
    if type(function) is not types.FunctionType:
        return None
    module = function.__globals__.get("__name__")
    name = EAGER_BREAK_WRAPPERS.get(f"{module}:{function.__code__.co_qualname}")
    if name is None:
        return None
    decorator = function.__globals__.get(name)
    inner = getattr(function, "__wrapped__", None)
    cells = [cell.cell_contents for cell in function.__closure__ or ()]
    if (type(decorator) is not types.FunctionType or function.__code__ not in decorator.__code__.co_consts
            or type(inner) is not types.FunctionType or not any(inner is value for value in cells)):
        return None
    return EagerBreak(decorator, inner, f"{module}.{name}")


class RewriteRefused(Exception):
    """The function's source is not exactly the declared seam; the message says what differs.

    Attributes:
        clear_not_folded: the refusal is that a gather is not followed by the declared clear: the alias must
            then not fold the clear into its gather either (its fold is speculative: it hands the flags to the
            gather before it sees the clear), and the fork's own clear runs.
    """

    def __init__(self, message: str, clear_not_folded: bool = False) -> None:
        super().__init__(message)
        self.clear_not_folded = clear_not_folded


class Rewritten:
    """A seam function's rewritten twin and what was replaced.

    Attributes:
        function: the twin (takes the call's route first, then the original's arguments).
        replaced: ``"line N: <kind>"`` per rewritten statement (ledger, doctor).
    """

    __slots__ = ("function", "replaced")

    def __init__(self, function: types.FunctionType, replaced: list[str]) -> None:
        self.function = function
        self.replaced = replaced


def _route_call(method: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Attribute(value=ast.Name(id=ROUTE_PARAMETER, ctx=ast.Load()), attr=method,
                                       ctx=ast.Load()), args=list(args), keywords=[])


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _names_in(node: ast.AST) -> set[str]:
    return {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}


def _single_index(node: ast.Subscript) -> ast.expr | None:
    """The index expression of ``S[I]`` when it is one plain expression (not a slice or a tuple)."""
    index = node.slice
    return None if isinstance(index, (ast.Slice, ast.Tuple, ast.Starred)) else index


def _unwrap_row_preserving(value: ast.expr) -> tuple[ast.expr, list[ast.Call]]:
    """Peel ``.contiguous()`` / ``.transpose(-1, -2)`` calls off ``value``; return the core and the chain."""
    chain = []
    while (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and not value.keywords
           and value.func.attr in _ROW_PRESERVING):
        if value.func.attr == "contiguous" and value.args:
            break
        if value.func.attr == "transpose" and not _swaps_last_two(value.args):
            break
        chain.append(value)
        value = value.func.value
    return value, chain


def _swaps_last_two(args: list[ast.expr]) -> bool:
    values = []
    for arg in args:
        if not (isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub) and isinstance(arg.operand, ast.Constant)
                and type(arg.operand.value) is int):
            return False
        values.append(-arg.operand.value)
    return sorted(values) == [-2, -1]


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 0


def _native_clear_flags(statement: ast.stmt, packed: str) -> ast.expr | None:
    """``F`` when ``statement`` is ``packed[~F, ...] = 0`` or ``packed[~F] = 0``, else None."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1 and _is_zero(statement.value)):
        return None
    target = statement.targets[0]
    if not (isinstance(target, ast.Subscript) and _is_name(target.value, packed)):
        return None
    key = target.slice
    if isinstance(key, ast.Tuple):
        if len(key.elts) != 2 or not (isinstance(key.elts[1], ast.Constant) and key.elts[1].value is Ellipsis):
            return None
        key = key.elts[0]
    if isinstance(key, ast.UnaryOp) and isinstance(key.op, ast.Invert):
        return key.operand
    return None


def _function_clear_flags(statement: ast.stmt, packed: str, clear_function: str) -> ast.expr | None:
    """``F`` when ``statement`` is ``clear_function(packed, F)``, else None."""
    if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
        return None
    call = statement.value
    if not (_is_name(call.func, clear_function) and len(call.args) == 2 and not call.keywords
            and _is_name(call.args[0], packed)):
        return None
    return call.args[1]


def _scatter_function_call(seam: Seam, node: ast.AST) -> ast.Call | None:
    """The call of a statement ``scatter_function(S, J, V)`` (three positional arguments, ``S`` a name), or None."""
    if seam.scatter_function is None or not isinstance(node, ast.Expr):
        return None
    call = node.value
    if (isinstance(call, ast.Call) and _is_name(call.func, seam.scatter_function) and len(call.args) == 3
            and not call.keywords and isinstance(call.args[0], ast.Name)
            and not any(isinstance(arg, ast.Starred) for arg in call.args)):
        return call
    return None


def _gather_function_call(seam: Seam, value: ast.expr, state: str) -> ast.Call | None:
    """``G(S, I, F)`` of the declared gather function on the cache, optionally with ``output_dtype=``, or None."""
    if not (seam.gather_function is not None and isinstance(value, ast.Call)
            and _is_name(value.func, seam.gather_function) and len(value.args) == 3
            and _is_name(value.args[0], state) and not any(isinstance(arg, ast.Starred) for arg in value.args)):
        return None
    if all(keyword.arg in GATHER_KEYWORDS for keyword in value.keywords):
        return value
    return None


def _find_state_name(seam: Seam, tree: ast.FunctionDef) -> str | None:
    """The name the cache goes by: the declared argument's, else the one name both gathered and scattered.

    A cache slot is bound in many ways (``ssm_state = self_kv_cache[1]``, ``conv, state = self.kv_cache[:2]``),
    so the name is read off the copy statements themselves: the one name passed first to both declared copy
    functions, else the only name that is written as ``S[J] = V`` and read as ``X = S[I]`` (or passed first to
    the declared gather function). The route checks at run time that
    the object under that name *is* the layer's cache; anything else is copied natively and reported.
    """
    if isinstance(seam.state, Argument):
        return seam.state.name
    written, read = set(), set()
    by_function: tuple[set[str], set[str]] = (set(), set())  # passed first to the declared gather / scatter function
    for node in ast.walk(tree):
        if _scatter_function_call(seam, node) is not None:
            written.add(node.value.args[0].id)
            by_function[1].add(node.value.args[0].id)
            continue
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            written.add(target.value.id)
        elif isinstance(target, ast.Name):
            value = node.value
            if (seam.gather_function is not None and isinstance(value, ast.Call)
                    and _is_name(value.func, seam.gather_function) and value.args
                    and isinstance(value.args[0], ast.Name)):
                read.add(value.args[0].id)
                by_function[0].add(value.args[0].id)
            core, _chain = _unwrap_row_preserving(value)
            subscripts = seam.gather_function is None or seam.scatter_function is not None
            if subscripts and isinstance(core, ast.Subscript) and isinstance(core.value, ast.Name):
                read.add(core.value.id)
    named = by_function[0] & by_function[1]
    if len(named) == 1:  # the one name both declared copy functions take first (vLLM 0.34's upstream ops)
        return named.pop()
    names = written & read
    return names.pop() if len(names) == 1 else None


class _SeamRewriter:
    """Finds and replaces the copy statements of one function body (see the module docstring)."""

    def __init__(self, seam: Seam, state: str) -> None:
        self.seam = seam
        self.state = state
        self.replaced: list[str] = []
        self.gathers = self.scatters = self.clears = 0

    def rewrite_block(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        skip = False
        for position, statement in enumerate(body):
            if skip:
                skip = False
                continue
            following = body[position + 1] if position + 1 < len(body) else None
            replacement, consumed_next = self.rewrite_statement(statement, following)
            out.append(replacement)
            skip = consumed_next
        return out

    def rewrite_statement(self, statement: ast.stmt, following: ast.stmt | None) -> tuple[ast.stmt, bool]:
        for field in ("body", "orelse", "finalbody"):
            block = getattr(statement, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                setattr(statement, field, self.rewrite_block(block))
        for handler in getattr(statement, "handlers", ()) or ():
            handler.body = self.rewrite_block(handler.body)
        scatter_call = _scatter_function_call(self.seam, statement)
        if scatter_call is not None and _is_name(scatter_call.args[0], self.state):
            method = "scatter_function_value_first" if self.seam.scatter_value_first else "scatter_function"
            statement.value = _route_call(method, scatter_call.func, *scatter_call.args)
            self.scatters += 1
            self.replaced.append(f"line {statement.lineno}: {self.seam.scatter_function} call")
            return statement, False
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
            if isinstance(target, ast.Subscript) and _is_name(target.value, self.state):
                return self.rewrite_scatter(statement, target), False
            if isinstance(target, ast.Name):
                return self.rewrite_gather(statement, target.id, following)
        return statement, False

    def rewrite_scatter(self, statement: ast.Assign, target: ast.Subscript) -> ast.stmt:
        index = _single_index(target)
        if index is None:
            raise RewriteRefused(f"line {statement.lineno}: the cache is written as {ast.unparse(target)} "
                                 "(not one index vector)")
        value = statement.value
        if (self.seam.final is not None and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                and value.func.attr == "to" and isinstance(value.func.value, ast.Name) and len(value.args) == 1
                and not value.keywords and isinstance(value.args[0], ast.Attribute)
                and value.args[0].attr == "dtype" and _is_name(value.args[0].value, self.state)):
            call = _route_call("scatter_cast", ast.Name(id=self.state, ctx=ast.Load()), index, value.func.value)
            kind = "scatter with the cast to the cache dtype folded"
        else:
            call = _route_call("scatter", ast.Name(id=self.state, ctx=ast.Load()), index, value)
            kind = "scatter"
        self.scatters += 1
        self.replaced.append(f"line {statement.lineno}: {kind}")
        return ast.copy_location(ast.Expr(value=call), statement)

    def rewrite_gather(self, statement: ast.Assign, packed: str, following: ast.stmt | None) -> tuple[ast.stmt, bool]:
        seam = self.seam
        value = statement.value
        gather_call = _gather_function_call(seam, value, self.state)
        if gather_call is not None:
            statement.value = _route_call("gather_function", gather_call.func, *gather_call.args)
            statement.value.keywords = gather_call.keywords
            self.gathers += 1
            self.replaced.append(f"line {statement.lineno}: {seam.gather_function} call"
                                 + (" (" + ", ".join(f"{k.arg}=" for k in gather_call.keywords) + " checked per call)"
                                    if gather_call.keywords else ""))
            return statement, False
        if seam.gather_function is not None and seam.scatter_function is None:
            return statement, False
        core, _chain = _unwrap_row_preserving(value)
        if not (isinstance(core, ast.Subscript) and _is_name(core.value, self.state)):
            return statement, False
        index = _single_index(core)
        if index is None:
            raise RewriteRefused(f"line {statement.lineno}: the cache is read as {ast.unparse(core)} "
                                 "(not one index vector)")
        flags = None
        if following is not None and seam.clear == CLEAR_NATIVE:
            flags = _native_clear_flags(following, packed)
        elif following is not None and seam.clear == CLEAR_FUNCTION:
            flags = _function_clear_flags(following, packed, seam.clear_function)
        if seam.clear != CLEAR_NONE and (flags is None or packed in _names_in(flags)):
            raise RewriteRefused(f"line {statement.lineno}: the gather into {packed!r} is not directly followed "
                                 f"by the declared clear ({_describe_clear(seam, packed)}); it cannot be folded",
                                 clear_not_folded=True)
        clear = [following.value.func] if flags is not None and seam.clear == CLEAR_FUNCTION else []
        replacement = _route_call("gather", ast.Name(id=self.state, ctx=ast.Load()), index,
                                  flags if flags is not None else ast.Constant(value=None), *clear)
        if _chain:  # the row-preserving calls stay, applied to the plan's (row-cleared) result
            _chain[-1].func.value = replacement
        else:
            statement.value = replacement
        self.gathers += 1
        self.replaced.append(f"line {statement.lineno}: gather" + (" with the clear folded" if flags else ""))
        if flags is not None:
            self.clears += 1
            self.replaced.append(f"line {following.lineno}: clear removed (folded into the gather)")
            return statement, True
        return statement, False


def _describe_clear(seam: Seam, packed: str) -> str:
    if seam.clear == CLEAR_NATIVE:
        return f"{packed}[~flags, ...] = 0"
    return f"{seam.clear_function}({packed}, flags)"


def _check_remaining(tree: ast.FunctionDef, state: str) -> None:
    """Refuse when the cache is still indexed anywhere after the rewrite (a copy the plan would not see)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_name(node.value, state):
            raise RewriteRefused(f"line {node.lineno}: the cache is also indexed as {ast.unparse(node)}, "
                                 "which is not a declared gather or scatter")
        if isinstance(node, ast.AugAssign) and _is_name(node.target, state):
            raise RewriteRefused(f"line {node.lineno}: the cache is updated in place with an operator")


def check_class_scope_names(definition: ast.FunctionDef, qualname: str) -> None:
    """Refuse names that mean something else outside the class body the function was compiled in.

    Raises:
        RewriteRefused: a private (name-mangled) identifier, or ``super`` / ``__class__`` (a closure cell).
    """
    for node in ast.walk(definition):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name is not None and name.startswith("__") and not name.endswith("__"):
            raise RewriteRefused(f"line {node.lineno}: {name} is name-mangled in a class body")
        if isinstance(node, ast.Name) and node.id in ("super", "__class__"):
            raise RewriteRefused(f"{qualname} closes over __class__ (line {node.lineno}: {node.id}); "
                                 "a recompiled twin cannot share its cells")


def plan_rewrite(definition: ast.FunctionDef, seam: Seam, qualname: str) -> list[str]:
    """Rewrite a seam function's definition in place (the source-level half of the rewrite) and say what changed.

    Used by :func:`rewrite_seam_function` on the installed function's source, and by ``kda-patches conformance``
    on a release's file (with that file's line numbers), so both give the same verdict for the same source.

    Args:
        definition: the function's ``def`` node (line numbers as in its file).
        seam: its declaration.
        qualname: the function's qualified name (messages).
    Returns:
        ``"line N: <kind>"`` per rewritten statement.
    Raises:
        RewriteRefused: the body is not exactly the declared seam (the message says where).
    """
    arguments = definition.args
    every_argument = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                      *(a for a in (arguments.vararg, arguments.kwarg) if a is not None)]
    check_class_scope_names(definition, qualname)
    if any(a.arg == ROUTE_PARAMETER for a in every_argument):
        raise RewriteRefused(f"{qualname} already has a parameter named {ROUTE_PARAMETER}")
    state = _find_state_name(seam, definition)
    if state is None:
        raise RewriteRefused(f"{qualname}: no one name is both read as X = S[I] (or passed first to the declared "
                             "gather function) and written as S[J] = V, so the cache's name is unknown "
                             f"({seam.state!r})")
    rewriter = _SeamRewriter(seam, state)
    definition.body = rewriter.rewrite_block(definition.body)
    if rewriter.gathers == 0 or rewriter.scatters == 0:
        raise RewriteRefused(f"{qualname}: found {rewriter.gathers} gather(s) and {rewriter.scatters} "
                             f"scatter(s) of {state!r} of the declared forms, expected at least one of each")
    _check_remaining(definition, state)
    arguments.posonlyargs.insert(0, ast.arg(arg=ROUTE_PARAMETER))  # first: a positional pass costs no dict
    return rewriter.replaced


def rewrite_seam_function(function: Any, seam: Seam) -> Rewritten:
    """Return the rewritten twin of a seam's released function.

    Args:
        function: the plain function (a class ``__dict__`` entry) the seam's wrapper wraps.
        seam: its declaration (state, clear form, gather function).
    Returns:
        The :class:`Rewritten` twin.
    Raises:
        RewriteRefused: the function is not exactly the declared seam (the message says where).
    """
    if type(function) is not types.FunctionType:  # a proxy (another wrapper) passes isinstance
        raise RewriteRefused(f"{function!r} is not a plain function")
    code = function.__code__
    if code.co_freevars:
        raise RewriteRefused(f"{function.__qualname__} closes over {', '.join(code.co_freevars)} (e.g. super()); "
                             "a recompiled twin cannot share its cells")
    try:
        lines, first_line = inspect.getsourcelines(function)
    except (OSError, TypeError) as error:
        raise RewriteRefused(f"no source for {function.__qualname__}: {error}") from None
    source = "".join(lines)
    # a method's source is indented: parse it inside a class body, as it was compiled (dedenting the text
    # would change its docstring and every other multi-line string constant)
    indented = source[:1] in (" ", "\t")
    module = ast.parse(f"class {_SCOPE}:\n{source}" if indented else source)
    container = module.body[0] if len(module.body) == 1 else None
    body = container.body if indented and isinstance(container, ast.ClassDef) else [container]
    definition = body[0] if len(body) == 1 else None
    if not isinstance(definition, ast.FunctionDef) or definition.name != function.__name__:
        raise RewriteRefused(f"the source of {function.__qualname__} is not one function definition")
    if definition.decorator_list and (hasattr(function, "__wrapped__") or code.co_firstlineno != first_line):
        # a decorator that returned another object: the twin would drop what it adds
        raise RewriteRefused(f"{function.__qualname__} is wrapped by a decorator; the twin would drop it")
    definition.decorator_list = []  # each decorator returned the function itself: nothing to keep
    ast.increment_lineno(module, first_line - (2 if indented else 1))
    # the module's imports go first (not run: only compiled): CPython compiles a call of an imported module's
    # attribute differently from other globals, and the twin must compile to the loaded function's bytecode
    module.body[:0] = module_imports(code.co_filename)
    check_class_scope_names(definition, function.__qualname__)  # before the bytecode comparison they would fail
    flags = code.co_flags & _FUTURE_FLAGS
    if not _same_code(code, _compiled_function(module, code.co_filename, flags, function.__name__)):
        raise RewriteRefused(f"the source of {function.__qualname__} in {code.co_filename} does not compile to the "
                             "loaded function (the file changed after import, or it is not what runs)")
    replaced = plan_rewrite(definition, seam, function.__qualname__)
    ast.fix_missing_locations(module)
    twin_code = _compiled_function(module, code.co_filename, flags, function.__name__)
    twin = types.FunctionType(twin_code, function.__globals__, function.__name__, function.__defaults__)
    twin.__kwdefaults__ = function.__kwdefaults__
    twin.__qualname__ = function.__qualname__
    twin.__module__ = function.__module__
    twin.__doc__ = function.__doc__
    twin.__annotations__ = dict(getattr(function, "__annotations__", {}))
    twin.__dict__.update(function.__dict__)
    twin.__kda_original__ = function
    return Rewritten(twin, replaced)


def module_imports(filename: str) -> list[ast.stmt]:
    """Return the module-level ``import`` statements of ``filename`` (through ``if``/``try`` blocks; no
    ``__future__`` import: those are compiler flags), as ``linecache`` holds the file (what inspect read)."""
    import linecache

    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except SyntaxError:
        return []
    found: list[ast.stmt] = []
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                found.append(node)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            pending[:0] = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                           *(item for handler in getattr(node, "handlers", []) for item in handler.body)]
    return found


def _compiled_function(module: ast.Module, filename: str, flags: int, name: str) -> types.CodeType:
    """Compile a module holding one function (at its top or in the :data:`_SCOPE` class) and return its code."""
    compiled = compile(module, filename, "exec", flags=flags, dont_inherit=True)
    for code in compiled.co_consts:
        if isinstance(code, types.CodeType) and code.co_name == _SCOPE:
            compiled = code
            break
    return next(c for c in compiled.co_consts if isinstance(c, types.CodeType) and c.co_name == name)


def _same_code(loaded: types.CodeType, compiled: types.CodeType) -> bool:
    """Whether two code objects run the same bytecode on the same names and constants (nested code included)."""
    if (loaded.co_code != compiled.co_code or loaded.co_names != compiled.co_names
            or loaded.co_varnames != compiled.co_varnames or loaded.co_freevars != compiled.co_freevars):
        return False
    if len(loaded.co_consts) != len(compiled.co_consts):
        return False
    for a, b in zip(loaded.co_consts, compiled.co_consts, strict=True):
        if isinstance(a, types.CodeType) or isinstance(b, types.CodeType):
            if not (isinstance(a, types.CodeType) and isinstance(b, types.CodeType) and _same_code(a, b)):
                return False
        elif type(a) is not type(b) or repr(a) != repr(b):  # repr: -0.0 vs 0.0, NaN, nested tuples
            return False
    return True


def predict_mechanism(definition: ast.AST, seam: Seam, qualname: str) -> dict[str, Any]:
    """Return which mechanism a seam will run on a release, read from its source (``kda-patches conformance``).

    Args:
        definition: the function's node in the release's file (left unchanged: a copy is rewritten).
        seam: its declaration.
        qualname: the function's qualified name.
    Returns:
        ``{"mechanism": "rewrite", "replaced": [...]}`` or ``{"mechanism": "alias", "reason": ...}``, with
        ``"eager_break": <decorator name>`` where the definition carries a declared eager-break decorator
        (:data:`EAGER_BREAK_WRAPPERS`: the seam is then reached through that decorator re-applied), and
        ``"backends"`` where the seam routes only some prefill backends (its ``BackendGate``). Any other
        decorator is read as returning the function itself (the live check decides the rest at wrap time).
    """
    import copy

    if not isinstance(definition, ast.FunctionDef):
        return {"mechanism": "alias", "reason": f"not rewritten: {qualname} is not a function definition"}
    breaks = sorted(set(EAGER_BREAK_WRAPPERS.values()) & {_decorator_name(node) for node in definition.decorator_list})
    reached: dict[str, Any] = {"eager_break": breaks[0]} if breaks else {}  # how calls reach the seam
    if seam.backend is not None:
        reached["backends"] = {"attribute": seam.backend.attribute, "routed": list(seam.backend.routed),
                               "stands_aside": seam.backend.reason}
    try:
        return {"mechanism": "rewrite", "replaced": plan_rewrite(copy.deepcopy(definition), seam, qualname),
                **reached}
    except RewriteRefused as refusal:
        return {"mechanism": "alias", "reason": f"not rewritten: {refusal}", **reached}


def _decorator_name(node: ast.expr) -> str:
    """The last name of a decorator expression (``@a.b`` -> ``b``; a call's callee), or ``""``."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


# twins already built, by original function: a re-application (revert, then register again: A/B switching in one
# process) reuses the twin, already warmed up by the interpreter, as long as the function is what it was built from
_BUILT: dict[int, tuple[Any, Any, Any, Seam, Rewritten]] = {}


def build_twin(original: Any, seam: Seam) -> Rewritten:
    """Return the twin of ``original`` for ``seam``: the one built before for the same function, code object,
    defaults and declaration, else a new one (:func:`rewrite_seam_function`, which may refuse)."""
    built = _BUILT.get(id(original))
    if (built is not None and built[0] is original and built[1] is getattr(original, "__code__", None)
            and built[2] is getattr(original, "__defaults__", None) and built[3] is seam):
        return built[4]
    rewritten = rewrite_seam_function(original, seam)
    _BUILT[id(original)] = (original, original.__code__, original.__defaults__, seam, rewritten)
    return rewritten


def prepare_rewrite(rewrites: dict[Any, Any], unfolded: set[Any], seam: Seam, key: str, original: Any,
                    eager_break: str | None = None) -> str:
    """Build the twin of a just-wrapped seam function into ``rewrites`` (or record why it routes by alias).

    Called once when the registry wraps the function (``SeamWrapper.on_apply``); never raises: a refusal
    or an unexpected error leaves the seam on the routed alias, and the ledger fact
    ``<seam section> / routing <key>`` says which mechanism runs and why. ``KDA_PATCHES_ROUTING=alias`` is
    refused (fact ``alias_refused``) on a seam that declares a scatter function: no alias routes it. A refusal
    because a gather is not
    followed by the declared clear also puts ``original`` into ``unfolded``: its alias then gathers without the
    flags and the fork's own clear runs (fact ``clear_folded: false``).

    Args:
        rewrites: the wrapper's ``{original function: twin}`` table.
        unfolded: the wrapper's set of functions whose alias must not fold the clear.
        seam: the declaration.
        key: the target's ``module:qualname`` (the fact's name).
        original: what the registry wrapped (a class ``__dict__`` entry), or the function an eager-break
            decorator wrapped (then ``eager_break`` names the decorator).
        eager_break: ``module.decorator`` re-applied to the routed entry, or None; recorded in the fact.
    Returns:
        ``"rewrite"`` or ``"alias"``.
    """
    from kda_patches import current_flags, get_ledger

    fact: dict[str, Any]
    alias_refused = None
    if current_flags().routing == "alias" and seam.scatter_function is not None:
        # no alias routes a declared scatter function (vLLM 0.34's scatter_states, vllm-ascend 0.30's
        # scatter_ssm_states_): the alias would hand its RoutedCache to upstream's startup-warmed Triton ops -- a
        # subclass they were not warmed for -- and report every call bypassed
        alias_refused = (f"KDA_PATCHES_ROUTING=alias refused on this seam: no alias routes {seam.gather_function} / "
                         f"{seam.scatter_function} (upstream's warmed ops would get the alias's tensor subclass and "
                         "every call would be bypassed); routed by the rewritten twin instead")
    if current_flags().routing == "alias" and alias_refused is None:
        fact = {"mechanism": "alias", "reason": "KDA_PATCHES_ROUTING=alias"}
    else:
        try:
            rewritten = build_twin(original, seam)
        except RewriteRefused as refusal:
            fact = {"mechanism": "alias", "reason": f"not rewritten: {refusal}"}
            if refusal.clear_not_folded:
                unfolded.add(original)
                fact["clear_folded"] = False
        except Exception as error:  # a rewrite bug must not cost the seam its routing
            fact = {"mechanism": "alias", "reason": f"rewrite failed: {type(error).__name__}: {error}"}
        else:
            rewrites[original] = rewritten.function
            fact = {"mechanism": "rewrite", "replaced": rewritten.replaced}
        if alias_refused is not None:
            fact["alias_refused"] = alias_refused
    if fact["mechanism"] == "alias" and seam.scatter_function is not None:
        fact["warning"] = (f"no alias routes {seam.gather_function} / {seam.scatter_function}: every prefill call of "
                           "this seam runs the fork's kernels and is reported bypassed (raises under STRICT); "
                           "it is routed only by the rewritten twin (KDA_PATCHES_ROUTING=rewrite)")
    if eager_break is not None:
        fact["eager_break"] = (f"{eager_break} re-applied to the routed call: a breakable CUDA-graph capture records "
                               "and replays it (replays routed and counted; capture-time calls counted in "
                               f"{capture_section(seam.section)})")
    get_ledger().set_fact(seam.section, f"routing {key}", {"seam": seam.name, **fact})
    return fact["mechanism"]
