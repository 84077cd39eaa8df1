"""Compiling release text at its own file and line numbers, and the names a statement reads while it runs.

Helpers of :mod:`kda_patches.kv_layout.release_exec`: :func:`compile_at` compiles a piece of a release file so
tracebacks point into the release, :func:`definition_time_names` lists the globals a top-level statement reads
at definition time (bound before it runs), and :func:`absolute_name` resolves a relative import.
"""

from __future__ import annotations
import __future__

import ast
import symtable
import types

_FLAGS = __future__.annotations.compiler_flag


def compile_at(source: str, start: int, filename: str) -> types.CodeType:
    """Compile ``source`` as lines ``start``... of ``filename`` (under ``from __future__ import annotations``).

    Args:
        source: release text (one or more whole statements).
        start: the line number of its first line in the release file.
        filename: the release file's path.

    Returns:
        The module code object, ready for ``exec`` in the release module's namespace.
    """
    return compile("\n" * (start - 1) + source, filename, "exec", flags=_FLAGS, dont_inherit=True)


def absolute_name(package: str, module: str | None, level: int) -> str:
    """The absolute module name of ``from <level dots><module> import ...`` inside ``package``.

    Args:
        package: the importing module's package.
        module: the named module ("" or None for ``from . import x``).
        level: the number of leading dots (0: already absolute).

    Returns:
        The absolute module name.
    """
    if not level:
        return module or ""
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{module}" if module else base


def _strip_annotations(tree: ast.AST) -> ast.AST:
    """Remove annotations (never evaluated under ``from __future__ import annotations``) before name analysis."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
                        node.args.kwarg]:
                if arg is not None:
                    arg.annotation = None
        elif isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant(value=None)
    return tree


def definition_time_names(source: str) -> set[str]:
    """Globals a top-level statement reads while it executes (its own code and class bodies, not functions).

    Those are read with ``LOAD_NAME``, which does not consult a namespace's ``__missing__``; function bodies read
    globals with ``LOAD_GLOBAL``, which does, so they resolve lazily.
    """
    table = symtable.symtable(ast.unparse(_strip_annotations(ast.parse(source))), "<release>", "exec")
    found: set[str] = set()

    def visit(scope: symtable.SymbolTable) -> None:
        top = scope.get_type() == "module"
        for symbol in scope.get_symbols():
            if top and symbol.is_referenced() and not symbol.is_assigned() and not symbol.is_imported():
                found.add(symbol.get_name())
            elif not top and symbol.is_referenced() and (symbol.is_global() or not symbol.is_assigned()):
                found.add(symbol.get_name())
        for child in scope.get_children():
            if child.get_type() == "class":
                visit(child)

    visit(table)
    return found
