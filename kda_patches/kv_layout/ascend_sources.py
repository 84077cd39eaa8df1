"""Facts a vllm-ascend release states in its source text, read with ``ast`` (nothing executed).

Where the fork or vLLM registers a model architecture, which ``MODELS_CONFIG_MAP`` class hooks a model's config,
and a literal class attribute of a release class. :class:`kda_patches.kv_layout.ascend_stack.AscendStack` uses
these to pick the release definitions it executes.
"""

from __future__ import annotations

import ast
from typing import Any

from kda_patches.kv_layout.release_exec import ReleaseTree


def _assigned_name(node: ast.AST) -> str | None:
    """The name an assignment statement (``x = ...`` or ``x: T = ...``) binds first, or None."""
    target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
    return getattr(target, "id", None)


def find_registered_model(tree: ReleaseTree, architecture: str) -> tuple[str, str] | None:
    """Where the fork (``vllm_ascend/models/__init__.py``) or vLLM's registry puts ``architecture``.

    Args:
        tree: the release pairing's tree (its ``vllm_ascend`` and ``vllm`` roots are read).
        architecture: the model's ``architectures[0]``.

    Returns:
        ``(module, class name)``, the fork's registration first; None when neither registers it.
    """
    fork = tree.roots["vllm_ascend"] / "vllm_ascend/models/__init__.py"
    if fork.is_file():
        for node in ast.walk(ast.parse(fork.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "register_model"
                    and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args)
                    and node.args[0].value == architecture and ":" in node.args[1].value):
                module, _, name = node.args[1].value.partition(":")
                return module, name
    registry = tree.roots["vllm"] / "vllm/model_executor/models/registry.py"
    for node in ast.walk(ast.parse(registry.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == architecture and isinstance(value, ast.Tuple):
                    module, name = (element.value for element in value.elts[:2])
                    return f"vllm.model_executor.models.{module}", name
    return None


def find_config_hook(tree: ReleaseTree, architecture: str) -> str | None:
    """The class name vLLM's ``MODELS_CONFIG_MAP`` (``vllm/model_executor/models/config.py``) maps
    ``architecture`` to.

    Args:
        tree: the release pairing's tree.
        architecture: the model's ``architectures[0]``.

    Returns:
        The class name in ``vllm.model_executor.models.config``, or None when the map has no entry.
    """
    path = tree.roots["vllm"] / "vllm/model_executor/models/config.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and _assigned_name(node) == "MODELS_CONFIG_MAP":
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if getattr(key, "value", None) == architecture:
                    return value.id
    return None


def read_class_constant(tree: ReleaseTree, module: str, class_name: str, name: str) -> Any:
    """A literal class attribute of a release class, read from its source.

    Args:
        tree: the release pairing's tree.
        module, class_name: where the class is defined.
        name: the class attribute.

    Returns:
        The attribute's literal value, or None when the class (or the assignment) is not in the release.
    """
    lazy = tree.lazy_module(module)
    node = lazy.node_of(class_name) if lazy is not None else None
    for child in getattr(node, "body", []):
        if _assigned_name(child) == name and child.value is not None:
            return ast.literal_eval(child.value)
    return None
