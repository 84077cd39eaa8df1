"""release_loader's per-file ``unused`` imports and :func:`release_function` (used by the 0.34 rebind test)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
from release_loader import ReleaseStack, StandInNotProvided, release_function


@pytest.fixture
def tree(tmp_path):
    package = tmp_path / "forkpkg"
    package.mkdir()
    (package / "state.py").write_text(
        "from heavypkg.connectors import Factory, Role\n"
        "_AGENT = None\n"
        "def has_group():\n    return _AGENT is not None\n"
        "def ensure(config):\n    global _AGENT\n    if config is not None:\n        _AGENT = Factory(config, Role)\n")
    (package / "other.py").write_text("from heavypkg.connectors import Factory\n")
    (package / "worker.py").write_text(
        "class Worker:\n    @staticmethod\n    def never():\n        pass\n\n"
        "    def extend(self, num_blocks: UndefinedType) -> None:\n        return extend(self.runner, num_blocks)\n")
    return tmp_path


def test_unused_imports_are_placeholders_for_that_file_only_and_nothing_is_imported(tree) -> None:
    stack = ReleaseStack(tree, "forkpkg", "1.0", ["forkpkg.state", "forkpkg.other"],
                         unused={"forkpkg.state": {"heavypkg.connectors": ("Factory", "Role")}}).install()
    try:
        state = importlib.import_module("forkpkg.state")
        assert "heavypkg.connectors" not in sys.modules and "heavypkg" not in sys.modules
        assert state.has_group() is False
        state.ensure(None)  # the path that does not use them runs, real code
        assert stack.bound["heavypkg.connectors"] == {"Factory": "inert", "Role": "inert"}
        with pytest.raises(StandInNotProvided, match=r"heavypkg\.connectors\.Factory is declared inert"):
            state.ensure("a connector")  # the path that would use them fails loudly
        with pytest.raises(ImportError, match=r"import of 'heavypkg.connectors' is not declared"):
            importlib.import_module("forkpkg.other")  # another file importing the same module: not covered
    finally:
        stack.uninstall()


def test_a_declared_unused_name_the_file_lacks_or_an_undeclared_one_fails_the_import(tree) -> None:
    for table, message in (({"heavypkg.connectors": ("Factory", "Role", "Gone")}, r"\['heavypkg.connectors.Gone'\] "
                                                                                   "not imported by the file"),
                           ({"heavypkg.connectors": ("Factory",)}, r"\['Role'\] is not")):
        stack = ReleaseStack(tree, "forkpkg", "1.0", ["forkpkg.state"], unused={"forkpkg.state": table}).install()
        try:
            with pytest.raises(ImportError, match=message):
                importlib.import_module("forkpkg.state")
        finally:
            stack.uninstall()


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
