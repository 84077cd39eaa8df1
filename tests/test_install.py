"""``kda_patches.pth`` install/uninstall: idempotent files that activate the overlay at Python startup."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from kda_patches.install import PTH_NAME, install_pth, uninstall_pth

REPO = Path(__file__).resolve().parents[1]
VERSION = f"python{sys.version_info[0]}.{sys.version_info[1]}"


def test_prefix_round_trip_is_idempotent(tmp_path: Path) -> None:
    site_dir = tmp_path / "lib" / VERSION / "site-packages"
    path = install_pth(prefix=str(tmp_path))
    assert path == str(site_dir / PTH_NAME)
    content = Path(path).read_text()
    stamp = os.stat(path).st_mtime_ns
    assert install_pth(prefix=str(tmp_path)) == path
    assert os.listdir(site_dir) == [PTH_NAME]
    assert Path(path).read_text() == content and os.stat(path).st_mtime_ns == stamp  # not rewritten
    import_lines = [line for line in content.splitlines() if line.startswith("import ")]
    assert len(import_lines) == 1  # .pth files execute only lines that start with "import"
    assert uninstall_pth(prefix=str(tmp_path)) == path
    assert not os.path.exists(path)
    assert uninstall_pth(prefix=str(tmp_path)) is None


def test_user_and_prefix_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--user or --prefix"):
        install_pth(user=True, prefix=str(tmp_path))
    with pytest.raises(ValueError, match="--user or --prefix"):
        uninstall_pth(user=True, prefix=str(tmp_path))


def test_installed_line_activates_a_fresh_interpreter(tmp_path: Path) -> None:
    site_dir = os.path.dirname(install_pth(prefix=str(tmp_path)))
    probe = (f"import sys, site; before = 'kda_patches' in sys.modules; site.addsitedir({site_dir!r}); "
             "print(before, 'kda_patches' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDA_PATCHES")}
    for flags in ([], ["-S"]):  # -S: not even the editable install's finder: the recorded tree is used
        result = subprocess.run([sys.executable, *flags, "-c", probe], env=env, cwd=tmp_path, capture_output=True,
                                text=True)
        assert (result.returncode, result.stdout.split()) == (0, ["False", "True"]), result.stderr


SPAWN_PARENT = """
import sys

if __name__ == "__main__":
    import multiprocessing
    import sysconfig

    from kda_patches.install import install_pth, site_packages_dir, uninstall_pth

    out, expected = sys.argv[1], sys.argv[2]
    assert site_packages_dir() == sysconfig.get_paths()["purelib"] == sys.argv[3], site_packages_dir()
    context = multiprocessing.get_context("spawn")

    def probe(tag):
        # The child runs only this string (through the builtin exec): no code of ours is imported there.
        code = "import sys\\nopen(%r, 'a').write('%s ' + str('kda_patches' in sys.modules) + '\\\\n')" % (out, tag)
        child = context.Process(target=exec, args=(code,))
        child.start()
        child.join()
        assert child.exitcode == 0, child.exitcode

    probe("before")
    assert install_pth() == expected
    probe("installed")
    assert uninstall_pth() == expected
    probe("uninstalled")
"""


def test_venv_install_activates_spawned_children_without_code(tmp_path: Path) -> None:
    """``install_pth()`` in a throwaway venv of its own: never writes into the venv running the suite."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert Path(purelib).is_relative_to(venv)
    # kda-patches "installed" in the throwaway venv the way an editable install does it: its tree on the path.
    (Path(purelib) / "kda_tree.pth").write_text(f"{REPO}\n")
    running_pth = os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)
    existed = os.path.exists(running_pth)
    parent, out, expected = tmp_path / "parent.py", tmp_path / "probes.txt", os.path.join(purelib, PTH_NAME)
    parent.write_text(textwrap.dedent(SPAWN_PARENT))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDA_PATCHES", "PYTHON"))}
    result = subprocess.run([python, str(parent), str(out), expected, purelib], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert out.read_text().splitlines() == ["before False", "installed True", "uninstalled False"]
    assert not os.path.exists(expected)
    assert os.path.exists(running_pth) == existed  # the running venv's site-packages was left alone


def base_interpreter() -> str | None:
    """The interpreter this venv was made from (it has a user site; the venv's interpreter does not)."""
    path = os.path.join(sys.base_prefix, "bin", VERSION)
    return path if os.access(path, os.X_OK) else None


def test_user_site_install_and_a_later_uninstalled_package(tmp_path: Path) -> None:
    python = base_interpreter()
    assert python is not None, f"the venv's base interpreter {sys.base_prefix}/bin/{VERSION} is not executable"
    # A copy of the package stands in for an installation that is removed afterwards.
    copy = tmp_path / "installed"
    shutil.copytree(REPO / "kda_patches", copy / "kda_patches", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDA_PATCHES", "PYTHON"))}
    env["PYTHONUSERBASE"] = str(tmp_path / "userbase")
    install = subprocess.run([python, "-c", f"import sys; sys.path.insert(0, {str(copy)!r}); "
                              "from kda_patches.install import install_pth; print(install_pth(user=True))"],
                             env=env, capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    assert install.stdout.strip() == str(tmp_path / "userbase" / "lib" / VERSION / "site-packages" / PTH_NAME)
    probe = [python, "-c", "import sys; print('started', 'kda_patches' in sys.modules)"]

    started = subprocess.run(probe, env=env, capture_output=True, text=True)  # a real startup reads the user site
    assert (started.returncode, started.stdout.split()) == (0, ["started", "True"]), started.stderr

    shutil.rmtree(copy)
    started = subprocess.run(probe, env=env, capture_output=True, text=True)
    assert (started.returncode, started.stdout.split()) == (0, ["started", "False"])
    assert "kda_patches.pth: kda_patches is not importable" in started.stderr
    assert "kda-patches uninstall" in started.stderr and install.stdout.strip() in started.stderr
