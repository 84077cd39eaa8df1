"""``kda-patches conformance``: check every patch record against the forks' released source.

Usage: ``kda-patches conformance [STACK ...] [--json] [--brief] [--write-matrix [PATH]]``.
Each STACK is ``dist==version`` or several joined by ``+`` (``vllm-ascend==0.30.0rc2+vllm==0.30.0``); a lone
vllm-ascend release is read with its paired vLLM. Without STACK the support matrix is read
(:func:`kda_patches.releases.matrix.default_stacks`). Releases are fetched from the package registry into the
release cache on first use (``KDA_PATCHES_RELEASE_CACHE``), read with ``ast`` and never imported.

Exit status: 0 when no patch is *broken* on any stack read, 1 when one is, 2 when a release cannot be fetched
or a spec is malformed (the message names the failed command).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from kda_patches.releases.fetch import ReleaseFetchError
from kda_patches.releases.matrix import MATRIX_PATH, render_matrix, run_matrix


def format_target(target: dict) -> list[str]:
    """Return the text lines of one target's report."""
    facts = [f"{target['runtime']:<14} {target['key']} [{target['stack']}]"]
    details = []
    if target["runtime"] != "absent":
        details.append(f"version {target['version_found']} vs {' | '.join(target['ranges'])}")
        if target["fingerprint"] != "n/a":
            details.append(f"fingerprint {target['fingerprint']}")
    if target["group"]:
        details.append(f"group {target['group']}")
    lines = [facts[0] + (f"  ({'; '.join(details)})" if details else "")]
    if target["runtime"] != "ok" and (target["runtime"] != "absent" or target["package_in_stack"]):
        lines.append(f"{'':17}{target['runtime_reason']}")
    if target["fingerprint"] == "drift":
        lines.append(f"{'':17}found ({', '.join(target['parameters_found'])})")
    if target.get("hint"):
        lines.append(f"{'':17}hint: {target['hint']}")
    for name, shape in target["shapes"].items():
        lines.append(f"{'':17}shape {name}: {'ok' if shape['ok'] else 'MISSING'} - {shape['evidence']}")
    for entry in (target.get("aliases") or {}).get("importers", []):
        lines.append(f"{'':17}imported by name: {entry['module']}:{entry['line']} as {entry['bound']} "
                     f"({entry['scope']} scope): {'covered' if entry['covered'] else 'NOT COVERED'} - {entry['why']}")
    return lines


def format_report(report: dict, verbose: bool = True) -> str:
    """Return the text report of one stack: per patch its verdict and reason, then (verbose) each target."""
    lines = [f"{report['stack']}"]
    for name, entry in report["patches"].items():
        lines.append(f"  {name}: {entry['verdict'].upper()} - {entry['reason']}")
        if verbose:
            for target in entry["targets"]:
                lines.extend(f"      {line}" for line in format_target(target))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``kda-patches conformance``."""
    parser = argparse.ArgumentParser(prog="kda-patches conformance", description=__doc__.splitlines()[0])
    parser.add_argument("stacks", nargs="*", metavar="STACK",
                        help="dist==version[+dist==version...] (default: the support matrix)")
    parser.add_argument("--json", action="store_true", help="machine-readable report of every stack")
    parser.add_argument("--brief", action="store_true", help="only each patch's verdict, no per-target lines")
    parser.add_argument("--write-matrix", nargs="?", const=MATRIX_PATH, metavar="PATH",
                        help=f"write the Markdown matrix of the stacks read (default path {MATRIX_PATH})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run conformance; return the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    try:
        reports = run_matrix(args.stacks or None)
    except (ReleaseFetchError, ValueError) as error:
        print(f"kda-patches conformance: {error}", file=sys.stderr)
        return 2
    if args.write_matrix:
        path = pathlib.Path(args.write_matrix)
        path.write_text(render_matrix(reports), encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps({"stacks": reports}, indent=1, sort_keys=True))
    else:
        print("\n\n".join(format_report(report, verbose=not args.brief) for report in reports))
    broken = any(entry["verdict"] == "broken" for report in reports for entry in report["patches"].values())
    return 1 if broken else 0
