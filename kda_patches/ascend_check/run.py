"""Run the Ascend compile check: every plan variant, the block-limit table, the hints, the calibration, and the
indexed twins of vllm-ascend's chunk-state kernels (:mod:`~kda_patches.ascend_check.indexed_twins`).

:func:`run_check` returns one JSON-serialisable report; :func:`summary_lines` prints one line per chip
class. Compiles run in a pool of one process per core, fed one compile at a time (so that the processes
finish together), each process keeping one toolchain per chip class for all its compiles (in a folder of
the run's temporary folder, removed at the end). A compile's result does not depend on what its process
compiled before: no Triton cache is read or written (the backend's stages are called directly), and each
compile gets its own MLIR context and bishengir temporary folder, so the report does not depend on the
order or on which process compiled what. Each distinct piece of code (chip class, kernel, signature,
constexprs) is compiled once: a block-limit probe or a hint run that is the same code as a plan variant (or
as another probe), and the byte copy listed under two cache dtypes, reuse that one result.
"""

from __future__ import annotations

import os
import pathlib
import platform
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from typing import Any

PROBE_MAX_ITEMS = 65536  # families that fit this many items have no limit in the device table

_TOOLCHAINS: dict[str, Any] = {}
_WORKDIR: list[pathlib.Path] = []


def _start_worker(root: str) -> None:
    """Pool initializer: this process's toolchains work in a new folder under ``root`` (the run's)."""
    _TOOLCHAINS.clear()
    _WORKDIR[:] = [pathlib.Path(tempfile.mkdtemp(prefix="worker-", dir=root))]


def _toolchain(chip: str) -> Any:
    from kda_patches.ascend_check.toolchain import CHIP_CLASSES, Toolchain

    if chip not in _TOOLCHAINS:
        if not _WORKDIR:
            _WORKDIR.append(pathlib.Path(tempfile.mkdtemp(prefix="kda-ascend-check-")))
        _TOOLCHAINS[chip] = Toolchain(CHIP_CLASSES[chip], _WORKDIR[0])
    return _TOOLCHAINS[chip]


_VARIANT_CACHE: dict[str, list[Any]] = {}


def _variants(chip: str) -> list[Any]:
    from kda_patches.ascend_check.plan_variants import enumerate_variants

    if chip not in _VARIANT_CACHE:
        _VARIANT_CACHE[chip] = enumerate_variants((chip,))
    return _VARIANT_CACHE[chip]


def _compile_variant(task: tuple[str, int]) -> dict[str, Any]:
    chip, index = task
    case = _variants(chip)[index]
    return asdict(_toolchain(chip).compile(case.kernel, case.signature, case.constexprs))


def _compile_probe(task: tuple[str, str, int, str, int | None]) -> dict[str, Any]:
    chip, family, items, stream, rule = task
    kernel, signature, constexprs = probe_kernel(chip, family, items, stream == "stream", rule)
    return asdict(_toolchain(chip).compile(kernel, signature, constexprs))


_TWIN_CACHE: dict[tuple[str, tuple[str, ...] | None], list[Any]] = {}


def _twins(chip: str, cache_dtypes: tuple[str, ...] | None = None) -> list[Any]:
    from kda_patches.ascend_check.indexed_twins import CACHE_TYPES, release_roots, twin_cases

    key = (chip, cache_dtypes)
    if key not in _TWIN_CACHE:
        _TWIN_CACHE[key] = twin_cases((chip,), release_roots(), cache_dtypes or tuple(CACHE_TYPES))
    return _TWIN_CACHE[key]


def _compile_twin(task: tuple[str, int, tuple[str, ...] | None]) -> dict[str, Any]:
    chip, index, cache_dtypes = task
    case = _twins(chip, cache_dtypes)[index]
    return asdict(_toolchain(chip).compile(case.kernel, case.signature, case.constexprs))


def _compile_task(task: tuple[str, tuple[Any, ...]]) -> dict[str, Any]:
    kind, arguments = task
    if kind == "twin":
        return _compile_twin(arguments)
    return _compile_variant(arguments) if kind == "variant" else _compile_probe(arguments)


def code_key(chip: str, kernel: Any, signature: dict[str, str], constexprs: dict[str, Any]) -> tuple[Any, ...]:
    """Return the identity of one compile: the same key means the same input to the compiler on that chip class."""
    function = getattr(kernel, "fn", kernel)
    return (chip, function.__module__, function.__qualname__, tuple(signature.items()),
            tuple((name, repr(value)) for name, value in constexprs.items()))


def compile_once(pool: Any, tasks: list[tuple[str, tuple[Any, ...]]], keys: list[tuple[Any, ...]]) -> list[dict]:
    """Compile each distinct key of ``keys`` once in ``pool`` and return one result per task (shared by equal keys).

    Args:
        pool: an executor with ``map``.
        tasks: ``("variant", (chip, index))`` or ``("probe", (chip, family, items, stream, rule))``.
        keys: :func:`code_key` of each task, in the same order.
    """
    first: dict[tuple[Any, ...], int] = {}
    for position, key in enumerate(keys):
        first.setdefault(key, position)
    unique = list(first.values())
    results = dict(zip(unique, pool.map(_compile_task, [tasks[position] for position in unique], chunksize=1),
                       strict=True))
    return [dict(results[first[key]]) for key in keys]


def probe_kernel(chip: str, family: str, items: int, stream: bool = False,
                 nan_rule: int | None = None) -> tuple[Any, dict[str, str], dict]:
    """Return a variant of ``family`` on ``chip`` (the first the plans prepare) with a block of ``items``.

    Args:
        chip: chip class.
        family: a block-limit family (``bytes``, ``fused/A->B``, ``cast_items/A->B``).
        items: the block, in the family's items.
        stream: fused families only: the variant with ``STREAM`` set (the evict_first hint).
        nan_rule: casting families only: the NaN rule (``casts.NAN_*``) to compile with.
    Returns:
        ``(kernel, signature, constexprs)``.
    """
    from kda_patches.ascend_check.plan_variants import probe_case

    case = probe_case(chip, family, _variants(chip))  # the worker's enumeration, not one per probe
    constexprs = dict(case.constexprs)
    constexprs["BLOCK"] = items
    payload = constexprs["PAYLOAD"]
    if "TILES" in constexprs:
        constexprs["TILES"] = max(-(-payload // items), 1)
    if "EVEN" in constexprs:
        constexprs["EVEN"] = payload % items == 0
    if "STREAM" in constexprs:
        constexprs["STREAM"] = stream
    if nan_rule is not None and "NAN_RULE" in constexprs:
        constexprs["NAN_RULE"] = nan_rule
    return case.kernel, case.signature, constexprs


def _compile_calibration(index: int) -> dict[str, Any]:
    from kda_patches.ascend_check import calibration

    declaration, kernel = calibration.calibration_kernels(calibration.release_root())[index]
    return asdict(_toolchain("a2a3").compile(kernel, declaration.signature, declaration.constexprs))


def run_check(chips: tuple[str, ...] = ("a2a3", "a5"), jobs: int | None = None,
              calibrate: bool = True, twins: bool = True,
              twin_cache_dtypes: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Compile everything the check covers and return the report.

    Args:
        chips: chip classes to compile for.
        jobs: worker processes (default: the CPU count).
        calibrate: also compile the calibration kernels (the release cache is fetched if needed).
        twins: also compile the indexed twins of vllm-ascend's chunk-state kernels, and the released kernels
            they are derived from (every release of ``indexed_twins.RELEASES``, fetched if needed).
        twin_cache_dtypes: the cache dtypes whose twins are compiled (None: every one, ``indexed_twins.CACHE_TYPES``).
    Returns:
        ``{"toolchain": versions, "variants": [...], "limits": [...], "hints": {...}, "calibration": [...],
        "indexed_twins": [...], "seconds": wall time}``; each variant and twin entry has the case's facts and its
        compile result.
    """
    import triton

    from kda_patches.ascend_check import calibration
    from kda_patches.state_copy import casts
    from kda_patches.state_copy.device import EVICT_FIRST, TARGETS

    started = time.monotonic()
    cases = {chip: _variants(chip) for chip in chips}
    variant_tasks = [(chip, index) for chip in chips for index in range(len(cases[chip]))]
    limit_tasks, hint_tasks = [], []
    for chip in chips:
        target = TARGETS[f"ascend-{chip}"]
        families = sorted({case.family for case in cases[chip]} | set(target.block_limits))
        for family in families:
            limit = target.block_limit(family)
            sizes = (limit, 2 * limit) if limit else (PROBE_MAX_ITEMS,)
            source, _, cache = family.partition("/")[2].partition("->")
            rules = tuple(casts.NAN_RULES) if source != cache else (None,)  # a cast's buffer depends on its rule
            limit_tasks.extend((chip, family, size, "default", rule) for size in sizes for rule in rules)
        hint_families = sorted(family for family in families if family.startswith("fused/"))[:2]
        hint_tasks.extend((chip, family, 1024, stream, None) for family in hint_families
                          for stream in ("default", "stream"))
    kernels_to_calibrate = calibration.calibration_kernels(calibration.release_root()) if calibrate else []
    twin_cases = {chip: _twins(chip, twin_cache_dtypes) for chip in chips} if twins else {}
    twin_tasks = [("twin", (chip, index, twin_cache_dtypes)) for chip in twin_cases
                  for index in range(len(twin_cases[chip]))]
    tasks = [("variant", task) for task in variant_tasks] + [("probe", task) for task in limit_tasks + hint_tasks]
    keys = [code_key(chip, cases[chip][index].kernel, cases[chip][index].signature, cases[chip][index].constexprs)
            for chip, index in variant_tasks]
    keys += [code_key(task[0], *probe_kernel(task[0], task[1], task[2], task[3] == "stream", task[4]))
             for task in limit_tasks + hint_tasks]
    with tempfile.TemporaryDirectory(prefix="kda-ascend-check-") as root, \
            ProcessPoolExecutor(max_workers=jobs or len(os.sched_getaffinity(0)) or 1, initializer=_start_worker,
                                initargs=(root,)) as pool:
        calibration_results = pool.map(_compile_calibration, range(len(kernels_to_calibrate)))
        twin_results = pool.map(_compile_task, twin_tasks, chunksize=1)
        compiled = compile_once(pool, tasks, keys)
        variant_results = compiled[:len(variant_tasks)]
        limit_results = compiled[len(variant_tasks):len(variant_tasks) + len(limit_tasks)]
        hint_results = compiled[len(variant_tasks) + len(limit_tasks):]
        variants = [{**_case_facts(cases[chip][index]), **result}
                    for (chip, index), result in zip(variant_tasks, variant_results, strict=True)]
        limits = [{"chip": chip, "family": family, "items": size, "nan_rule": casts.NAN_RULES.get(rule, "bit copy"),
                   "declared": TARGETS[f"ascend-{chip}"].block_limit(family), **result}
                  for (chip, family, size, _, rule), result in zip(limit_tasks, limit_results, strict=True)]
        hint_runs = list(zip(hint_tasks, hint_results, strict=True))
        calibrated = [{"name": declaration.name, "must_compile": declaration.must_compile, **result}
                      for (declaration, _), result in zip(kernels_to_calibrate, calibration_results, strict=True)]
        indexed = [{**_twin_facts(twin_cases[chip][index]), **result}
                   for (_, (chip, index, _)), result in zip(twin_tasks, twin_results, strict=True)]
    hints: dict[str, Any] = {}
    for chip in chips:
        runs = {(family, stream): result for (task_chip, family, _, stream, _), result in hint_runs
                if task_chip == chip}
        compared = [(family, runs[(family, "default")], runs[(family, "stream")])
                    for family in sorted({family for family, _ in runs})]
        kept = [family for family, plain, hinted in compared
                if plain["hivm_sha"] is None or plain["hivm_sha"] != hinted["hivm_sha"]]
        hints[chip] = {"evict_first": {"compared": [family for family, _, _ in compared],
                                       "hivm_differs": kept,
                                       "declared_honoured": TARGETS[f"ascend-{chip}"].honours(EVICT_FIRST)}}
    return {"toolchain": {"triton": triton.__version__, "ascendnpu_ir": _version("ascendnpu-ir"),
                          "python": platform.python_version()},
            "variants": variants, "limits": limits, "hints": hints, "calibration": calibrated,
            "indexed_twins": indexed, "seconds": round(time.monotonic() - started, 1)}


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _case_facts(case: Any) -> dict[str, Any]:
    return {"chip": case.chip, "plan": case.plan, "name": case.name, "cache_dtype": case.cache_dtype,
            "final_dtype": case.final_dtype, "nan_rule": case.nan_rule, "family": case.family, "block": case.block,
            "models": case.models, "constexprs": {name: str(value) for name, value in case.constexprs.items()}}


def _twin_facts(case: Any) -> dict[str, Any]:
    return {"chip": case.chip, "name": case.name, "shape": case.shape, "releases": case.releases,
            "twin": case.twin, "cache_dtype": case.cache_dtype, "nan_rule": case.nan_rule,
            "declared_fits": case.declared_fits, "constexprs": {name: str(value) for name, value in
                                                                case.constexprs.items()}}


def problems(report: dict[str, Any]) -> list[str]:
    """Return every way the report falls short (empty when the check passes).

    A variant that does not reach the final HIVM IR, or only after bishengir's buffer-overflow retry;
    a block limit that does not fit at its declared size under some NaN rule, or whose double fits under
    every rule (the table is not the compiler's); a family declared unlimited that does not fit
    :data:`PROBE_MAX_ITEMS`; a
    hint declared honoured whose HIVM IR is identical with and without it (or the reverse); a
    shipping calibration kernel that does not compile, or a canary that does; an indexed twin (or the released
    kernel it is derived from) whose fit disagrees with its declaration (``indexed_twins.A2A3_OVERFLOWS``).
    """
    found = []
    for entry in report["variants"]:
        if not (entry["stage"] == "hivm" and not entry["ub_retry"]):
            found.append(f"{entry['chip']} {entry['name']} ({entry['cache_dtype']} cache, {entry['nan_rule']}, "
                         f"block {entry['block']}): stopped at {entry['stage']}"
                         f"{' after a UB-overflow retry' if entry['ub_retry'] else ''}: {entry['message'][:300]}")
    probes: dict[tuple[str, str, int], list[bool]] = {}
    for entry in report["limits"]:
        fits = entry["stage"] == "hivm" and not entry["ub_retry"]
        probes.setdefault((entry["chip"], entry["family"], entry["items"]), []).append(fits)
        declared = entry["declared"]
        if declared is None and not fits:
            found.append(f"{entry['chip']} {entry['family']}: declared unlimited but {entry['items']} items do not "
                         f"fit ({entry['nan_rule']})")
        elif declared is not None and entry["items"] == declared and not fits:
            found.append(f"{entry['chip']} {entry['family']}: the declared limit {declared} items does not fit "
                         f"({entry['nan_rule']})")
    for (chip, family, items), fitted in sorted(probes.items()):
        declared = next(entry["declared"] for entry in report["limits"]
                        if (entry["chip"], entry["family"]) == (chip, family))
        if declared is not None and items == 2 * declared and all(fitted):
            found.append(f"{chip} {family}: {items} items fit under every NaN rule, above the declared limit "
                         f"{declared} (the table is stale)")
    for chip, facts in report["hints"].items():
        hint = facts["evict_first"]
        observed = bool(hint["hivm_differs"])
        if hint["compared"] and observed != hint["declared_honoured"]:
            found.append(f"{chip} evict_first: declared {'kept' if hint['declared_honoured'] else 'dropped'}, "
                         f"but the HIVM IR {'differs' if observed else 'is identical'} with the hint")
    for entry in report["calibration"]:
        compiled = entry["stage"] == "hivm"
        if compiled != entry["must_compile"]:
            found.append(f"calibration {entry['name']}: {'did not compile' if entry['must_compile'] else 'compiled'}"
                         f" ({entry['stage']}: {entry['message'][:200]})")
    for entry in report.get("indexed_twins", []):
        fits = entry["stage"] == "hivm" and not entry["ub_retry"]
        if fits != entry["declared_fits"]:
            what = "twin" if entry["twin"] else "released kernel"
            found.append(f"{entry['chip']} indexed {what} {entry['name']} ({entry['cache_dtype']} cache, "
                         f"{entry['nan_rule']}): declared {'to fit' if entry['declared_fits'] else 'not to fit'}, "
                         f"{'fits' if fits else 'stopped at ' + entry['stage']}"
                         f"{' after a UB-overflow retry' if entry['ub_retry'] else ''}: {entry['message'][:200]}")
    return found


def summary_lines(report: dict[str, Any]) -> list[str]:
    """Return one line per chip class, then one for the calibration, then one per chip class for the twins."""
    lines = []
    for chip in sorted({entry["chip"] for entry in report["variants"]}):
        entries = [entry for entry in report["variants"] if entry["chip"] == chip]
        reached = sum(entry["stage"] == "hivm" and not entry["ub_retry"] for entry in entries)
        limits = [entry for entry in report["limits"] if entry["chip"] == chip]
        hint = report["hints"].get(chip, {}).get("evict_first", {})
        verdict = "all variants reach the final HIVM IR" if reached == len(entries) else \
            f"{len(entries) - reached} variants FAIL"
        lines.append(f"ascend-check {chip}: {reached}/{len(entries)} variants reach the final HIVM IR ({verdict}); "
                     f"block-limit probes {len(limits)}; evict_first "
                     f"{'kept' if hint.get('hivm_differs') else 'dropped'} by the compiler")
    shipping = [entry for entry in report["calibration"] if entry["must_compile"]]
    passed = sum(entry["stage"] == "hivm" for entry in shipping)
    canaries = [entry for entry in report["calibration"] if not entry["must_compile"]]
    rejected = sum(entry["stage"] != "hivm" for entry in canaries)
    lines.append(f"ascend-check calibration (a2a3): {passed}/{len(shipping)} vllm-ascend 0.30 kernels compile; "
                 f"{rejected}/{len(canaries)} canaries rejected")
    twins = report.get("indexed_twins", [])
    for chip in sorted({entry["chip"] for entry in twins}):
        entries = [entry for entry in twins if entry["chip"] == chip and entry["twin"]]
        released = [entry for entry in twins if entry["chip"] == chip and not entry["twin"]]
        fit = sum(entry["stage"] == "hivm" and not entry["ub_retry"] for entry in entries)
        agree = sum((entry["stage"] == "hivm" and not entry["ub_retry"]) == entry["declared_fits"]
                    for entry in entries + released)
        lines.append(f"ascend-check indexed twins {chip}: {fit}/{len(entries)} twins reach the final HIVM IR; "
                     f"{sum(entry['stage'] == 'hivm' for entry in released)}/{len(released)} released kernels; "
                     f"{agree}/{len(entries) + len(released)} as declared")
    return lines
