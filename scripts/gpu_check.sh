#!/usr/bin/env bash
# GPU verification in one call (NVIDIA H200 machine: python3 with torch + triton, no network, no vLLM).
#
#   scripts/gpu_check.sh OUT_DIR          (or: make gpu-check OUT_DIR=...)
#
# 1. installs the wheels brought along in .whl/ (e.g. wrapt) into a private target directory;
# 2. runs the state-copy suite compiled on CUDA (pytest --run-gpu tests/state_copy: the CPU tests
#    again on the GPU plus the tests marked `gpu`), then every other test marked `gpu`;
# 3. runs the state-copy benchmark (kda-patches bench state-copy) -> OUT_DIR/state_copy_bench.{json,png};
# 4. stages the carried .bundle/carry/run* pieces (scripts/gpu/gpu_harness.py), then runs every scripts/gpu/*.py in
#    sorted order as `python scripts/gpu/X.py --out OUT_DIR` (not vllm_bundle.py, which builds the bundle on the CPU
#    machine, nor gpu_harness.py; vllm_layers_check.py only when the bundle was carried, vllm_engine_check.py only
#    when the bundle and vLLM's compiled library are staged, which takes two consecutive calls).
# Every step runs even when an earlier one failed; the exit status is non-zero if any failed. All output
# goes to OUT_DIR/gpu_check.log (one file: the device returns at most 8), each step's status to
# OUT_DIR/gpu_check_summary.txt. Knobs: PYTHON, BENCH_SEED, BENCH_TRIALS,
# BENCH_ARGS (extra benchmark arguments), SKIP_BENCH=1, SKIP_TESTS=1.
set -u -o pipefail

OUT_DIR=${1:-${OUT_DIR:-${OUT:-out/gpu}}}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/gpu_check_summary.txt"
LOG="$OUT_DIR/gpu_check.log"
: >"$SUMMARY"
: >"$LOG"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

SITE=${KDA_GPU_SITE:-/tmp/kda-gpu-site}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl || echo "wheel install failed" | tee -a "$SUMMARY"
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# the GPU machine has no network: released sources (bench peer, its test) come from a carried release cache
if [ -d "$ROOT/.release-cache" ]; then export KDA_PATCHES_RELEASE_CACHE="$ROOT/.release-cache"; fi

failures=0
step() {  # step NAME COMMAND...: run, append to the log, record the status
    local name=$1
    shift
    local started=$SECONDS
    echo "=== $name: $*" | tee -a "$LOG"
    "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    echo "$name: exit $status ($((SECONDS - started)) s)" | tee -a "$SUMMARY"
    if [ "$status" -ne 0 ]; then failures=$((failures + 1)); fi
    return 0
}

no_tests_ok() {  # pytest exits 5 when no test was collected: fine for the optional `gpu` sweep
    "$@"
    local status=$?
    if [ "$status" -eq 5 ]; then return 0; fi
    return "$status"
}

"$PYTHON" - <<'EOF' 2>&1 | tee -a "$LOG"
import platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__,
      "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
EOF

if [ "${SKIP_TESTS:-0}" != "1" ]; then
    step pytest_state_copy "$PYTHON" -m pytest -q -p no:cacheprovider --run-gpu tests/state_copy
    step pytest_gpu_marked no_tests_ok "$PYTHON" -m pytest -q -p no:cacheprovider --run-gpu -m gpu \
        --continue-on-collection-errors --ignore=tests/state_copy tests
fi

if [ "${SKIP_BENCH:-0}" != "1" ]; then
    # shellcheck disable=SC2086
    step bench_state_copy "$PYTHON" -m kda_patches.bench state-copy --output "$OUT_DIR/state_copy_bench.json" \
        --seed "${BENCH_SEED:-41}" --trials "${BENCH_TRIALS:-30}" ${BENCH_ARGS:-}
fi

VLLM_BUNDLE=.bundle/vllm-0.33.0-cp312.zip  # vLLM's own layers (issue 9): built here by scripts/gpu/vllm_bundle.py
# vLLM's whole engine (issue 26) needs the bundle and vLLM's compiled library, carried in pieces over consecutive
# calls (scripts/gpu/vllm_bundle.py carry): stage whatever run folder this call brought
for carried in .bundle/carry/run*; do
    if [ -d "$carried" ]; then "$PYTHON" scripts/gpu/gpu_harness.py stage "$carried" | tee -a "$SUMMARY"; fi
done
for script in $(ls scripts/gpu/*.py 2>/dev/null | sort); do
    case "$(basename "$script")" in
        vllm_bundle.py) continue ;;  # the bundle builder runs on the CPU machine (needs the package registry)
        gpu_harness.py) continue ;;  # the shared harness (staging ran above)
        vllm_engine_check.py) if ! "$PYTHON" scripts/gpu/gpu_harness.py ready >>"$SUMMARY"; then
            echo "gpu_vllm_engine_check: skipped (bundle and compiled library not staged)" | tee -a "$SUMMARY"
            continue; fi ;;
        vllm_layers_check.py) if [ ! -f "$VLLM_BUNDLE" ]; then
            echo "gpu_vllm_layers_check: skipped (no $VLLM_BUNDLE: run scripts/gpu/vllm_bundle.py build, carry it)" \
                | tee -a "$SUMMARY"; continue; fi ;;
    esac
    step "gpu_$(basename "$script" .py)" "$PYTHON" "$script" --out "$OUT_DIR"
done

echo "=== summary ($failures failed)"
cat "$SUMMARY"
[ "$failures" -eq 0 ]
