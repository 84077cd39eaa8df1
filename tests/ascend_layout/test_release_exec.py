"""The definition-by-definition release executor (``kda_patches.kv_layout.release_exec``) on a synthetic release.

Each property the Ascend layout proof relies on is decided by a small package written to ``tmp_path``: names are
compiled only when used, with the release file's name and line numbers; imports (relative, star, a module
``__getattr__``, ``if``/``try`` blocks) resolve inside the tree; declared stand-ins win; anything else outside
the tree is inert and fails loudly when used; a patch module's import-time statements run in order (the original
is kept before it is replaced); partial and lazy classes keep ``super()`` and pick up release methods on use.
"""

from __future__ import annotations

import pathlib
import textwrap
import traceback

import pytest

from kda_patches.kv_layout.release_compile import definition_time_names
from kda_patches.kv_layout.release_exec import ReleaseTree, StoodInUse

FILES = {
    "relpkg/__init__.py": "",
    "relpkg/base.py": """
        import math

        LIMIT = 3


        def square(x):
            return x * x


        def uses_missing():
            return not_defined_anywhere


        class Base:
            flag = True
            name = "base"

            def describe(self):
                return f"base:{self.value}"

            def extra(self):
                return math.prod([self.value, LIMIT])

            @property
            def doubled(self):
                return self.value * 2
        """,
    "relpkg/child.py": """
        from .base import Base, square
        from relpkg.outside_stub import helper
        import torchlike_absent_package

        try:
            from relpkg.nonexistent import thing
        except ImportError:
            thing = "fallback"

        if square(2) == 4:
            CHOSEN = "if-branch"
        else:
            CHOSEN = "else-branch"


        class Child(Base):
            def describe(self):
                return "child+" + super().describe()

            def heavy(self):
                return torchlike_absent_package.run()


        def compute(x):
            return square(x) + 1


        def broken_at_definition():
            return 1
        """,
    "relpkg/outside_stub.py": """
        def helper():
            return "release helper"
        """,
    "relpkg/stars.py": """
        from relpkg.base import *
        """,
    "relpkg/dynamic.py": """
        def __getattr__(name):
            if name == "computed":
                return 42
            raise AttributeError(name)
        """,
    "relpkg/target.py": """
        def original():
            return "original"


        def caller():
            return original()
        """,
    "relpkg/patch.py": """
        import relpkg.target

        _orig = relpkg.target.original


        def replacement():
            return "patched(" + _orig() + ")"


        relpkg.target.original = replacement
        """,
}


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> ReleaseTree:
    for name, text in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return ReleaseTree(f"test_{tmp_path.name}", {"relpkg": tmp_path})


def test_only_used_definitions_are_compiled_and_recorded(tree: ReleaseTree) -> None:
    assert tree.get("relpkg.child", "compute")(3) == 10
    report = tree.report()
    assert "relpkg.child:compute" in report["release"] and "relpkg.base:square" in report["release"]
    assert "relpkg.child:Child" not in tree.bound  # never asked for
    assert "relpkg.base:uses_missing" not in tree.bound


def test_tracebacks_point_into_the_release_file(tree: ReleaseTree, tmp_path: pathlib.Path) -> None:
    with pytest.raises(NameError, match="not_defined_anywhere") as info:
        tree.get("relpkg.base", "uses_missing")()
    frame = traceback.extract_tb(info.tb)[-1]
    assert frame.filename == str(tmp_path / "relpkg/base.py")
    assert frame.lineno == 11


def test_if_and_try_blocks_run_as_written(tree: ReleaseTree) -> None:
    assert tree.get("relpkg.child", "CHOSEN") == "if-branch"
    assert tree.get("relpkg.child", "thing") == "fallback"


def test_star_imports_and_module_getattr_resolve(tree: ReleaseTree) -> None:
    assert tree.get("relpkg.stars", "square")(5) == 25
    assert tree.get("relpkg.dynamic", "computed") == 42


def test_outside_the_tree_is_inert_and_fails_loudly_when_used(tree: ReleaseTree) -> None:
    child = tree.get("relpkg.child", "Child")
    instance = object.__new__(child)
    with pytest.raises(StoodInUse, match=r"torchlike_absent_package\.run is inert"):
        instance.heavy()
    assert tree.report()["inert"] == ["torchlike_absent_package:run"]


def test_declared_standins_win_and_are_recorded(tmp_path: pathlib.Path, tree: ReleaseTree) -> None:
    standin_tree = ReleaseTree(f"standin_{tmp_path.name}", {"relpkg": tmp_path},
                               {"relpkg.outside_stub:helper": lambda: "ours"})
    assert standin_tree.get("relpkg.child", "helper")() == "ours"
    assert standin_tree.report()["standin"] == ["relpkg.outside_stub:helper"]
    assert tree.get("relpkg.child", "helper")() == "release helper"


def test_install_keeps_the_original_before_replacing_it(tree: ReleaseTree) -> None:
    ran = tree.install("relpkg.patch")
    assert ran == ["_orig = relpkg.target.original", "relpkg.target.original = replacement"]
    # the release's own caller reads the replaced global, as after a real import of the patch
    assert tree.get("relpkg.target", "caller")() == "patched(original)"


def test_partial_class_keeps_super_and_literal_class_attributes(tree: ReleaseTree) -> None:
    built = tree.partial_class("relpkg.child", "Child", ["describe"])
    instance = object.__new__(built)
    instance.value = 7
    assert instance.describe() == "child+base:7"
    assert built.flag is True and built.name == "base"  # from the base built for the inherited method
    assert not hasattr(built, "extra")


def test_lazy_class_compiles_release_members_on_first_use(tree: ReleaseTree) -> None:
    built = tree.lazy_class("relpkg.child", "Child", ["describe"])
    instance = object.__new__(built)
    instance.value = 5
    assert instance.extra() == 15
    assert instance.doubled == 10  # a property of the release base
    assert "relpkg.base:Base.extra" in tree.report()["release (on use)"]
    with pytest.raises(AttributeError, match="nor does the release class"):
        instance.not_a_member  # noqa: B018


def test_definition_time_names_leave_function_bodies_lazy() -> None:
    source = textwrap.dedent("""
        @decorator(DEFAULT)
        class A(Base, metaclass=Meta):
            attribute = CONSTANT

            def method(self, x=DEFAULT_ARG):
                return body_only(x)
        """)
    assert definition_time_names(source) == {"decorator", "DEFAULT", "Base", "Meta", "CONSTANT", "DEFAULT_ARG"}
