"""Compile the state-copy cast kernels of two source trees for CUDA sm_90 (no GPU needed) and compare the PTX.

    python scripts/ptx_compare.py BEFORE_TREE AFTER_TREE [--out FILE.json] [--plans BENCH.json]

Each tree is a folder holding ``kda_patches/`` (e.g. ``git archive COMMIT kda_patches | tar -x -C DIR``).
Per kernel variant it reports the PTX instruction count, a hash of the instruction text and the per-opcode
counts of both trees, run in separate interpreters. Identical PTX means identical device code on that
Triton; it is evidence about a kernel change, not a benchmark (the H200 measures time).

With ``--plans``, the kernels compiled are instead every fused plan variant recorded in a state-copy benchmark
JSON, plain or ``.json.xz`` (``plans.<shape>/<cache>:<final>.constexprs``), each at the constexprs that plan
launched it with.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r'''
import collections, hashlib, json, lzma, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kda_patches.state_copy import kernels
P = 12 * 128 * 128
DTYPES = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}


def recorded_cases(path):
    """The fused variants of a benchmark JSON's plans: label -> (kernel, cache, packed, index, constexprs)."""
    names = [p.name for p in kernels.copy_rows_kernel.params if p.is_constexpr]
    cases = {}
    with (lzma.open if path.endswith(".xz") else open)(path, "rt", encoding="utf-8") as handle:
        plans = json.load(handle)["plans"]
    for key, plan in plans.items():
        cache = key.split("/")[1].split(":")[0]
        for variant, values in plan["constexprs"].items():
            kind, op, index = variant.split("/")[:3]
            if kind != "fused":
                continue
            packed = variant.split("/")[3] if op == "scatter" else cache
            consts = {name: (value == "True" if value in ("True", "False") else int(value))
                      for name, value in zip(names, values)}
            cases[f"{key} {variant}"] = (kernels.copy_rows_kernel, DTYPES[cache], DTYPES[packed],
                                         "*i32" if index == "int32" else "*i64", consts)
    return cases


CASES = {
    "fused scatter fp32->bf16": (kernels.copy_rows_kernel, "*bf16", "*fp32", dict(NUM_ROWS=1024, ROW_STRIDE=P + 8192,
        PAYLOAD=P, BLOCK=2048, EVEN=True, SCATTER=True, STREAM=True, SRC=0, DST=1, NAN_RULE=0, NAN_BITS=0x7FC0)),
    "fused scatter fp32->fp32": (kernels.copy_rows_kernel, "*fp32", "*fp32", dict(NUM_ROWS=1024, ROW_STRIDE=P + 8192,
        PAYLOAD=P, BLOCK=1024, EVEN=True, SCATTER=True, STREAM=True, SRC=0, DST=0, NAN_RULE=0, NAN_BITS=0)),
    "fused scatter bf16->fp32": (kernels.copy_rows_kernel, "*fp32", "*bf16", dict(NUM_ROWS=1024, ROW_STRIDE=P + 8192,
        PAYLOAD=P, BLOCK=1024, EVEN=True, SCATTER=True, STREAM=True, SRC=1, DST=0, NAN_RULE=2, NAN_BITS=0)),
    "fused gather bf16": (kernels.copy_rows_kernel, "*bf16", "*bf16", dict(NUM_ROWS=1024, ROW_STRIDE=P + 8192,
        PAYLOAD=P, BLOCK=2048, EVEN=True, SCATTER=False, STREAM=False, SRC=1, DST=1, NAN_RULE=0, NAN_BITS=0)),
    "fallback cast fp32->fp16": (kernels.scatter_cast_items_kernel, "*fp16", "*fp32", dict(NUM_ROWS=1024,
        ROW_STRIDE=P + 8192, PAYLOAD=P, TILES=P // 8192, BLOCK=8192, SRC=0, DST=2, NAN_RULE=1, NAN_BITS=0)),
}
if len(sys.argv) > 2:
    CASES = recorded_cases(sys.argv[2])
else:
    CASES = {label: (kernel, cache, packed, "*i32", consts) for label, (kernel, cache, packed, consts) in CASES.items()}
out = {}
for label, (kernel, cache, packed, index, consts) in CASES.items():
    sig = {"cache_ptr": cache, "packed_ptr": packed, "index_ptr": index, "flag_ptr": "*i1"}
    sig.update({name: "constexpr" for name in consts})
    ptx = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    body = [line.strip() for line in ptx.splitlines() if line.strip()
            and not line.strip().startswith(("//", ".", "{", "}", "$")) and not line.strip().endswith(":")]
    out[label] = {"instructions": len(body), "sha": hashlib.sha256("\n".join(body).encode()).hexdigest()[:16],
                  "ops": dict(sorted(collections.Counter(line.split()[0] for line in body).items()))}
print(json.dumps({"triton": triton.__version__, "kernels": out}))
'''


def compile_tree(tree: str, plans: str | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, tree, *([plans] if plans else [])], capture_output=True,
                          text=True, check=True,
                          env={"PATH": "/usr/bin:/bin", "TRITON_DEFAULT_FP_FUSION": "1"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--out")
    parser.add_argument("--plans", help="a state-copy benchmark JSON: compile its plans' fused variants")
    args = parser.parse_args()
    before, after = compile_tree(args.before, args.plans), compile_tree(args.after, args.plans)
    rows = []
    for label, old in before["kernels"].items():
        new = after["kernels"][label]
        opcodes = sorted(set(old["ops"]) | set(new["ops"]))
        changed = {op: (old["ops"].get(op, 0), new["ops"].get(op, 0)) for op in opcodes
                   if old["ops"].get(op, 0) != new["ops"].get(op, 0)}
        rows.append({"kernel": label, "before": old["instructions"], "after": new["instructions"],
                     "identical": old["sha"] == new["sha"], "opcode_changes": changed})
        print(f"{label:28s} {old['instructions']:5d} -> {new['instructions']:5d} instructions  "
              f"{'identical PTX' if old['sha'] == new['sha'] else 'PTX differs'}  {changed or ''}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"triton": after["triton"], "target": "cuda sm_90", "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
