"""``kda-patches regress``: A/B-run a workload with the overlay off and on and compare outputs.

Exit status: 0 outputs equal and every expectation met; 1 outputs differ or a patch the workload
expects was not exercised; 2 a run failed (including a STRICT skip) or the arguments were wrong.
"""

from __future__ import annotations

import argparse
import json
import sys

from kda_patches.regress.tiny_model import DEFAULT_CACHE_DIR
from kda_patches.regress.workloads import DEFAULT_WORKLOAD, WORKLOADS, resolve_workload


def parse_param(text: str) -> tuple[str, object]:
    """Parse ``KEY=VALUE`` where VALUE is JSON (bare words are taken as strings)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--param expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``kda-patches regress``."""
    parser = argparse.ArgumentParser(
        prog="kda-patches regress",
        description="Run a workload in fresh processes with KDA_PATCHES=0, then KDA_PATCHES=1 with "
                    "KDA_PATCHES_STRICT=1, compare the outputs (token ids exactly) and report the ledgers "
                    "of every process of the patched run.")
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD,
                        help=f"registered name or module:function (default {DEFAULT_WORKLOAD})")
    parser.add_argument("--list-workloads", action="store_true", help="list the registered workloads and exit")
    parser.add_argument("--tiny-model-dir", action="store_true",
                        help="build the tiny model if needed, print its directory (a --param model=DIR for "
                             "--workload vllm, a --model for bench serve-ab) and exit")
    parser.add_argument("--param", action="append", default=[], type=parse_param, metavar="KEY=VALUE",
                        help="keyword parameter of the workload, VALUE as JSON (repeatable); for --workload vllm: "
                             "model=DIR, prompts=FILE.jsonl, max_tokens, ignore_eos, logprobs, and any vLLM "
                             "engine argument (tensor_parallel_size=2, distributed_executor_backend=ray, ...)")
    parser.add_argument("--baseline", metavar="DIR",
                        help="baseline store: reuse the stored unpatched outputs (recorded when missing)")
    parser.add_argument("--update-baseline", action="store_true",
                        help="run unpatched and overwrite the stored baseline (needs --baseline)")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for floats/tensors (default 0)")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance for floats/tensors (default 0)")
    parser.add_argument("--expect", action="append", metavar="PATCH[:COUNTER]",
                        help="require PATCH applied with COUNTER > 0 in some patched process (repeatable; "
                             "replaces the workload's own expectations; --expect none drops them)")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                        help=f"where the tiny model is built and cached (default {DEFAULT_CACHE_DIR})")
    parser.add_argument("--work-dir", help="keep logs, outputs and ledgers of both runs here")
    parser.add_argument("--timeout", type=float, help="wall-clock limit per run in seconds")
    parser.add_argument("--pythonpath", action="append", default=[], metavar="DIR",
                        help="extra import directory for the runs (repeatable)")
    parser.add_argument("--baseline-runs", type=int, default=None, metavar="N",
                        help="unpatched runs; from 2 on they are compared with each other and a baseline that "
                             "differs from itself is reported as such (default: 2 for the embedded default "
                             "workload, 1 otherwise)")
    parser.add_argument("--verbose", action="store_true", help="show the runs' own output live")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kda-patches regress`` with ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    from kda_patches.regress.report import format_report, report_as_dict
    from kda_patches.regress.runner import run_ab

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_workloads:
        for name, workload in sorted(WORKLOADS.items()):
            print(f"{name}  {workload.target}\n    {workload.summary}")
        return 0
    if args.tiny_model_dir:
        from kda_patches.regress.tiny_model import ensure_tiny_model

        print(ensure_tiny_model(args.cache_dir))
        return 0
    if args.update_baseline and not args.baseline:
        parser.error("--update-baseline needs --baseline DIR")
    try:
        workload = resolve_workload(args.workload)
    except ValueError as error:
        parser.error(str(error))
    baseline_runs = args.baseline_runs if args.baseline_runs is not None else (
        2 if workload.name == DEFAULT_WORKLOAD else 1)
    if baseline_runs < 1:
        parser.error(f"--baseline-runs must be at least 1, got {baseline_runs}")
    expect = None
    if args.expect is not None:
        expect = tuple(item for item in args.expect if item.lower() != "none")
    report = run_ab(workload, dict(args.param), cache_dir=args.cache_dir, baseline_dir=args.baseline,
                    update_baseline=args.update_baseline, rtol=args.rtol, atol=args.atol, expect=expect,
                    work_dir=args.work_dir, timeout_s=args.timeout, pythonpath=tuple(args.pythonpath),
                    stream_logs=args.verbose, baseline_runs=baseline_runs)
    if report.baseline.source == report.patched.source == "not run" and report.errors and not args.json:
        # Refused before any run (bad workload parameters): the one error is the whole answer.
        print(f"kda-patches regress: error: {'; '.join(report.errors)}", file=sys.stderr)
        return report.exit_code
    if args.json:
        json.dump(report_as_dict(report), sys.stdout, indent=1, sort_keys=True, default=str)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return report.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
