"""``kda-patches`` command line: status, doctor, install, uninstall, run, regress, bench, conformance.

``kda-run`` (the second console script) is ``kda-patches run`` without the subcommand.
Only ``doctor``, ``regress`` and ``bench`` import torch/vLLM (doctor says so in its output).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kda_patches import current_flags, get_ledger
from kda_patches.ledger import read_ledger_dir, sum_counters


def format_ledger(snapshot: dict) -> str:
    """Return a human-readable block for one process's ledger snapshot."""
    lines = [f"process {snapshot['pid']} ({snapshot.get('role') or 'unknown role'})"]
    lines.extend(f"  {line}" for line in format_switches(snapshot.get("switches", {})))
    from kda_patches import measured
    from kda_patches.effects import NOT_IN_EFFECT, judge_effect

    for name, patch in sorted(snapshot.get("patches", {}).items()):
        lines.append(f"  patch {name}: {patch['state']}" + (f" ({patch['reason']})" if patch["reason"] else ""))
        effect = judge_effect(name, [snapshot])
        if effect is not None:
            label = "APPLIED BUT NOT IN EFFECT" if effect[0] == NOT_IN_EFFECT else effect[0]
            lines.append(f"    effect in this process: {label} ({effect[1]})")
        for target, info in sorted(patch.get("targets", {}).items()):
            lines.append(f"    {info['state']:<15} {target}" + (f" - {info['reason']}" if info["reason"] else ""))
            lines.extend(f"      {line}" for line in measured.target_lines(target, info["reason"]))
    lines.extend(f"  {line}" for line in patch_summaries(snapshot))
    for path, counters in sorted(snapshot.get("counters", {}).items()):
        rendered = ", ".join(f"{key}={value}" for key, value in sorted(counters.items()))
        lines.append(f"  counters {path}: {rendered}")
    for section, facts in sorted(snapshot.get("facts", {}).items()):
        for key, value in sorted(facts.items()):
            lines.append(f"  {section}.{key}: {json.dumps(value, sort_keys=True, default=str)}")
    return "\n".join(lines)


def format_switches(switches: dict) -> list[str]:
    """Return the status lines for one ledger's switches.

    Args:
        switches: the ledger's ``switches`` (``Flags.as_dict()`` of that process).
    Returns:
        ``switches: {...}`` with every switch whose value differs from its default (or that this version does not
        know), then ``choices at their default: {...}`` with every text-valued switch left at its default --
        a choice such as ``KDA_PATCHES_PDL=auto`` still decides what the plans compile, so it is shown, not hidden.
    """
    from kda_patches.flags import Flags

    defaults = Flags().as_dict()
    changed = {key: value for key, value in switches.items() if key not in defaults or value != defaults[key]}
    in_force = {key: value for key, value in switches.items()
                if key in defaults and value == defaults[key] and isinstance(value, str)}
    return [f"switches: {json.dumps(changed, sort_keys=True)}",
            f"choices at their default: {json.dumps(in_force, sort_keys=True)}"]


def patch_summaries(snapshot: dict) -> list[str]:
    """Return the one-line summaries of the patches whose modules define ``format_status_line``."""
    import importlib

    from kda_patches.patches import PATCH_MODULES

    lines = []
    for name in PATCH_MODULES:
        module = importlib.import_module(f"kda_patches.patches.{name}")
        formatter = getattr(module, "format_status_line", None)
        if formatter is not None and module.PATCH.name in snapshot.get("patches", {}):
            lines.append(formatter(snapshot))
    return lines


def aggregate_ledgers(snapshots: list[dict]) -> dict:
    """Sum counters over processes and collect each patch's states and effect (judged over all of them)."""
    states: dict[str, dict[str, int]] = {}
    for snapshot in snapshots:
        for name, patch in snapshot.get("patches", {}).items():
            tally = states.setdefault(name, {})
            tally[patch["state"]] = tally.get(patch["state"], 0) + 1
    from kda_patches.effects import judge_effect

    effects = {name: judge_effect(name, snapshots) for name in sorted(states)}
    return {"processes": len(snapshots), "patch_states": states, "counters": sum_counters(snapshots),
            "effects": {name: {"state": verdict[0], "reason": verdict[1]} for name, verdict in effects.items()
                        if verdict is not None}}


def command_status(args: argparse.Namespace) -> int:
    """Print this process's ledger, or every ledger in ``--from DIR`` plus their aggregate."""
    if args.source:
        if not os.path.isdir(args.source):
            print(f"kda-patches status: --from {args.source!r} is not a directory; pass the "
                  f"KDA_PATCHES_STATUS_DIR the processes wrote to", file=sys.stderr)
            return 2
        snapshots = read_ledger_dir(args.source)
        report = {"ledgers": snapshots, "aggregate": aggregate_ledgers(snapshots)}
    else:
        current_flags()
        snapshots = [get_ledger().snapshot()]
        report = {"ledgers": snapshots, "aggregate": aggregate_ledgers(snapshots)}
    from kda_patches import measured

    report["measured"] = measured.entries()
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True, default=str))
        return 0
    for snapshot in snapshots:
        print(format_ledger(snapshot))
    if args.source:
        print(f"aggregate over {len(snapshots)} process(es): "
              f"{json.dumps(report['aggregate'], sort_keys=True)}")
    print(format_measured(snapshots[0].get("switches", {}) if snapshots else {}))
    return 0


def format_measured(switches: dict) -> str:
    """Return the measured figures behind the switch choices (``kda_patches/measured.json``), one line each.

    Args:
        switches: the switches of the process whose choices are shown (a ledger's ``switches``).
    """
    from kda_patches import measured

    lines = [f"measured behind the switch choices ({measured.TABLE.name}; each line: card, date, run, result):"]
    lines.extend(f"  {line}" for line in measured.switch_lines(switches))
    return "\n".join(lines)


def command_doctor(args: argparse.Namespace) -> int:
    """Report versions, bootstrap facts, device backend and target resolution (imports vLLM)."""
    from kda_patches.doctor import collect_report, format_report

    report = collect_report()
    print(json.dumps(report, indent=1, sort_keys=True, default=str) if args.json else format_report(report))
    return 0


def command_install(args: argparse.Namespace) -> int:
    """Write ``kda_patches.pth`` so every interpreter of that site imports the overlay."""
    from kda_patches.install import install_pth

    print(f"installed {install_pth(user=args.user, prefix=args.prefix)}")
    return 0


def command_uninstall(args: argparse.Namespace) -> int:
    """Remove ``kda_patches.pth`` (a missing file is fine)."""
    from kda_patches.install import uninstall_pth

    removed = uninstall_pth(user=args.user, prefix=args.prefix)
    print(f"removed {removed}" if removed else "nothing to remove")
    return 0


def command_run(args: argparse.Namespace) -> int:
    """Prepare the environment (LD_LIBRARY_PATH, OPP paths) and exec the command."""
    from kda_patches.env import launch

    command = [part for part in args.command if part != "--"] if args.command[:1] == ["--"] else args.command
    if not command:
        print("kda-patches run: give the command to run after '--', e.g. kda-patches run -- vllm serve MODEL",
              file=sys.stderr)
        return 2
    launch(command)
    return 0  # launch execs; reached only by test doubles


DELEGATED = {"regress": "kda_patches.regress.cli", "bench": "kda_patches.bench",
             "conformance": "kda_patches.releases.cli"}


def command_delegate(module: str, argv: list[str]) -> int:
    """Hand the remaining arguments to ``module.main(argv)`` (regress, bench, conformance own their options)."""
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    """Return the ``kda-patches`` argument parser."""
    parser = argparse.ArgumentParser(prog="kda-patches", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="what was applied/skipped and which paths ran")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--from", dest="source", metavar="DIR", help="aggregate the ledgers written to DIR")
    status.set_defaults(handler=command_status)
    doctor = commands.add_parser("doctor", help="versions, CANN discovery, preloads, device, target resolution")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(handler=command_doctor)
    for name, handler in (("install", command_install), ("uninstall", command_uninstall)):
        sub = commands.add_parser(name, help=f"{name} kda_patches.pth (activation in every interpreter)")
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--user", action="store_true", help="the user site-packages")
        where.add_argument("--prefix", metavar="P", help="P/lib/pythonX.Y/site-packages")
        sub.set_defaults(handler=handler)
    run = commands.add_parser("run", help="launch CMD with the bootstrap environment set before exec")
    run.add_argument("command", nargs=argparse.REMAINDER)
    run.set_defaults(handler=command_run)
    for name in DELEGATED:  # parsed by their own modules (see main); listed here for --help
        commands.add_parser(name, help=f"see `kda-patches {name} --help`", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kda-patches``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        return command_delegate(DELEGATED[argv[0]], argv[1:])
    args = build_parser().parse_args(argv)
    return args.handler(args)


def run_main() -> int:
    """Entry point of ``kda-run``: ``kda-run CMD...`` == ``kda-patches run -- CMD...``."""
    return main(["run", "--", *sys.argv[1:]])
