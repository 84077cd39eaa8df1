"""release_loader's :func:`release_function` (the 0.34 rebind test runs the release's ``Worker.extend_kv_cache``)."""

from __future__ import annotations

import types

import pytest
import torch
from release_loader import release_function


@pytest.fixture
def tree(tmp_path):
    package = tmp_path / "forkpkg"
    package.mkdir()
    (package / "worker.py").write_text(
        "class Worker:\n    @staticmethod\n    def never():\n        pass\n\n"
        "    def extend(self, num_blocks: UndefinedType) -> None:\n        return extend(self.runner, num_blocks)\n")
    return tmp_path


def test_release_function_compiles_one_method_as_written_with_our_globals(tree) -> None:
    path = tree / "forkpkg" / "worker.py"
    calls = []
    namespace = types.ModuleType("standin_worker").__dict__
    namespace["extend"] = lambda runner, num_blocks: calls.append((runner, num_blocks)) or num_blocks * 2
    method = release_function(path, "Worker.extend", namespace)
    assert namespace["extend"] is not method  # the module-level name the method calls is kept
    assert method.__code__.co_filename == str(path) and method.__code__.co_firstlineno == 6
    worker = types.SimpleNamespace(runner="runner")
    assert method(worker, torch.tensor(3)).item() == 6 and calls[0][0] == "runner"
    namespace["extend"] = lambda runner, num_blocks: -1  # the global is read at call time (an alias rebound later)
    assert method(worker, 3) == -1
    with pytest.raises(LookupError, match=r"defines no Worker\.missing"):
        release_function(path, "Worker.missing", {})
