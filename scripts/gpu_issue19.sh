#!/usr/bin/env bash
# Issue 19 on the H200, in one or two device calls (no network there; carry .bundle/, .whl/, .release-cache/):
#
#   bash scripts/gpu_issue19.sh OUT_DIR layers   # route_host_costs.py, then vllm_layers_check.py (4 layers;
#                                                # env ROUNDS, LAYERS="kimi_k3 ...", HOST_COST_RUNS)
#   bash scripts/gpu_issue19.sh OUT_DIR host     # only route_host_costs.py (HOST_COST_RUNS processes)
#   bash scripts/gpu_issue19.sh OUT_DIR peer     # kda-patches bench peer (GDN kernels + Kimi plans of the fork)
#
# .release-cache/ needs only vllm-ascend-0.30.0rc2's marker and the four files bench peer loads
# (state_index.py, kda_state_copy_plan.py, triton/kda_state_copy_kernel.py, triton/batch_memcpy.py).
set -u -o pipefail
OUT_DIR=${1:?OUT_DIR}
PART=${2:?layers or peer}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$OUT_DIR"
SITE=${KDA_GPU_SITE:-/tmp/kda-gpu-site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
export PYTHONPATH="$ROOT:$SITE" PYTHONUNBUFFERED=1 KDA_PATCHES_RELEASE_CACHE="$ROOT/.release-cache"
unset TRITON_INTERPRET
status=0
if [ "$PART" = layers ] || [ "$PART" = host ]; then
    for run in $(seq "${HOST_COST_RUNS:-1}"); do  # separate processes: the host's run-to-run spread
        mkdir -p "$OUT_DIR/host-costs-$run"
        timeout 120 python3 scripts/gpu/route_host_costs.py --out "$OUT_DIR/host-costs-$run" \
            >"/tmp/route_host_costs-$run.log" 2>&1
        echo "route_host_costs run $run exit $?"; grep -E "bookkeeping" "/tmp/route_host_costs-$run.log"
    done
    [ "$PART" = host ] && exit 0
    timeout 500 python3 scripts/gpu/vllm_layers_check.py --out "$OUT_DIR" --bundle .bundle/vllm-0.33.0-cp312.zip \
        --rounds ${ROUNDS:-10} --settle 1 --burst 8 --copy-costs --child-timeout-s 200 \
        ${LAYERS:+--layers $LAYERS} >"$OUT_DIR/vllm_layers_stdout.log" 2>&1 || status=$?
    echo "vllm_layers_check exit $status"; grep -E "VERDICT|TIMING|DRYRUN|copy costs" "$OUT_DIR/vllm_layers_stdout.log"
else
    timeout 500 python3 -m kda_patches.bench peer --output "$OUT_DIR/peer.json" --seed 41 --trials 20 \
        --graph-calls 50 >"$OUT_DIR/peer.log" 2>&1 || status=$?
    echo "bench peer exit $status"; tail -40 "$OUT_DIR/peer.log"
fi
exit $status
