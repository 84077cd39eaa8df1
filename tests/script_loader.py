"""Load a script of ``scripts/`` as a module by its path (scripts are not a package)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def load_script(relative: str, name: str) -> ModuleType:
    """Import ``scripts/<relative>`` under the module name ``name`` (a fresh module each call)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
