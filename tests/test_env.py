"""Environment bootstrap (kda_patches.env) against a fake CANN tree and real compiled libraries.

Each scenario that touches process-global state (environment variables, loaded libraries, the
bootstrap's once-per-process cache) runs in a fresh interpreter. The shared libraries are compiled
here with the system C compiler; their constructor appends ``<pid> <tag>`` to a log file, so the log
proves how many times each library was really loaded in which process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kda_patches.bootstrap_env import discovery

CC = shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(autouse=True)
def _require_compiler() -> None:
    """The bootstrap tests compile a real shared library: a missing compiler fails them instead of skipping."""
    if CC is None:
        pytest.fail("tests/test_env.py needs a system C compiler (cc or gcc on PATH) to build its shared library")


FAKE_LIBRARY_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static int kda_fake_loads;
__attribute__((constructor)) static void kda_fake_on_load(void) {
    kda_fake_loads++;
    const char *log = getenv("KDA_FAKE_LOAD_LOG");
    if (log) {
        FILE *out = fopen(log, "a");
        if (out) { fprintf(out, "%ld %s\n", (long)getpid(), KDA_FAKE_TAG); fclose(out); }
    }
}
int kda_fake_load_count(void) { return kda_fake_loads; }
int kda_fake_answer(void) { return KDA_FAKE_ANSWER; }
"""
SCRUBBED_PREFIXES = ("KDA_PATCHES", "ASCEND_", "VLLM_FL_", "LD_LIBRARY_PATH", "PYTHONPATH", "KDA_FAKE")


def compile_library(path: Path, tag: str, answer: int, soname: str = "libcust_opapi.so") -> Path:
    """Compile the fake library to ``path`` with a SONAME, like CMake builds libcust_opapi.so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.parent / f"{tag}.c"
    source.write_text(FAKE_LIBRARY_SOURCE)
    subprocess.run([CC, "-shared", "-fPIC", f"-Wl,-soname,{soname}", f'-DKDA_FAKE_TAG="{tag}"',
                    f"-DKDA_FAKE_ANSWER={answer}", "-o", str(path), str(source)], check=True)
    return path


def build_stack(root: Path) -> dict[str, Path]:
    """Fake CANN toolkit, fake fork packages with vendor dirs, a custom OPP dir and an extra library."""
    toolkit = root / "Ascend" / "ascend-toolkit" / "latest"
    for sub in ("lib64", "opp", "compiler"):
        (toolkit / sub).mkdir(parents=True)
    (toolkit / "compiler" / "version.info").write_text("Version=8.5.0\n")
    site = root / "site"
    paths = {"toolkit": toolkit, "site": site, "log": root / "loads.log"}
    for package, tag, answer in (("vllm_ascend", "ascend", 2), ("vllm_fl", "fl", 3)):
        package_dir = site / package
        package_dir.mkdir(parents=True)
        (package_dir / "__init__.py").write_text(f"raise ImportError('{package} must not be imported')\n")
        vendor = package_dir / "_cann_ops_custom" / "vendors" / "custom_transformer"
        compile_library(vendor / "op_api" / "lib" / "libcust_opapi.so", tag, answer)
        paths[f"{tag}_vendor"] = vendor
    custom = root / "custom_opp" / "vendors" / "mine"
    compile_library(custom / "op_api" / "lib" / "libcust_opapi.so", "custom", 1)
    paths["custom_vendor"] = custom
    paths["extra"] = compile_library(root / "extra" / "libkda_extra.so", "extra", 4, soname="libkda_extra.so")
    return paths


def clean_environment(**overrides: str) -> dict[str, str]:
    """This environment without any bootstrap-relevant variable, plus ``overrides``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(SCRUBBED_PREFIXES)}
    env.update(overrides)
    return env


def run_python(code: str, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    """Run ``code`` with arguments ``argv`` in a fresh interpreter of this venv."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv], env=env, capture_output=True,
                          text=True, timeout=120)


def load_log(path: Path) -> list[tuple[int, str]]:
    """The (pid, tag) lines the fake libraries' constructors wrote."""
    if not path.exists():
        return []
    return [(int(pid), tag) for pid, tag in (line.split() for line in path.read_text().splitlines())]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_stack(tmp_path_factory.mktemp("stack"))


@pytest.fixture
def log(stack: dict[str, Path]) -> Path:
    stack["log"].unlink(missing_ok=True)
    return stack["log"]


def stack_environment(stack: dict[str, Path], **overrides: str) -> dict[str, str]:
    """Environment of a process on the fake stack: toolkit variable, forks importable, custom OPP, preload."""
    values = {"ASCEND_HOME_PATH": str(stack["toolkit"]), "PYTHONPATH": str(stack["site"]),
              "KDA_PATCHES_CUSTOM_OPP": str(stack["custom_vendor"]), "KDA_PATCHES_PRELOAD": str(stack["extra"]),
              "KDA_FAKE_LOAD_LOG": str(stack["log"]), "ASCEND_CUSTOM_OPP_PATH": "/pre/existing/opp",
              "LD_LIBRARY_PATH": "/pre/existing/lib"}
    values.update(overrides)
    return clean_environment(**values)


# --- pure discovery functions (no global state) -------------------------------------------------


def test_find_toolkit_precedence_version_and_missing(tmp_path: Path) -> None:
    toolkits = {}
    for name in ("home", "toolkit_home", "standard"):
        (tmp_path / name / "lib64").mkdir(parents=True)
        toolkits[name] = str(tmp_path / name)
    (tmp_path / "home" / "compiler").mkdir()
    (tmp_path / "home" / "compiler" / "version.info").write_text("Version=9.0.0\n")
    (tmp_path / "empty").mkdir()
    standard = (str(tmp_path / "absent"), toolkits["standard"])
    both = {"ASCEND_HOME_PATH": toolkits["home"], "ASCEND_TOOLKIT_HOME": toolkits["toolkit_home"]}

    found = discovery.find_toolkit(both, standard)
    assert (found["found"], found["path"], found["source"], found["version"]) == (
        True, toolkits["home"], "ASCEND_HOME_PATH", "9.0.0")
    found = discovery.find_toolkit({"ASCEND_TOOLKIT_HOME": toolkits["toolkit_home"]}, standard)
    assert (found["path"], found["source"], found["version"]) == (toolkits["toolkit_home"], "ASCEND_TOOLKIT_HOME", None)
    found = discovery.find_toolkit({"ASCEND_HOME_PATH": str(tmp_path / "empty")}, standard)
    assert (found["path"], found["source"]) == (toolkits["standard"], "standard prefix")
    assert [c["status"] for c in found["candidates"]] == ["not-a-toolkit", "missing", "ok"]

    missing = discovery.find_toolkit({"ASCEND_HOME_PATH": str(tmp_path / "nowhere")}, (str(tmp_path / "absent"),))
    assert missing["found"] is False and missing["path"] is None
    assert [c["status"] for c in missing["candidates"]] == ["missing", "missing"]


def test_prepend_paths_keeps_order_and_never_duplicates() -> None:
    env = {"VAR": "/c:/a/"}
    assert discovery.prepend_paths(env, "VAR", ["/a", "/b", "/b/"]) == ["/b"]
    assert env["VAR"] == "/b:/c:/a/"
    assert discovery.prepend_paths(env, "VAR", ["/a", "/b", "/c"]) == []
    assert env["VAR"] == "/b:/c:/a/"
    fresh: dict[str, str] = {}
    assert discovery.prepend_paths(fresh, "VAR", ["/x", "/y"]) == ["/x", "/y"]
    assert fresh["VAR"] == "/x:/y"


# --- the bootstrap in fresh processes ------------------------------------------------------------

MAIN_PROBE = """
import ctypes, json, os, subprocess, sys
VARS = ("ASCEND_CUSTOM_OPP_PATH", "LD_LIBRARY_PATH", "VLLM_FL_DISABLE_ASCENDC_GDN")
before = {k: os.environ.get(k) for k in VARS}
import kda_patches  # activation runs the bootstrap
from kda_patches import env
after_first = {k: os.environ.get(k) for k in VARS}
maps = open("/proc/self/maps").read()
log_before_second = open(os.environ["KDA_FAKE_LOAD_LOG"]).read()
second = env.bootstrap_environment(kda_patches.current_flags())
after_second = {k: os.environ.get(k) for k in VARS}
log_after_second = open(os.environ["KDA_FAKE_LOAD_LOG"]).read()
bare = ctypes.CDLL("libcust_opapi.so")  # bare name: only works because it is already loaded
child = subprocess.run([sys.executable, "-c", "import kda_patches, os, json; "
                        "print(json.dumps([os.getpid(), {k: os.environ.get(k) for k in %r}]))" % (VARS,)],
                       capture_output=True, text=True, check=True)
child_pid, child_env = json.loads(child.stdout)
print(json.dumps({
    "pid": os.getpid(), "before": before, "after_first": after_first, "after_second": after_second,
    "second_report": second, "maps": maps, "log_unchanged": log_before_second == log_after_second,
    "bare_answer": bare.kda_fake_answer(), "bare_load_count": bare.kda_fake_load_count(),
    "forks_imported": [m for m in ("vllm_ascend", "vllm_fl") if m in sys.modules],
    "facts": kda_patches.get_ledger().snapshot()["facts"]["bootstrap"],
    "child": {"pid": child_pid, "env": child_env},
    "describe": env.describe_environment(),
}))
"""


def test_bootstrap_preloads_each_library_once_and_exports_paths(stack: dict[str, Path], log: Path) -> None:
    result = run_python(MAIN_PROBE, stack_environment(stack))
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    out = json.loads(result.stdout)
    vendors = [str(stack["custom_vendor"]), str(stack["ascend_vendor"]), str(stack["fl_vendor"])]
    libraries = [os.path.join(v, "op_api", "lib", "libcust_opapi.so") for v in vendors] + [str(stack["extra"])]

    # Paths: user's custom OPP first, then the forks' vendor dirs, then what was already there.
    assert out["before"]["ASCEND_CUSTOM_OPP_PATH"] == "/pre/existing/opp"
    assert out["after_first"]["ASCEND_CUSTOM_OPP_PATH"] == ":".join([*vendors, "/pre/existing/opp"])
    lib_dirs = [os.path.join(v, "op_api", "lib") for v in vendors]
    assert out["after_first"]["LD_LIBRARY_PATH"] == ":".join([*lib_dirs, "/pre/existing/lib"])
    assert out["after_first"]["VLLM_FL_DISABLE_ASCENDC_GDN"] is None
    # Each library really loaded in this process, exactly once, all mapped.
    entries = load_log(log)
    mine = sorted(tag for pid, tag in entries if pid == out["pid"])
    assert mine == ["ascend", "custom", "extra", "fl"]
    for library in libraries:
        assert os.path.realpath(library) in out["maps"]
    # Second bootstrap: same report, no environment change, no second load.
    assert out["after_second"] == out["after_first"]
    assert out["log_unchanged"] is True
    assert [p["status"] for p in out["second_report"]["preloads"]] == ["loaded"] * 4
    # The preload is what makes the adapter's bare-name dlopen work (SONAME match, constructor not re-run).
    assert out["bare_answer"] in (1, 2, 3) and out["bare_load_count"] == 1
    # The forks were found without being imported (their __init__ raises).
    assert out["forks_imported"] == []
    # A child inherits the paths without duplicates and loads each library once itself.
    assert out["child"]["env"] == out["after_first"]
    child_tags = sorted(tag for pid, tag in load_log(log) if pid == out["child"]["pid"])
    assert child_tags == ["ascend", "custom", "extra", "fl"]
    # Every step is in the ledger.
    facts = out["facts"]
    assert facts["toolkit"]["found"] is True and facts["toolkit"]["version"] == "8.5.0"
    assert facts["toolkit"]["path"] == str(stack["toolkit"]) and facts["toolkit"]["source"] == "ASCEND_HOME_PATH"
    assert [v["source"] for v in facts["vendors"]] == ["KDA_PATCHES_CUSTOM_OPP", "vllm_ascend", "vllm_fl"]
    assert facts["ASCEND_CUSTOM_OPP_PATH"]["added"] == vendors
    assert facts["LD_LIBRARY_PATH"]["added"] == lib_dirs
    assert {path: fact["status"] for path, fact in facts["preloads"].items()} == dict.fromkeys(libraries, "loaded")
    assert facts["warnings"] == [] and facts["mode"] == "custom-ops"
    # doctor's view: JSON-serialisable, libraries mapped, variables as exported.
    described = out["describe"]
    assert all(record["mapped"] for record in described["preloads"]) and len(described["preloads"]) == 4
    assert described["variables"]["ASCEND_CUSTOM_OPP_PATH"] == out["after_first"]["ASCEND_CUSTOM_OPP_PATH"]
    assert [v["source"] for v in described["fork_vendors"]] == ["vllm_ascend", "vllm_fl"]


RTLD_PROBE = """
import ctypes, json, os, sys
mode = sys.argv[1]
if mode == "bootstrap":
    import kda_patches
    from kda_patches.bootstrap_env.preload import loaded_handle
    handle = loaded_handle(os.environ["KDA_PATCHES_PRELOAD"])
    own = handle.kda_fake_answer()
elif mode == "global":
    import kda_patches
    ctypes.CDLL(os.environ["KDA_PATCHES_PRELOAD"], mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    own = None
else:  # "none": overlay off, nothing preloaded
    own = None
in_global_namespace = hasattr(ctypes.CDLL(None), "kda_fake_answer")
try:
    ctypes.CDLL("libkda_extra.so")
    bare = "ok"
except OSError as error:
    bare = str(error)
print(json.dumps({"own": own, "global": in_global_namespace, "bare": bare}))
"""


@pytest.mark.parametrize(("mode", "expect_global", "expect_bare_ok"),
                         [("bootstrap", False, True), ("global", True, True), ("none", False, False)])
def test_preload_is_rtld_local(stack: dict[str, Path], mode: str, expect_global: bool, expect_bare_ok: bool) -> None:
    env = clean_environment(KDA_PATCHES_PRELOAD=str(stack["extra"]))
    if mode != "bootstrap":
        env["KDA_PATCHES"] = "0"
    result = run_python(RTLD_PROBE, env, mode)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["global"] is expect_global  # RTLD_LOCAL: symbols stay out of the global namespace
    assert (out["bare"] == "ok") is expect_bare_ok, out["bare"]
    if mode == "bootstrap":
        assert out["own"] == 4  # yet the library is loaded and usable through its own handle


FAILURE_PROBE = """
import json, kda_patches
from kda_patches import env
first = env.bootstrap_environment(kda_patches.current_flags())
second = env.bootstrap_environment(kda_patches.current_flags())
print(json.dumps({"report": first, "same": first == second,
                  "facts": kda_patches.get_ledger().snapshot()["facts"]["bootstrap"]}))
"""


def test_library_that_fails_to_load_gives_one_warning(tmp_path: Path) -> None:
    vendor = tmp_path / "vendors" / "broken"
    library = vendor / "op_api" / "lib" / "libcust_opapi.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"this is not an ELF file\n" * 8)
    result = run_python(FAILURE_PROBE, clean_environment(KDA_PATCHES_CUSTOM_OPP=str(vendor)))
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "kda_patches" in line]
    assert len(warnings) == 1, result.stderr
    assert str(library) in warnings[0] and "invalid ELF header" in warnings[0]
    out = json.loads(result.stdout)
    assert out["same"] is True
    [record] = out["report"]["preloads"]
    assert record["status"] == "failed" and "invalid ELF header" in record["message"]
    assert out["facts"]["preloads"][str(library)]["status"] == "failed"
    assert out["facts"]["warnings"] == out["report"]["warnings"]
    # The OPP dir itself is still exported: the package may hold kernels CANN can use.
    assert out["facts"]["ASCEND_CUSTOM_OPP_PATH"]["added"] == [str(vendor)]


def test_bad_inputs_warn_with_the_variable_and_the_fix(tmp_path: Path) -> None:
    env = clean_environment(KDA_PATCHES_CUSTOM_OPP=f"{tmp_path / 'nope'}:relative/vendor",
                            KDA_PATCHES_PRELOAD="libcust_opapi.so")
    result = run_python(FAILURE_PROBE, env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    warnings = out["facts"]["warnings"]
    assert len(warnings) == 3 and len([line for line in result.stderr.splitlines() if "WARNING" in line
                                       or "kda_patches:" in line]) == 3, result.stderr
    assert "KDA_PATCHES_CUSTOM_OPP" in warnings[0] and "not an existing directory" in warnings[0]
    assert "KDA_PATCHES_CUSTOM_OPP" in warnings[1] and "not an absolute path" in warnings[1]
    assert "KDA_PATCHES_PRELOAD" in warnings[2] and "absolute path" in warnings[2] and "Fix:" in warnings[2]
    assert out["report"]["ASCEND_CUSTOM_OPP_PATH"]["added"] == []
    assert out["report"]["preloads"][0]["status"] == "invalid"


def test_strict_turns_bad_input_into_an_error(tmp_path: Path) -> None:
    env = clean_environment(KDA_PATCHES_PRELOAD="libfoo.so", KDA_PATCHES_STRICT="1")
    result = run_python("import kda_patches", env)
    assert result.returncode != 0
    assert "RuntimeError" in result.stderr and "KDA_PATCHES_STRICT=1" in result.stderr
    assert "KDA_PATCHES_PRELOAD" in result.stderr


FORCE_PROBE = """
import json, os, subprocess, sys
import kda_patches
facts = kda_patches.get_ledger().snapshot()["facts"]["bootstrap"]
names = ("VLLM_FL_DISABLE_ASCENDC_GDN", "VLLM_FL_DISABLE_ASCENDC_RMSNORM", "VLLM_FL_DISABLE_ASCENDC_MOE",
         "ASCEND_CUSTOM_OPP_PATH", "LD_LIBRARY_PATH")
child = subprocess.run([sys.executable, "-S", "-c", "import os, json; print(json.dumps({k: os.environ.get(k) "
                        "for k in %r}))" % (names,)], capture_output=True, text=True, check=True)
print(json.dumps({"facts": facts, "maps": open("/proc/self/maps").read(), "child": json.loads(child.stdout),
                  "ctypes_imported": "ctypes" in sys.modules}))
"""


def test_force_triton_skips_preload_and_sets_fork_switches(stack: dict[str, Path], log: Path) -> None:
    env = stack_environment(stack, KDA_PATCHES_FORCE_TRITON="1", VLLM_FL_DISABLE_ASCENDC_RMSNORM="0")
    del env["ASCEND_CUSTOM_OPP_PATH"], env["LD_LIBRARY_PATH"]
    result = run_python(FORCE_PROBE, env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert load_log(log) == [] and "libcust_opapi.so" not in out["maps"] and out["ctypes_imported"] is False
    child = out["child"]
    assert child["VLLM_FL_DISABLE_ASCENDC_GDN"] == "1" and child["VLLM_FL_DISABLE_ASCENDC_MOE"] == "1"
    assert child["VLLM_FL_DISABLE_ASCENDC_RMSNORM"] == "0"  # the user's value wins
    assert child["ASCEND_CUSTOM_OPP_PATH"] is None and child["LD_LIBRARY_PATH"] is None
    facts = out["facts"]
    assert facts["mode"] == "force-triton"
    assert facts["fork_switches"]["VLLM_FL_DISABLE_ASCENDC_GDN"] == {"value": "1", "action": "set"}
    assert facts["fork_switches"]["VLLM_FL_DISABLE_ASCENDC_RMSNORM"] == {"value": "0", "action": "kept"}
    assert "KDA_PATCHES_FORCE_TRITON=1" in facts["custom_ops"]["status"]
    assert facts["toolkit"]["found"] is True  # discovery is still reported


COST_PROBE = """
import json, sys, time
import kda_patches  # KDA_PATCHES=0: the package itself does no bootstrap
from kda_patches.flags import Flags
before = set(sys.modules)
started = time.perf_counter()
import kda_patches.env as env
report = env.bootstrap_environment(Flags())
elapsed = time.perf_counter() - started
print(json.dumps({"ms": elapsed * 1e3, "report": report, "new": sorted(set(sys.modules) - before),
                  "facts": kda_patches.get_ledger().snapshot()["facts"]["bootstrap"]}))
"""


@pytest.mark.skipif(os.path.exists("/usr/local/Ascend"), reason="a real CANN install is present")
def test_no_toolkit_is_a_silent_fact_and_stays_cheap() -> None:
    result = run_python(COST_PROBE, clean_environment(KDA_PATCHES="0"))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = json.loads(result.stdout)
    assert out["facts"]["toolkit"]["found"] is False
    assert {c["status"] for c in out["facts"]["toolkit"]["candidates"]} == {"missing"}
    assert out["report"]["vendors"] == [] and out["report"]["preloads"] == [] and out["report"]["warnings"] == []
    heavy = {"ctypes", "subprocess", "logging", "typing", "importlib.util", "json", "copy"}
    assert heavy.isdisjoint(out["new"]), out["new"]
    print(f"\nimport kda_patches.env + bootstrap without a toolkit: {out['ms']:.3f} ms "
          f"(bootstrap itself {out['report']['elapsed_ms']:.3f} ms)")
