#!/usr/bin/env bash
# Kernel A/B on the GPU machine: the compiled state-copy suite on this tree, then the GDN and Kimi state-copy
# benchmarks of a baseline tree and of this tree, alternately (ROUNDS times each, same seed), then a row-by-row
# comparison of the plan's graph-replay medians (scripts/compare_bench.py: rows more than 2 % slower are flagged).
#
#   git archive BASELINE_COMMIT kda_patches | (mkdir -p ab_baseline && tar -x -C ab_baseline)   # on the CPU machine
#   bash scripts/gpu_bench_ab.sh OUT_DIR [ROUNDS]                                              # on the GPU machine
#
# ab_baseline/ is untracked (not ignored), so the device tool carries it with the working tree; carry .whl too
# (wrapt). Everything goes to OUT_DIR: run_pytest_state_copy_compiled.log, gdn_{before,after}_N.json/.log,
# kimi_{before,after}_N.json/.log, compare_gdn.txt, compare_kimi.txt.
set -u -o pipefail
OUT_DIR=${1:?usage: gpu_bench_ab.sh OUT_DIR [ROUNDS]}
ROUNDS=${2:-2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SITE=${KDA_GPU_SITE:-/tmp/kda-gpu-site}
mkdir -p "$OUT_DIR"
[ -d "$ROOT/ab_baseline/kda_patches" ] || { echo "no $ROOT/ab_baseline/kda_patches: see the header" >&2; exit 2; }
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$ROOT"/.whl/*.whl >/dev/null
fi
unset TRITON_INTERPRET
cd "$ROOT" || exit 2
PYTHONPATH="$ROOT:$SITE" python3 -m pytest -q -p no:cacheprovider --run-gpu tests/state_copy \
    > "$OUT_DIR/pytest_state_copy_compiled.log" 2>&1
echo "pytest: exit $?"; tail -2 "$OUT_DIR/pytest_state_copy_compiled.log"
for round in $(seq 1 "$ROUNDS"); do
    for side in before after; do
        if [ "$side" = before ]; then tree="$ROOT/ab_baseline"; else tree="$ROOT"; fi
        # -m puts the working directory first on sys.path: run from the tree whose kda_patches is measured
        (cd "$tree" && PYTHONPATH="$tree:$SITE" python3 -m kda_patches.bench gdn-state-copy \
            --output "$OUT_DIR/gdn_${side}_$round.json" --seed 41 --trials 20 --graph-calls 50 \
            > "$OUT_DIR/gdn_${side}_$round.log" 2>&1); echo "gdn $side $round: exit $?"
        (cd "$tree" && PYTHONPATH="$tree:$SITE" python3 -m kda_patches.bench state-copy \
            --output "$OUT_DIR/kimi_${side}_$round.json" --seed 41 --trials 30 \
            > "$OUT_DIR/kimi_${side}_$round.log" 2>&1); echo "kimi $side $round: exit $?"
    done
done
python3 scripts/compare_bench.py --before "$OUT_DIR"/gdn_before_*.json --after "$OUT_DIR"/gdn_after_*.json \
    > "$OUT_DIR/compare_gdn.txt"; gdn=$?
python3 scripts/compare_bench.py --impl fused,fallback --before "$OUT_DIR"/kimi_before_*.json \
    --after "$OUT_DIR"/kimi_after_*.json > "$OUT_DIR/compare_kimi.txt"; kimi=$?
tail -1 "$OUT_DIR/compare_gdn.txt" "$OUT_DIR/compare_kimi.txt"
[ "$gdn" -eq 0 ] && [ "$kimi" -eq 0 ]
