"""One engine per process, the same batch of requests timed several times: many samples per device minute.

serve-ab measures vLLM's own ``bench throughput``: one timed region per fresh process, and on the H200 a process
spends several times longer starting and stopping than its timed region lasts (``docs/results/h200-vllm-engine/``),
so an A/B of five rounds takes ten minutes and a
bisection over patches (which one costs the time?) does not fit a session's device time. Here each process
(an *arm*) starts one engine, runs the batch once unmeasured, then ``--repeats`` times measured; the arms differ
only in their environment (``KDA_PATCHES=0``; ``KDA_PATCHES=1``; ``KDA_PATCHES=1`` with one patch disabled, ...).
The baseline runs first and again last, so drift over the run shows as a difference between its two runs.
serve-ab stays the engine-throughput result; this is the instrument that says where a difference comes from.

``python -m kda_patches.bench.engine_repeat --out DIR [--arm NAME:VAR=VALUE,...] -- --model DIR --num-prompts N
--input-len L --output-len O [--max-num-seqs S] [--repeats R] [--engine-arg KEY=JSON ...]``
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

BASELINE = "baseline"
CHILD_FLAG = "--child"


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Return ``num_prompts`` prompts of ``input_len`` token ids drawn from ``[10, vocab_size)`` (ids below 10 are
    left out: special tokens sit there in the tiny tokenizers)."""
    if vocab_size <= 10:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary token ids (ids below 10 are left out)")
    draw = random.Random(seed)
    return [[draw.randrange(10, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """Parse ``NAME`` or ``NAME:VAR=VALUE,VAR=VALUE`` into the arm's name and environment (``KDA_PATCHES=1`` added).

    Raises:
        ValueError: an empty name, the reserved name ``baseline``, or a setting without ``=``.
    """
    name, _, settings = text.partition(":")
    if not name or name == BASELINE:
        raise ValueError(f"--arm {text!r}: give a name other than {BASELINE!r} (the baseline arm is always run)")
    env = {"KDA_PATCHES": "1"}
    for setting in filter(None, settings.split(",")):
        variable, equals, value = setting.partition("=")
        if not equals or not variable:
            raise ValueError(f"--arm {text!r}: {setting!r} is not VAR=VALUE")
        env[variable] = value
    return name, env


def arm_order(arms: list[str], seed: int) -> list[str]:
    """Return the run order: the baseline, the other arms shuffled by ``seed``, the baseline again."""
    shuffled = list(arms)
    random.Random(seed).shuffle(shuffled)
    return [BASELINE, *shuffled, BASELINE]


def run_child(child_args: list[str], env_overrides: dict[str, str], run_dir: str, timeout_s: float,
              profile: bool = False) -> dict[str, Any]:
    """Run one arm's process; return its result (``elapsed_s`` per measured repeat), ledgers and step times.

    ``profile``: the arm also runs one profiled pass after its measured ones (``--profile-dir RUN_DIR/profile``);
    ``profile_tables`` lists the operator tables vLLM's torch profiler wrote there (``*.profiler_out.txt``).
    """
    from kda_patches.bench.serve_ab import run_env

    os.makedirs(run_dir)
    env = run_env(env_overrides, os.path.join(run_dir, "status"))
    started = time.perf_counter()
    with open(os.path.join(run_dir, "run.log"), "wb") as log:
        try:
            returncode = subprocess.run(child_command(child_args, run_dir, profile), env=env, stdout=log,
                                        stderr=log, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            returncode = None
    return finish_record(run_dir, env_overrides, returncode, time.perf_counter() - started)


def child_command(child_args: list[str], run_dir: str, profile: bool, *extra: str) -> list[str]:
    """Return the command line of one arm's process (result in ``RUN_DIR/result.json``)."""
    command = [sys.executable, "-m", "kda_patches.bench.engine_repeat", CHILD_FLAG, *child_args,
               "--result", os.path.join(run_dir, "result.json"), *extra]
    return command + (["--profile-dir", os.path.join(run_dir, "profile")] if profile else [])


def finish_record(run_dir: str, env_overrides: dict[str, str], returncode: int | None,
                  wall_s: float) -> dict[str, Any]:
    """Return an ended arm's record: its result file, the ledgers and step times of ``RUN_DIR/status``, the
    profiler tables, and ``error`` with the log's tail when it did not exit 0 with a result."""
    from kda_patches.bench.step_times import load_step_times
    from kda_patches.regress.ledgers import collect_ledgers

    status_dir, result_path = os.path.join(run_dir, "status"), os.path.join(run_dir, "result.json")
    record: dict[str, Any] = {"env": env_overrides, "wall_s": wall_s, "returncode": returncode,
                              "ledgers": collect_ledgers(status_dir), "step_times": load_step_times(status_dir),
                              "profile_tables": sorted(glob.glob(os.path.join(run_dir, "profile", "*_out.txt")))}
    if returncode != 0 or not os.path.isfile(result_path):
        record["error"] = "timed out" if returncode is None else f"exited with status {returncode}"
        with open(os.path.join(run_dir, "run.log"), errors="replace") as handle:
            record["log_tail"] = handle.read()[-3000:]
        return record
    with open(result_path) as handle:
        record.update(json.load(handle))
    return record


def summarize_arms(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per arm: its measured repeats, their median, and the median over the baseline's median (> 1: slower).

    The baseline's repeats of both its runs are pooled; ``baseline_drift`` is its last run's median over its first.
    """
    pooled: dict[str, list[float]] = {}
    for name, record in runs:
        pooled.setdefault(name, []).extend(record.get("elapsed_s", []))
    base = statistics.median(pooled[BASELINE]) if pooled.get(BASELINE) else None
    summary = {}
    for name, samples in pooled.items():
        if not samples:
            summary[name] = {"repeats": 0}
            continue
        median = statistics.median(samples)
        summary[name] = {"repeats": len(samples), "median_s": median, "min_s": min(samples), "max_s": max(samples),
                         "over_baseline": median / base if base else None}
    first, last = ([record.get("elapsed_s") for name, record in runs if name == BASELINE] + [None, None])[:2]
    if first and last:
        summary[BASELINE]["baseline_drift"] = statistics.median(last) / statistics.median(first)
    return summary


def run_arms(arms: dict[str, dict[str, str]], child_args: list[str], out_dir: str, seed: int = 0,
             timeout_s: float = 900.0, profile: bool = False) -> dict[str, Any]:
    """Run every arm (plus the baseline first and last) in fresh processes; write and return ``engine_repeat.json``.

    Args:
        arms: name -> environment overrides (see :func:`parse_arm`).
        child_args: the engine's arguments (after ``--``).
        out_dir: a new or empty directory.
        seed: of the arm order.
        profile: each arm also runs one profiled pass (see :func:`run_child`).
    """
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir} is not empty; give a new --out")
    os.makedirs(out_dir, exist_ok=True)
    plan = {BASELINE: {"KDA_PATCHES": "0"}, **arms}
    runs: list[tuple[str, dict[str, Any]]] = []
    for position, name in enumerate(arm_order(list(arms), seed)):
        record = run_child(child_args, plan[name], os.path.join(out_dir, f"{position}-{name}"), timeout_s, profile)
        runs.append((name, record))
        print(f"  {name:<24} " + (record.get("error") or " ".join(f"{value:.3f}" for value in record["elapsed_s"])),
              flush=True)
        # after every arm: a device call that ends mid-run still brings back the arms that finished
        document = {"child_args": child_args, "arms": plan, "order": [name for name, _ in runs], "seed": seed,
                    "summary": summarize_arms(runs), "runs": [{"arm": name, **record} for name, record in runs]}
        write_document(document, out_dir)
    return document


def write_document(document: dict[str, Any], out_dir: str) -> str:
    """Write ``OUT_DIR/engine_repeat.json`` atomically (a reader sees the previous write or this one)."""
    path = os.path.join(out_dir, "engine_repeat.json")
    with open(path + ".partial", "w") as handle:
        json.dump(document, handle, indent=1, sort_keys=True)
    os.replace(path + ".partial", path)
    return path


def format_summary(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Return the lines of the per-arm table."""
    lines = [f"{'arm':<24} {'repeats':>7} {'median s':>9} {'min s':>8} {'max s':>8} {'/ baseline':>10}"]
    for name, row in summary.items():
        if not row["repeats"]:
            lines.append(f"{name:<24} {0:>7}  (no measured repeat: see its run.log)")
            continue
        ratio = row["over_baseline"]
        lines.append(f"{name:<24} {row['repeats']:>7} {row['median_s']:>9.3f} {row['min_s']:>8.3f} "
                     f"{row['max_s']:>8.3f} {ratio if ratio is None else format(ratio, '.3f'):>10}")
    return lines


def child_parser() -> argparse.ArgumentParser:
    """Return the parser of one arm's process."""
    parser = argparse.ArgumentParser(prog="engine_repeat --child")
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--input-len", type=int, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                        help="one more LLM(...) argument, e.g. gpu_memory_utilization=0.6")
    parser.add_argument("--result", required=True)
    parser.add_argument("--serve-fd", type=int, help="interleaved runs (engine_interleave): after the unmeasured "
                        "pass, report ready on this file descriptor, then one timed pass per 'pass' line on stdin "
                        "until 'quit' (--repeats is not used)")
    parser.add_argument("--profile-dir", help="after the measured passes, one pass under vLLM's torch profiler, its "
                        "traces and operator tables written here (not a measured pass)")
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Return the ``LLM(...)`` arguments of a child: dummy weights, the shape's limits, each ``--engine-arg``."""
    kwargs: dict[str, Any] = {"model": args.model, "load_format": "dummy", "max_num_seqs": args.max_num_seqs,
                              "max_model_len": args.max_model_len, "seed": args.seed}
    if getattr(args, "profile_dir", None):
        kwargs["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": os.path.abspath(args.profile_dir),
                                     "torch_profiler_with_stack": False}
    for item in args.engine_arg:
        key, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"--engine-arg {item!r} is not KEY=JSON")
        kwargs[key] = json.loads(value)
    return kwargs


def child_main(argv: list[str]) -> int:
    """One arm: start the engine, run the batch once unmeasured and ``--repeats`` times measured, write the result.

    With ``--serve-fd``, the measured passes come one per ``pass`` command on stdin, each answered on that file
    descriptor with a JSON line (``elapsed_s``, and the pass's ``start`` / ``end`` in ``time.time()`` seconds), after a
    first line ``{"ready": true, ...}``; ``quit`` ends them. Every request decodes exactly ``--output-len`` tokens
    (``ignore_eos``); a pass that returns another count is an error, not a sample.

    Raises:
        SystemExit: a pass produced another token count, or stdin gave a command other than ``pass`` / ``quit``.
    """
    args = child_parser().parse_args(argv)
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    startup_s = time.perf_counter() - started
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": ids} for ids in random_prompts(args.num_prompts, args.input_len, vocab, args.seed)]
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True, temperature=0.0)

    def timed_pass(number: int) -> float:
        begin = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        produced = sum(len(output.outputs[0].token_ids) for output in outputs)
        if produced != args.num_prompts * args.output_len:
            raise SystemExit(f"repeat {number}: {produced} output tokens, expected "
                             f"{args.num_prompts} x {args.output_len}")
        return seconds

    warmup_s = timed_pass(0)
    elapsed: list[float] = []
    if args.serve_fd is None:
        elapsed = [timed_pass(number) for number in range(1, args.repeats + 1)]
    else:
        with os.fdopen(args.serve_fd, "w", buffering=1) as reply:
            reply.write(json.dumps({"ready": True, "startup_s": startup_s, "warmup_s": warmup_s}) + "\n")
            for line in sys.stdin:
                command = line.strip()
                if command == "quit":
                    break
                if command != "pass":
                    raise SystemExit(f"engine_repeat --serve-fd: unknown command {command!r} (pass or quit)")
                begin = time.time()
                elapsed.append(timed_pass(len(elapsed) + 1))
                reply.write(json.dumps({"elapsed_s": elapsed[-1], "start": begin, "end": time.time()}) + "\n")
    if args.profile_dir:
        llm.start_profile()
        llm.generate(prompts, params, use_tqdm=False)
        llm.stop_profile()
    with open(args.result, "w") as handle:
        json.dump({"startup_s": startup_s, "warmup_s": warmup_s, "elapsed_s": elapsed,
                   "output_tokens": args.num_prompts * args.output_len}, handle)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the driver's options and run the arms; exit 1 when an arm failed."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD_FLAG]:
        return child_main(argv[1:])
    own, child = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m kda_patches.bench.engine_repeat", description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arm", action="append", default=[], help="NAME or NAME:VAR=VALUE,... (default: patched)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--profile", action="store_true", help="each arm also runs one pass under vLLM's torch "
                        "profiler after its measured passes (RUN_DIR/profile/*.profiler_out.txt)")
    parser.add_argument("--cpus", help="pin every arm's processes to these same host cores, e.g. 2-9 "
                        "(kda_patches.bench.cpu_pin; interleaved runs only)")
    parser.add_argument("--interleave", type=int, metavar="CYCLES", help="every arm's engine alive at once, CYCLES "
                        "cycles of one timed pass per arm, paired ratios (kda_patches.bench.engine_interleave)")
    args = parser.parse_args(own)
    if not child:
        parser.error("give the engine's arguments after --")
    try:
        parsed = [parse_arm(text) for text in (args.arm or ["patched"])]
        names = [name for name, _ in parsed]
        if len(set(names)) != len(names):
            raise ValueError(f"--arm names must differ, got {names}")
        arms = dict(parsed)
        if args.cpus and args.interleave is None:
            raise ValueError("--cpus pins the arms of an interleaved run: give --interleave CYCLES too")
        if args.interleave is not None:
            from kda_patches.bench.cpu_pin import parse_cpus
            from kda_patches.bench.engine_interleave import format_pairs, run_interleaved

            document = run_interleaved(arms, child, os.path.abspath(args.out), args.interleave, args.seed,
                                       args.timeout, args.profile, cpus=parse_cpus(args.cpus) if args.cpus else None)
        else:
            document = run_arms(arms, child, os.path.abspath(args.out), args.seed, args.timeout, args.profile)
    except ValueError as error:
        parser.error(str(error))
    if args.interleave is not None:
        print("\n".join(format_pairs(document)))
        return 1 if "error" in document or any("error" in run for run in document["runs"]) else 0
    print("\n".join(format_summary(document["summary"])))
    return 1 if any("error" in run for run in document["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
