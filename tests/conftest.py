"""Shared test options: GPU-only tests run with ``--run-gpu`` (the H200 script passes it)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-gpu", action="store_true", default=False,
                     help="run tests marked 'gpu' (compiled Triton on a CUDA device)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; runs only with --run-gpu")
    config.addinivalue_line("markers", "engine: starts a real vLLM engine (slow)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-gpu"):
        return
    skip_gpu = pytest.mark.skip(reason="GPU test: run with --run-gpu on a CUDA machine (make gpu-check)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
