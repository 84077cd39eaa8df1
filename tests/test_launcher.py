"""The launcher: ``python bootstrap.py -- CMD`` prepares the environment, then execs CMD.

Every test starts the real top-level ``bootstrap.py`` (or ``kda_patches.env.launch``) in a fresh
process on a fake stack: a fake CANN toolkit and a fake vllm_ascend package whose custom-op vendor
dir holds a real ``libcust_opapi.so`` compiled here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BOOTSTRAP = REPO / "bootstrap.py"
CC = shutil.which("cc") or shutil.which("gcc")
LIBRARY_SOURCE = "int kda_fake_answer(void) { return 42; }\n"
SCRUBBED_PREFIXES = ("KDA_PATCHES", "ASCEND_", "VLLM_FL_", "LD_LIBRARY_PATH", "PYTHONPATH")
REPORT_CHILD = ("import json, os, sys; print(json.dumps({'pid': os.getpid(), "
                "'opp': os.environ.get('ASCEND_CUSTOM_OPP_PATH'), 'ld': os.environ.get('LD_LIBRARY_PATH'), "
                "'gdn': os.environ.get('VLLM_FL_DISABLE_ASCENDC_GDN'), 'pythonpath': os.environ.get('PYTHONPATH'), "
                "'active': 'kda_patches' in sys.modules, "
                "'mapped': 'libcust_opapi.so' in open('/proc/self/maps').read(), "
                "'user_site': getattr(sys, 'kda_test_user_sitecustomize', None), "
                "'activated_by': sys.modules['kda_patches'].get_ledger().snapshot()['facts']['bootstrap']"
                "['activated_by'] if 'kda_patches' in sys.modules else None}))")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # A failure, not a skip: the CI image has a C compiler, and a skipped launcher suite would pass unseen.
    assert CC is not None, "the launcher tests compile a fake libcust_opapi.so: install a C compiler (cc/gcc)"
    root = tmp_path_factory.mktemp("launcher")
    toolkit = root / "toolkit"
    (toolkit / "lib64").mkdir(parents=True)
    package = root / "site" / "vllm_ascend"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('not to be imported')\n")
    vendor = package / "_cann_ops_custom" / "vendors" / "custom_transformer"
    lib_dir = vendor / "op_api" / "lib"
    lib_dir.mkdir(parents=True)
    (root / "fake.c").write_text(LIBRARY_SOURCE)
    subprocess.run([CC, "-shared", "-fPIC", "-Wl,-soname,libcust_opapi.so", "-o", str(lib_dir / "libcust_opapi.so"),
                    str(root / "fake.c")], check=True)
    return {"root": root, "toolkit": toolkit, "site": root / "site", "vendor": vendor, "lib_dir": lib_dir}


def environment(stack: dict[str, Path], **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_PREFIXES)}
    env.update(ASCEND_HOME_PATH=str(stack["toolkit"]), PYTHONPATH=str(stack["site"]))
    env.update(overrides)
    return env


def launch(args: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[int, int, str, str]:
    """Run ``python bootstrap.py ARGS``; return (launcher pid, exit code, stdout, stderr)."""
    process = subprocess.Popen([sys.executable, str(BOOTSTRAP), *args], env=env, cwd=cwd, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = process.communicate(timeout=120)
    return process.pid, process.returncode, stdout, stderr


def test_launcher_sets_paths_before_exec_and_activates_the_command(stack: dict[str, Path]) -> None:
    pid, code, stdout, stderr = launch(["--", sys.executable, "-c", REPORT_CHILD], environment(stack))
    assert code == 0, stderr
    child = json.loads(stdout)
    assert child["pid"] == pid  # exec replaced the launcher: same process, no wrapper process in between
    assert child["opp"] == str(stack["vendor"])
    assert child["ld"] == str(stack["lib_dir"])
    assert child["active"] is True and child["mapped"] is True  # the command's Python activated the overlay
    assert child["activated_by"].startswith("launcher")
    assert child["pythonpath"].split(os.pathsep)[0].endswith(os.path.join("bootstrap_env", "_site"))
    assert child["pythonpath"].split(os.pathsep)[1:] == [str(stack["site"])]


BARE_DLOPEN = "import ctypes; print(ctypes.CDLL('libcust_opapi.so').kda_fake_answer())"


def test_bare_name_dlopen_works_only_through_the_launcher(stack: dict[str, Path]) -> None:
    # -S: no site, so no overlay and no preload in the command: only LD_LIBRARY_PATH set before exec helps.
    _, code, stdout, stderr = launch(["--", sys.executable, "-S", "-c", BARE_DLOPEN], environment(stack))
    assert (code, stdout.strip()) == (0, "42"), stderr
    _, code, stdout, stderr = launch(["--", sys.executable, "-S", "-c", REPORT_CHILD], environment(stack))
    child = json.loads(stdout)
    assert (child["opp"], child["ld"], child["active"]) == (str(stack["vendor"]), str(stack["lib_dir"]), False)
    direct = subprocess.run([sys.executable, "-S", "-c", BARE_DLOPEN], env=environment(stack), capture_output=True,
                            text=True)
    assert direct.returncode != 0 and "cannot open shared object file" in direct.stderr


def test_kda_patches_0_passes_the_environment_through(stack: dict[str, Path]) -> None:
    _, code, stdout, stderr = launch(["--", sys.executable, "-c", REPORT_CHILD], environment(stack, KDA_PATCHES="0"))
    assert code == 0, stderr
    child = json.loads(stdout)
    assert child["opp"] is None and child["ld"] is None and child["pythonpath"] == str(stack["site"])
    assert child["active"] is False and child["mapped"] is False


def test_force_triton_switches_reach_the_command(stack: dict[str, Path]) -> None:
    env = environment(stack, KDA_PATCHES_FORCE_TRITON="1")
    _, code, stdout, stderr = launch(["--", sys.executable, "-S", "-c", REPORT_CHILD], env)
    assert code == 0, stderr
    child = json.loads(stdout)
    assert child["gdn"] == "1" and child["opp"] is None and child["ld"] is None and child["mapped"] is False


def test_user_sitecustomize_still_runs(stack: dict[str, Path], tmp_path: Path) -> None:
    user_site = tmp_path / "user_site"
    user_site.mkdir()
    # A sys attribute, not an environment variable: the launcher's own interpreter also runs this file,
    # and only state that dies with exec proves it ran again in the command.
    (user_site / "sitecustomize.py").write_text("import sys\nsys.kda_test_user_sitecustomize = 'yes'\n")
    env = environment(stack, PYTHONPATH=f"{user_site}{os.pathsep}{stack['site']}")
    _, code, stdout, stderr = launch(["--", sys.executable, "-c", REPORT_CHILD], env)
    assert code == 0, stderr
    child = json.loads(stdout)
    assert child["active"] is True and child["user_site"] == "yes"


@pytest.mark.parametrize(("args", "expected_code", "expected_stderr"), [
    (["--", sys.executable, "-c", "raise SystemExit(7)"], 7, ""),
    (["--", "kda-no-such-command-xyz"], 127, "command not found: kda-no-such-command-xyz"),
    ([], 2, "usage:"),
    (["--"], 2, "usage:"),
])
def test_exit_codes(stack: dict[str, Path], args: list[str], expected_code: int, expected_stderr: str) -> None:
    _, code, _, stderr = launch(args, environment(stack))
    assert code == expected_code
    assert expected_stderr in stderr


def test_help_prints_usage(stack: dict[str, Path]) -> None:
    _, code, stdout, _ = launch(["--help"], environment(stack))
    assert code == 0 and stdout.startswith("usage:")


def test_a_users_bootstrap_module_cannot_shadow_the_package(stack: dict[str, Path], tmp_path: Path) -> None:
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "bootstrap.py").write_text("raise SystemExit('the bare bootstrap module was imported')\n")
    env = environment(stack, PYTHONPATH=f"{hostile}{os.pathsep}{stack['site']}")
    code = ("import sys; from kda_patches.env import launch; "
            f"launch(['--', sys.executable, '-c', {REPORT_CHILD!r}])")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=hostile, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["opp"] == str(stack["vendor"])
    offenders = [str(path) for path in (REPO / "kda_patches").rglob("*.py")
                 if any(line.strip().startswith(("import bootstrap", "from bootstrap "))
                        for line in path.read_text().splitlines())]
    assert offenders == []
