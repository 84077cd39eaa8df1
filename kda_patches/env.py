"""Environment bootstrap: CANN custom-op paths, library preloads and fork switches (stdlib only).

Runs once per process from :func:`kda_patches.activate` (so from ``sitecustomize``/the ``.pth`` file,
the vLLM plugin entry point, or the launcher), before any CANN initialization:

1. find the CANN toolkit (``ASCEND_HOME_PATH``, ``ASCEND_TOOLKIT_HOME``, the standard prefix); a missing
   toolkit is recorded, never an error;
2. unless ``KDA_PATCHES_FORCE_TRITON=1``: collect custom-op vendor dirs (``KDA_PATCHES_CUSTOM_OPP`` first,
   then those shipped inside installed vllm-ascend / vllm-plugin-FL, found without importing them),
   prepend them to ``ASCEND_CUSTOM_OPP_PATH`` and their ``op_api/lib`` dirs to ``LD_LIBRARY_PATH`` (for
   child processes), and preload each ``libcust_opapi.so`` plus every ``KDA_PATCHES_PRELOAD`` library by
   absolute path with ``RTLD_LOCAL | RTLD_NOW``;
3. with ``KDA_PATCHES_FORCE_TRITON=1``: none of that; set the forks' documented Triton switches for this
   process and its children unless the user set them.

Every step lands in the ledger section ``bootstrap``; a second call in the same process changes nothing.
The launcher (:func:`launch`) exports the same settings before ``exec``, the only way a new
``LD_LIBRARY_PATH`` reaches bare-name ``dlopen``.
"""

from __future__ import annotations

import os
import time

from kda_patches.ledger import get_ledger

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any, Iterable, NoReturn

    from kda_patches.flags import Flags

__all__ = ["FORK_TRITON_SWITCHES", "bootstrap_environment", "describe_environment", "launch"]

SECTION = "bootstrap"
#: Documented switches of the forks that keep them on Triton instead of AscendC custom ops
#: (vllm-plugin-FL: GDN patch, RMSNorm, fused MoE). vllm-ascend documents no such runtime switch.
FORK_TRITON_SWITCHES = {
    "VLLM_FL_DISABLE_ASCENDC_GDN": "1",
    "VLLM_FL_DISABLE_ASCENDC_RMSNORM": "1",
    "VLLM_FL_DISABLE_ASCENDC_MOE": "1",
}
_DESCRIBED_VARIABLES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH", "ASCEND_CUSTOM_OPP_PATH",
                        "LD_LIBRARY_PATH", "LD_PRELOAD", "KDA_PATCHES_CUSTOM_OPP", "KDA_PATCHES_PRELOAD",
                        "KDA_PATCHES_FORCE_TRITON", *FORK_TRITON_SWITCHES)

_REPORT: dict[str, Any] | None = None


def _warn(message: str) -> None:
    import logging  # deferred: logging costs milliseconds and is needed only when something is wrong

    logging.getLogger("kda_patches").warning("kda_patches: %s", message)


def _clone(value: Any) -> Any:
    """Deep-copy a JSON-like value (dicts, lists, scalars) without importing ``copy``."""
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_clone(item) for item in value]
    return value


def bootstrap_environment(flags: Flags, standard_prefixes: Iterable[str] | None = None) -> dict[str, Any]:
    """Prepare this process (and its children) for CANN custom ops, once per process.

    Args:
        flags: the effective switches (``custom_opp``, ``preload``, ``force_triton``, ``strict`` are used).
        standard_prefixes: toolkit install prefixes to try after the variables (default
            :data:`~kda_patches.bootstrap_env.discovery.STANDARD_TOOLKIT_PREFIXES`; tests pass fakes).
    Returns:
        A JSON-serialisable report: ``mode`` (``custom-ops``/``force-triton``), ``toolkit``, ``vendors``,
        ``ASCEND_CUSTOM_OPP_PATH``/``LD_LIBRARY_PATH`` (entries ``added``), ``preloads`` (one record per
        library: status ``loaded``/``already-loaded``/``failed``/``invalid``/``skipped`` and the loader's
        message), ``fork_switches``, ``warnings`` and ``elapsed_ms``. A second call returns a copy of the
        first report and changes nothing.
    Raises:
        RuntimeError: under ``KDA_PATCHES_STRICT=1`` when an input was invalid or a library failed to load
            (after everything was recorded).
    """
    global _REPORT
    if _REPORT is not None:
        return _clone(_REPORT)
    started = time.perf_counter()
    from kda_patches.bootstrap_env import discovery

    ledger = get_ledger()
    prefixes = discovery.STANDARD_TOOLKIT_PREFIXES if standard_prefixes is None else tuple(standard_prefixes)
    toolkit = discovery.find_toolkit(os.environ, prefixes)
    ledger.set_fact(SECTION, "toolkit", toolkit)
    report: dict[str, Any] = {"mode": "force-triton" if flags.force_triton else "custom-ops", "toolkit": toolkit,
                              "vendors": [], "ASCEND_CUSTOM_OPP_PATH": {"added": []},
                              "LD_LIBRARY_PATH": {"added": []}, "preloads": [], "fork_switches": {},
                              "warnings": []}
    ledger.set_fact(SECTION, "mode", report["mode"])
    if flags.force_triton:
        report["fork_switches"] = set_fork_switches(FORK_TRITON_SWITCHES)
        ledger.set_fact(SECTION, "fork_switches", report["fork_switches"])
        reason = "skipped: KDA_PATCHES_FORCE_TRITON=1 (no custom-op bootstrap or preload)"
        report["preloads"] = [{"path": path, "source": "KDA_PATCHES_PRELOAD", "status": "skipped", "message": reason}
                              for path in flags.preload]
        ledger.set_fact(SECTION, "custom_ops", {"status": reason, "KDA_PATCHES_CUSTOM_OPP": list(flags.custom_opp),
                                                "KDA_PATCHES_PRELOAD": list(flags.preload)})
        problems: list[str] = []
    else:
        problems = prepare_custom_ops(flags, report, discovery)
    report["warnings"] = problems
    report["elapsed_ms"] = round((time.perf_counter() - started) * 1e3, 3)
    ledger.set_fact(SECTION, "warnings", list(problems))
    ledger.set_fact(SECTION, "elapsed_ms", report["elapsed_ms"])
    _REPORT = report
    if problems and flags.strict:
        raise RuntimeError("kda_patches environment bootstrap (KDA_PATCHES_STRICT=1): " + " | ".join(problems))
    return _clone(report)


def prepare_custom_ops(flags: Flags, report: dict[str, Any], discovery: Any) -> list[str]:
    """Collect vendor dirs, export the path variables and preload the libraries (the non-Triton branch).

    Args:
        flags: the effective switches.
        report: the bootstrap report, filled in place (``vendors``, path variables, ``preloads``).
        discovery: the :mod:`kda_patches.bootstrap_env.discovery` module (already imported by the caller).
    Returns:
        One message per problem (invalid input, failed load); each was also logged as a WARNING.
    """
    ledger = get_ledger()
    vendors, problems = discovery.check_custom_opp(flags.custom_opp)
    seen = {os.path.normpath(vendor["path"]) for vendor in vendors}
    for vendor in discovery.find_fork_vendors():
        if os.path.normpath(vendor["path"]) not in seen:
            seen.add(os.path.normpath(vendor["path"]))
            vendors.append(vendor)
    report["vendors"] = vendors
    ledger.set_fact(SECTION, "vendors", vendors)

    added_opp = discovery.prepend_paths(os.environ, "ASCEND_CUSTOM_OPP_PATH", [v["path"] for v in vendors])
    library_dirs = [os.path.dirname(v["library"]) for v in vendors if v["library"]]
    added_ld = discovery.prepend_paths(os.environ, "LD_LIBRARY_PATH", library_dirs)
    report["ASCEND_CUSTOM_OPP_PATH"] = {"added": added_opp}
    report["LD_LIBRARY_PATH"] = {"added": added_ld}
    ledger.set_fact(SECTION, "ASCEND_CUSTOM_OPP_PATH", {"added": added_opp})
    ledger.set_fact(SECTION, "LD_LIBRARY_PATH", {"added": added_ld, "note": "effective for child processes"})

    requests = [(v["library"], v["source"]) for v in vendors if v["library"]]
    requests += [(path, "KDA_PATCHES_PRELOAD") for path in flags.preload]
    if requests:
        from kda_patches.bootstrap_env.preload import preload_library

        for path, source in requests:
            result = preload_library(path, source)
            report["preloads"].append(result)
            if result["status"] == "invalid":
                problems.append(f"KDA_PATCHES_PRELOAD entry {path!r} is not an absolute path; skipped. Fix: give "
                                "the library's absolute path (e.g. KDA_PATCHES_PRELOAD=/opt/vendor/lib/libfoo.so), "
                                "several separated by ':'")
            elif result["status"] == "failed":
                problems.append(f"could not preload {path} (from {source}): {result['message']}")
        ledger.set_fact(SECTION, "preloads", {r["path"]: {"source": r["source"], "status": r["status"],
                                                          "message": r["message"]} for r in report["preloads"]})
    for message in problems:
        _warn(message)
    return problems


def set_fork_switches(switches: dict[str, str]) -> dict[str, dict[str, str]]:
    """Set each fork switch in ``os.environ`` unless it is already set (a user's value is kept).

    Args:
        switches: variable -> value to set.
    Returns:
        ``{variable: {"value": effective value, "action": "set" | "kept"}}``.
    """
    outcome = {}
    for name, value in switches.items():
        if name in os.environ:
            outcome[name] = {"value": os.environ[name], "action": "kept"}
        else:
            os.environ[name] = value
            outcome[name] = {"value": value, "action": "set"}
    return outcome


def describe_environment() -> dict[str, Any]:
    """Describe the bootstrap-relevant environment of this process (for ``kda-patches doctor``).

    Returns:
        ``{"bootstrap": this process's report or None, "toolkit": fresh discovery, "fork_vendors": vendor
        dirs of installed forks, "variables": {name: value or None}, "preloads": [records with "mapped":
        whether the file is in /proc/self/maps]}``.
    """
    from kda_patches.bootstrap_env import discovery, preload

    results = preload.preload_results()
    mapped = preload.mapped_libraries([result["path"] for result in results])
    return {
        "bootstrap": None if _REPORT is None else _clone(_REPORT),
        "toolkit": discovery.find_toolkit(os.environ),
        "fork_vendors": discovery.find_fork_vendors(),
        "variables": {name: os.environ.get(name) for name in _DESCRIBED_VARIABLES},
        "preloads": [dict(result, mapped=mapped.get(result["path"], False)) for result in results],
    }


def launch(argv: list[str]) -> NoReturn:
    """Prepare the environment, then replace this process with ``argv`` (see :mod:`..bootstrap_env.launcher`).

    Args:
        argv: the command and its arguments; a leading ``--`` is dropped.
    """
    from kda_patches.bootstrap_env.launcher import launch_command

    launch_command(argv)
