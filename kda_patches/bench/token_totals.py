"""Did ``vllm bench throughput`` run the request shape its arguments ask for? (serve-ab, issue 26)

vLLM 0.33's throughput benchmark takes the random dataset's lengths from ``--random-input-len`` /
``--random-output-len`` (defaults 1024 / 128) and silently ignores ``--input-len`` / ``--output-len`` when the dataset
is ``random``: an A/B declared as "64 prompt + 32 output tokens" ran 1024 + 128 on the H200. The benchmark prints
what it ran (``Total num prompt tokens: N``, ``Total num output tokens: N``); this module compares those totals with
the totals the arguments ask for, so a run whose shape is not the declared one fails instead of being reported.

Only exact-length random shapes are checked: ``--dataset-name random`` without a ``--random-range-ratio`` other than
0, with ``--num-prompts`` and at least one length given. Other datasets, ranged lengths and unstated lengths are not
checked (:func:`requested_token_totals` returns None for what it cannot know).
"""

from __future__ import annotations

import re

TOLERANCE = 0.05  # relative: catches an ignored option (16x off here), not a tokenizer's re-encoding jitter
_PRINTED = {"prompt": re.compile(r"Total num prompt tokens:\s+(\d+)"),
            "output": re.compile(r"Total num output tokens:\s+(\d+)")}
_LENGTH_OPTIONS = {"prompt": ("--random-input-len", "--input-len"), "output": ("--random-output-len", "--output-len")}


def option_value(bench: list[str], name: str) -> str | None:
    """Return the value of ``--name VALUE`` or ``--name=VALUE`` in ``bench`` (the last one given), or None."""
    found = None
    for index, argument in enumerate(bench):
        if argument == name and index + 1 < len(bench):
            found = bench[index + 1]
        elif argument.startswith(name + "="):
            found = argument.split("=", 1)[1]
    return found


def requested_token_totals(bench: list[str]) -> dict[str, int] | None:
    """Return the prompt and output token totals the arguments ask for (``{"prompt": N, "output": M}``, either may
    be missing), or None when the shape is not an exact-length random one.

    The random dataset's own options win over the legacy ones (as vLLM's benchmark does); a random prefix
    (``--random-prefix-len``) adds to every prompt.
    """
    if option_value(bench, "--dataset-name") != "random" or option_value(bench, "--num-prompts") is None:
        return None
    if float(option_value(bench, "--random-range-ratio") or 0) != 0.0:
        return None
    prompts = int(option_value(bench, "--num-prompts") or 0)
    totals = {}
    for kind, names in _LENGTH_OPTIONS.items():
        length = next(filter(None, (option_value(bench, name) for name in names)), None)
        if length is not None:
            totals[kind] = prompts * int(length)
    if "prompt" in totals:
        totals["prompt"] += prompts * int(option_value(bench, "--random-prefix-len") or 0)
    return totals or None


def printed_token_totals(log_text: str) -> dict[str, int]:
    """Return the totals the benchmark printed (the last of each kind), e.g. ``{"prompt": 262144, "output": 32768}``."""
    totals = {}
    for kind, pattern in _PRINTED.items():
        found = pattern.findall(log_text)
        if found:
            totals[kind] = int(found[-1])
    return totals


def check_token_totals(bench: list[str], log_text: str) -> str | None:
    """Return why a finished throughput run did not run the shape its arguments ask for, or None.

    A total the arguments ask for and the benchmark printed that differs by more than :data:`TOLERANCE` (relative)
    is a mismatch; so is an asked-for total the benchmark did not print. Shapes :func:`requested_token_totals`
    cannot know are not checked.
    """
    requested = requested_token_totals(bench)
    if not requested or bench[:1] != ["throughput"]:
        return None
    printed = printed_token_totals(log_text)
    wrong = []
    for kind, asked in requested.items():
        ran = printed.get(kind)
        if ran is None:
            wrong.append(f"asked for {asked} {kind} tokens, but the benchmark printed no 'Total num {kind} tokens'")
        elif abs(ran - asked) > TOLERANCE * asked:
            wrong.append(f"ran {ran} {kind} tokens, the arguments ask for {asked}")
    if not wrong:
        return None
    return ("the benchmark did not run the requested shape: " + "; ".join(wrong) + ". With --dataset-name random, "
            "give the lengths as --random-input-len / --random-output-len (vLLM's throughput benchmark may ignore "
            "--input-len / --output-len for that dataset)")
