"""``kda-patches doctor``: what this installation can do, checked for real.

Reports interpreter and package versions, the environment bootstrap (CANN discovery, OPP
variables, preloads), the device backend, and for every patch target whether it resolves in the
installed stack (module importable, attribute defined, version in range, signature fingerprint
matching). Unlike ``status`` this imports torch and the target modules (vLLM, forks).
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import sys
from typing import Any

from kda_patches import current_flags, get_ledger, registry

PACKAGES = ("torch", "triton", "vllm", "vllm_ascend", "vllm_fl", "torch_npu", "wrapt", "fla")


def find_package_version(name: str) -> str | None:
    """Return ``name.__version__`` when the package is installed, else None (imports it)."""
    if importlib.util.find_spec(name) is None:
        return None
    try:
        module = importlib.import_module(name)
    except Exception as error:  # report, do not crash the doctor
        return f"import failed: {type(error).__name__}: {error}"
    return str(getattr(module, "__version__", "installed (no __version__)"))


def check_target(target: registry.Target) -> dict[str, Any]:
    """Return whether ``target`` resolves here: importable, defined, version in range, signature."""
    top = target.module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        return {"resolves": False, "reason": f"{top} is not installed"}
    try:
        module = importlib.import_module(target.module)
    except Exception as error:
        return {"resolves": False, "reason": f"import of {target.module} failed: {type(error).__name__}: {error}"}
    resolved = registry.resolve_attribute(module, target.qualname)
    if resolved is None:
        return {"resolves": False, "reason": f"{target.qualname} is not defined in {target.module}"}
    found = registry.find_version(target, module)
    if not registry.version_supported(target, found):
        return {"resolves": False, "reason": f"version {found} outside the supported range"}
    parent, attribute, _ = resolved
    original = getattr(getattr(parent, attribute), "__wrapped__", getattr(parent, attribute))
    if target.parameters is not None and registry.signature_parameters(original) != target.parameters:
        return {"resolves": False, "reason": "signature drifted from the recorded fingerprint"}
    return {"resolves": True, "reason": f"version {found or 'unknown'}"}


def key_targets(patch: registry.Patch) -> list[registry.Target]:
    """Return one target per key: the sibling whose version range holds the installed version (else the first)."""
    chosen = []
    for key in patch.keys():
        siblings = patch.siblings(key)
        found = registry.find_version(siblings[0]) if len(siblings) > 1 else None
        chosen.append(registry.select_target(patch, key, found) or siblings[0] if found else siblings[0])
    return chosen


def describe_seams() -> dict[str, Any]:
    """Return the state-copy seam declarations per patch, the fork-plan (Kimi, GDN) and routing switches, and per seam
    the mechanism this process wraps it with (``not wrapped here`` when its module was not imported; no torch)."""
    from kda_patches.routing.wrappers import SeamWrapper

    flags = current_flags()
    facts = get_ledger().snapshot().get("facts", {})
    seams: dict[str, Any] = {"KDA_PATCHES_KIMI_PLAN": flags.kimi_plan, "KDA_PATCHES_GDN_PLAN": flags.gdn_plan,
                             "KDA_PATCHES_GDN_OPS": flags.gdn_ops, "KDA_PATCHES_ROUTING": flags.routing}
    for name, patch in registry.all_patches().items():
        declared = {}
        for key in patch.keys():  # the seam of the installed release's era (else the first declared)
            siblings = [target for target in patch.siblings(key) if isinstance(target.wrapper, SeamWrapper)]
            if not siblings:
                continue
            found = registry.find_version(siblings[0])
            target = next((t for t in siblings if found and registry.version_in_range(t, found)), siblings[0])
            declared[key] = {**target.wrapper.seam.describe(), "routing": facts.get(
                target.wrapper.seam.section, {}).get(f"routing {key}", {}).get("mechanism", "not wrapped here")}
        if declared:
            seams[name] = declared
    return seams


def describe_device() -> dict[str, Any]:
    """Return the device backend the state-copy plans would use here, with the FP32/FP16 routes."""
    try:
        import torch

        from kda_patches.state_copy import device
    except ImportError as error:
        return {"backend": "unavailable", "reason": f"{type(error).__name__}: {error}"}
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        target = torch.device("npu", 0)
    elif torch.cuda.is_available():
        target = torch.device("cuda", 0)
    else:
        target = torch.device("cpu")
    report: dict[str, Any] = {"device": str(target), "backend": device.device_kind(target),
                              "ascend_soc": device.probe_ascend_soc()}
    for dtype in (torch.float32, torch.float16):
        try:
            report[f"route_{dtype}".replace("torch.", "")] = device.route_plan(target, dtype).as_dict()
        except RuntimeError as error:
            report[f"route_{dtype}".replace("torch.", "")] = {"refused": str(error)}
    return report


def collect_report() -> dict[str, Any]:
    """Collect the whole doctor report as a JSON-serialisable dict."""
    flags = current_flags()
    from kda_patches import env

    report: dict[str, Any] = {
        "note": "doctor imports torch, vLLM and the fork packages to check the patch targets",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: find_package_version(name) for name in PACKAGES},
        "switches": flags.as_dict(),
        "bootstrap": env.describe_environment(),
        "device": describe_device(),
        "patches": {},
    }
    for name, patch in registry.all_patches().items():
        report["patches"][name] = {
            "enabled": flags.patch_enabled(name),
            "targets": {f"{t.key} [{t.stack}]": check_target(t) for t in key_targets(patch)},
        }
    report["state_copy_seams"] = describe_seams()
    report["ledger"] = get_ledger().snapshot()["patches"]
    from kda_patches import measured

    report["measured"] = measured.switch_lines(flags.as_dict())
    return report


def format_report(report: dict[str, Any]) -> str:
    """Render the doctor report for humans."""
    lines = [f"kda-patches doctor ({report['note']})", f"python {report['python']} on {report['platform']}"]
    for name, version in report["packages"].items():
        lines.append(f"  {name:<12} {version or 'not installed'}")
    lines.append(f"device: {report['device']}")
    lines.append(f"bootstrap: {report['bootstrap']}")
    seams = report.get("state_copy_seams", {})
    lines.append(f"state-copy seams (KDA_PATCHES_KIMI_PLAN={seams.get('KDA_PATCHES_KIMI_PLAN')}, "
                 f"KDA_PATCHES_ROUTING={seams.get('KDA_PATCHES_ROUTING')}):")
    for name, declared in seams.items():
        if isinstance(declared, dict):
            for key, seam in declared.items():
                lines.append(f"  {name}: {key}: state {seam['state']}, clear {seam['clear']}"
                             f"{' (prefill-gated)' if seam['prefill_gated'] else ''}, routing {seam['routing']}")
    for name, info in report["patches"].items():
        lines.append(f"patch {name} ({'enabled' if info['enabled'] else 'disabled'}):")
        for target, check in info["targets"].items():
            lines.append(f"  {'ok ' if check['resolves'] else '-- '} {target}: {check['reason']}")
    if report.get("measured"):
        lines.append("measured behind the switch choices (kda_patches/measured.json):")
        lines.extend(f"  {line}" for line in report["measured"])
    return "\n".join(lines)
