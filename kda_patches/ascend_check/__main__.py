"""``python -m kda_patches.ascend_check``: compile plan variants and indexed twins for Ascend (``make ascend-check``).

Run it in the Ascend check environment (``make setup-ascend``: triton-ascend + ascendnpu-ir + a CPU
torch). Prints one summary line per chip class and one for the calibration, then every problem;
exit status 1 when there is any.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv: list[str] | None = None) -> int:
    """Run the check; return the exit status."""
    from kda_patches.ascend_check.matrix import MATRIX_PATH, render_matrix
    from kda_patches.ascend_check.run import problems, run_check, summary_lines

    parser = argparse.ArgumentParser(prog="python -m kda_patches.ascend_check", description=__doc__.splitlines()[0])
    parser.add_argument("--chips", default="a2a3,a5", help="chip classes, comma-separated (a2a3, a5)")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU count)")
    parser.add_argument("--json", type=pathlib.Path, help="write the full report here")
    parser.add_argument("--write-matrix", action="store_true", help=f"regenerate {MATRIX_PATH}")
    parser.add_argument("--no-calibration", action="store_true", help="skip the vllm-ascend calibration kernels")
    parser.add_argument("--no-twins", action="store_true", help="skip the indexed twins of vllm-ascend's kernels")
    parser.add_argument("--twin-cache-dtypes", help="compile only these cache dtypes' twins, comma-separated "
                        "(default: float32, bfloat16 and float16)")
    args = parser.parse_args(argv)
    chips = tuple(chip.strip() for chip in args.chips.split(",") if chip.strip())
    unknown = sorted(set(chips) - {"a2a3", "a5"})
    if unknown:
        parser.error(f"unknown chip class {', '.join(unknown)}: use a2a3 and/or a5")
    try:
        import ascendnpuir  # noqa: F401
        from triton.backends.ascend import compiler  # noqa: F401
    except ImportError as exc:
        print(f"ascend-check: the Ascend toolchain is not importable here ({exc}); run it in .venv-ascend "
              "(make setup-ascend, then make ascend-check)", file=sys.stderr)
        return 2
    twin_dtypes = None if args.twin_cache_dtypes is None else tuple(
        dtype.strip() for dtype in args.twin_cache_dtypes.split(",") if dtype.strip())
    report = run_check(chips, args.jobs, calibrate=not args.no_calibration, twins=not args.no_twins,
                       twin_cache_dtypes=twin_dtypes)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if args.write_matrix:
        root = pathlib.Path(__file__).resolve().parents[2]
        (root / MATRIX_PATH).write_text(render_matrix(report), encoding="utf-8")
    for line in summary_lines(report):
        print(line)
    found = problems(report)
    for problem in found:
        print("  PROBLEM:", problem)
    print(f"ascend-check: {len(report['variants'])} variants in {report['seconds']} s; "
          f"{'no problems' if not found else f'{len(found)} problems'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
