"""Find the CANN toolkit and the AscendC custom-op vendor dirs, and edit path-list variables.

Everything here is stat-level work on the file system: no package is imported, no library is
loaded. A CANN custom-op package ("OPP") vendor dir is ``.../vendors/<name>`` holding
``op_api/lib/libcust_opapi.so``; vllm-ascend and vllm-plugin-FL install theirs inside the Python
package as ``<pkg>/_cann_ops_custom/vendors/<name>`` (``custom_transformer`` in both today).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any, Iterable, Mapping, MutableMapping

#: Where CANN installs when no variable says otherwise (toolkit layout, then the newer ``cann`` layout).
STANDARD_TOOLKIT_PREFIXES = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")
#: Variables naming the toolkit, highest precedence first (both are exported by CANN's set_env.sh).
TOOLKIT_VARIABLES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
#: Fork packages that ship a CANN custom-op package inside themselves.
FORK_PACKAGES = ("vllm_ascend", "vllm_fl")
OPP_LIBRARY = os.path.join("op_api", "lib", "libcust_opapi.so")
_TOOLKIT_MARKERS = ("lib64", "opp", "runtime", "compiler")
_VERSION_FILES = (os.path.join("compiler", "version.info"), os.path.join("runtime", "version.info"), "version.cfg")


def find_toolkit(environ: Mapping[str, str],
                 standard_prefixes: Iterable[str] = STANDARD_TOOLKIT_PREFIXES) -> dict[str, Any]:
    """Locate the CANN toolkit: ``ASCEND_HOME_PATH``, then ``ASCEND_TOOLKIT_HOME``, then the standard prefixes.

    Args:
        environ: the environment to read the variables from.
        standard_prefixes: install prefixes tried when no variable names a usable toolkit.
    Returns:
        ``{"found": bool, "path", "source", "version", "candidates": [{"source", "path", "status"}]}``;
        a candidate's status is ``ok``, ``missing`` or ``not-a-toolkit`` (exists but holds none of
        lib64/opp/runtime/compiler). ``path``/``source``/``version`` are None when nothing was found.
    """
    candidates = [(name, environ.get(name) or "") for name in TOOLKIT_VARIABLES]
    candidates += [("standard prefix", prefix) for prefix in standard_prefixes]
    report: dict[str, Any] = {"found": False, "path": None, "source": None, "version": None, "candidates": []}
    for source, path in candidates:
        if not path:
            continue
        if not os.path.isdir(path):
            status = "missing"
        elif any(os.path.isdir(os.path.join(path, marker)) for marker in _TOOLKIT_MARKERS):
            status = "ok"
        else:
            status = "not-a-toolkit"
        report["candidates"].append({"source": source, "path": path, "status": status})
        if status == "ok" and not report["found"]:
            report.update(found=True, path=path, source=source, version=read_toolkit_version(path))
    return report


def read_toolkit_version(toolkit: str) -> str | None:
    """Return the toolkit version from its ``version.info`` files (``Version=...``), or None."""
    for relative in _VERSION_FILES:
        try:
            with open(os.path.join(toolkit, relative)) as handle:
                for line in handle:
                    key, _, value = line.partition("=")
                    if key.strip().lower() in ("version", "runtime_running_version") and value.strip():
                        return value.strip().strip("[]")
        except OSError:
            continue
    return None


def find_package_dirs(name: str) -> list[str]:
    """Return the directories of top-level package ``name`` without importing it.

    Asks every ``sys.meta_path`` finder (so editable installs are found too); a finder that
    raises is ignored. Returns ``[]`` when the package is not installed.
    """
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, None)
        except Exception:  # a third-party finder must never break startup
            continue
        if spec is not None:
            return [str(location) for location in (spec.submodule_search_locations or ())]
    return []


def find_fork_vendors(packages: Iterable[str] = FORK_PACKAGES) -> list[dict[str, Any]]:
    """List the custom-op vendor dirs shipped inside the installed fork packages.

    Args:
        packages: top-level package names to look in (found via :func:`find_package_dirs`).
    Returns:
        ``[{"path", "source", "library"}]`` sorted by package then vendor name; ``library`` is the
        absolute path of ``op_api/lib/libcust_opapi.so`` or None when the vendor has none.
    """
    vendors = []
    for package in packages:
        for location in find_package_dirs(package):
            root = os.path.join(location, "_cann_ops_custom", "vendors")
            try:
                names = sorted(os.listdir(root))
            except OSError:
                continue
            for name in names:
                path = os.path.join(root, name)
                if os.path.isdir(path):
                    vendors.append(describe_vendor(os.path.abspath(path), package))
    return vendors


def describe_vendor(path: str, source: str) -> dict[str, Any]:
    """Return ``{"path", "source", "library"}`` for vendor dir ``path`` (library None if absent)."""
    library = os.path.join(path, OPP_LIBRARY)
    return {"path": path, "source": source, "library": library if os.path.isfile(library) else None}


def check_custom_opp(entries: Iterable[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Validate ``KDA_PATCHES_CUSTOM_OPP`` entries.

    Args:
        entries: the raw entries (already split on ``os.pathsep``).
    Returns:
        ``(vendors, problems)``: the usable vendor dirs (as :func:`describe_vendor` records) and one
        message per rejected entry, naming the variable and the fix.
    """
    vendors, problems = [], []
    for entry in entries:
        if not os.path.isabs(entry):
            problems.append(f"KDA_PATCHES_CUSTOM_OPP entry {entry!r} is not an absolute path (workers may start "
                            "in another directory); skipped. Fix: list absolute vendor dirs "
                            "(.../vendors/<name>, the dir holding op_api/lib/libcust_opapi.so) separated by ':'")
        elif not os.path.isdir(entry):
            problems.append(f"KDA_PATCHES_CUSTOM_OPP entry {entry!r} is not an existing directory; skipped. Fix: "
                            "point it at an installed vendor dir (.../vendors/<name>, the dir holding "
                            "op_api/lib/libcust_opapi.so) or unset KDA_PATCHES_CUSTOM_OPP")
        else:
            vendors.append(describe_vendor(os.path.normpath(entry), "KDA_PATCHES_CUSTOM_OPP"))
    return vendors, problems


def split_path_list(value: str | None) -> list[str]:
    """Split a ``:``-separated path list, dropping empty entries."""
    return [part for part in (value or "").split(os.pathsep) if part]


def prepend_paths(environ: MutableMapping[str, str], variable: str, paths: Iterable[str]) -> list[str]:
    """Prepend ``paths`` (in order) to path-list ``variable``, skipping entries already present.

    Entries already in the variable keep their place, so calling this again changes nothing.

    Args:
        environ: the environment to edit (``os.environ`` also updates the C environment children get).
        variable: e.g. ``ASCEND_CUSTOM_OPP_PATH`` or ``LD_LIBRARY_PATH``.
        paths: directories to put in front.
    Returns:
        The entries actually added (empty when the variable was left untouched).
    """
    current = split_path_list(environ.get(variable))
    present = {os.path.normpath(entry) for entry in current}
    added = []
    for path in paths:
        key = os.path.normpath(path)
        if key not in present:
            present.add(key)
            added.append(path)
    if added:
        environ[variable] = os.pathsep.join(added + current)
    return added
