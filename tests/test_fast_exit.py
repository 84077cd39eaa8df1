"""The test-only fast exit of spawned children (``tests/fast_exit``): same exit code, atexit handlers run,
only the interpreter teardown skipped; without the shim on ``PYTHONPATH`` the teardown runs (the control)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import kda_test_fast_exit
import pytest

PARENT = '''
import multiprocessing, sys

def work(folder, code):
    import atexit
    atexit.register(lambda: open(folder + "/atexit", "w").close())

    class TornDown:  # a module global's finalizer runs only in the interpreter teardown
        def __del__(self):
            open(folder + "/teardown", "w").close()

    sys.modules["__mp_main__"].keeper = TornDown()
    sys.exit(code)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=work, args=(sys.argv[1], int(sys.argv[2])))
    child.start()
    child.join()
    print(child.exitcode)
'''


def run_parent(tmp_path: pathlib.Path, code: int, shim: bool) -> tuple[int, set[str]]:
    folder = tmp_path / f"{code}-{shim}"
    folder.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if shim:
        env = kda_test_fast_exit.with_fast_exit(env)
    done = subprocess.run([sys.executable, str(script), str(folder), str(code)], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return int(done.stdout.strip()), {path.name for path in folder.iterdir()}


@pytest.mark.parametrize("code", [0, 3])
def test_a_spawned_child_keeps_its_exit_code_and_atexit_but_skips_the_teardown(tmp_path, code: int) -> None:
    exitcode, written = run_parent(tmp_path, code, shim=True)
    assert exitcode == code
    assert written == {"atexit"}


def test_without_the_shim_the_teardown_runs(tmp_path) -> None:
    exitcode, written = run_parent(tmp_path, 3, shim=False)
    assert exitcode == 3
    assert written == {"atexit", "teardown"}


@pytest.mark.parametrize(("code", "status"), [("None", 0), ("5", 5), ("'a message'", 1)])
def test_finish_maps_codes_as_sys_exit_does(code: str, status: int) -> None:
    done = subprocess.run([sys.executable, "-c", f"import kda_test_fast_exit; kda_test_fast_exit.finish({code})"],
                          env=kda_test_fast_exit.with_fast_exit(dict(os.environ)), timeout=60)
    assert done.returncode == status


def test_install_wraps_once_and_with_fast_exit_keeps_other_paths() -> None:
    code = ("import multiprocessing.spawn as s, kda_test_fast_exit as f; first = s._main; "
            "print(f.install(), s._main is first, f.install())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([kda_test_fast_exit.FOLDER, "/nowhere"])}
    done = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["True", "False", "False"], done.stderr
    paths = kda_test_fast_exit.with_fast_exit({"PYTHONPATH": os.pathsep.join(["/a", kda_test_fast_exit.FOLDER])})
    assert paths["PYTHONPATH"].split(os.pathsep) == [kda_test_fast_exit.FOLDER, "/a"]
