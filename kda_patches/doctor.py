"""``kda-patches doctor``: what this installation can do, checked for real.

Reports interpreter and package versions, the environment bootstrap (CANN discovery, OPP
variables, preloads), the device backend, and for every patch target whether it resolves in the
installed stack (module importable, attribute defined, version in range, signature fingerprint
matching), and the installed ``fla_npu`` (:func:`describe_fla_npu`: its version, and whether its state kernels
take strides where vllm-ascend 0.30 needs them). Unlike ``status`` this imports torch and the target modules
(vLLM, forks); ``fla_npu`` is read from its distribution metadata only, never imported.
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


# fla_npu (flash-linear-attention-npu): its AscendC RecurrentGatedDeltaRule and CausalConv1d read the state tensors'
# strides since upstream commits e1f7a5d7 and bb310ef9 (2026-07-14, merged to main as a42e957f on 2026-07-16),
# recurrent_kda since 833fb6d7 (2026-07-21); before them a page-strided state is addressed densely (seed 004 §2.3).
# The stride handling is compiled (op_host tiling, aclnn): no Python attribute of the package changed with it, so only
# the version can tell, and only where the release line was read: the v26.6.0 tag and branch lack those commits, as
# do main's 0.1.0 builds (2026-07-01 to 07-05); main builds since are 26.7.0.dev0+main.<commit>, which the commit alone
# decides. A build without the repository's scripts/ folder is 1.0.0 whatever its source.
FLA_NPU_STRIDE_COMMITS = "e1f7a5d7 and bb310ef9 (state strides of RecurrentGatedDeltaRule, CausalConv1d), 833fb6d7 " \
                         "(recurrent_kda)"
FLA_NPU_WITHOUT_STRIDES = (((0, 1), (1, 0)), ((26,), (26, 7)))  # [low, high) public versions read to lack them
FLA_NPU_DISTRIBUTIONS = ("flash-linear-attention-npu", "flash-linear-attention-npu-a2",
                         "flash-linear-attention-npu-a3", "flash-linear-attention-npu-a5")


def fla_npu_distribution() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed package that provides ``fla_npu``, from metadata only."""
    from importlib import metadata

    names = [*FLA_NPU_DISTRIBUTIONS, *metadata.packages_distributions().get("fla_npu", [])]
    for name in dict.fromkeys(names):
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def fla_npu_stride_aware(version: str | None) -> str:
    """Whether an ``fla_npu`` of ``version`` has stride-aware state kernels: ``yes``, ``no`` or why undetermined."""
    if version is None:
        return "cannot be determined: fla_npu is importable but no distribution metadata names its version"
    public, _, local = version.partition("+")
    release = registry.parse_version(public)
    if any(low <= release < high for low, high in FLA_NPU_WITHOUT_STRIDES):
        return (f"no: {public} predates the stride-aware state kernels (commits {FLA_NPU_STRIDE_COMMITS}); a "
                "page-strided state is addressed densely")
    build = f"a main build of {local.removeprefix('main.')}; " if local.startswith("main.") else ""
    return (f"cannot be determined from Python: {build}the kernels read state strides since commits "
            f"{FLA_NPU_STRIDE_COMMITS}, compiled code no Python attribute reflects; check that the build of "
            f"{version} contains them")


def describe_fla_npu(vllm_ascend: str | None) -> dict[str, Any]:
    """The installed ``fla_npu``: version, stride-aware state kernels, and whether the installed fork needs them.

    Args:
        vllm_ascend: the installed vllm-ascend version (None: not installed).
    """
    if importlib.util.find_spec("fla_npu") is None:
        found, stride_aware = None, "not installed"
    else:
        found = fla_npu_distribution()
        stride_aware = fla_npu_stride_aware(found[1] if found else None)
    if vllm_ascend is None or vllm_ascend.startswith("import failed"):
        needed = "vllm-ascend not installed"
    elif registry.parse_version(vllm_ascend) >= (0, 30):
        needed = ("yes: vllm-ascend 0.30 binds GDN/KDA state views page-strided (stride(0) = the page; "
                  "docs/results/ascend-kv-layout) and its fla_npu conv and recurrent kernels read them")
    else:
        needed = "no: vllm-ascend up to 0.29 binds dense per-state views (docs/results/ascend-kv-layout)"
    return {"distribution": found[0] if found else None, "version": found[1] if found else None,
            "stride_aware_state_kernels": stride_aware, "needed": needed}


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
    report["fla_npu"] = describe_fla_npu(report["packages"]["vllm_ascend"])
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
    fla = report["fla_npu"]
    lines.append(f"  {'fla_npu':<12} {fla['version'] or 'not installed'}"
                 + (f" ({fla['distribution']})" if fla["distribution"] else ""))
    lines.append(f"    stride-aware state kernels: {fla['stride_aware_state_kernels']}; needed: {fla['needed']}")
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
