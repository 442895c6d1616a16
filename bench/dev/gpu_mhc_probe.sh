#!/usr/bin/env bash
# One device call: layer-backward candidates (mhc_layer_probe.py), then an ncu profile of the
# projection backward when ncu exists. Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 330 python bench/dev/mhc_layer_probe.py --out "$OUT" 2>&1 | tee "$OUT/mhc_layer_probe.log"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  timeout 200 "$NCU" -k regex:_sk_small_bwd --launch-skip 2 --launch-count 1 \
    --section SchedulerStats --section WarpStateStats --section Occupancy \
    --section ComputeWorkloadAnalysis --section LaunchStats --section SpeedOfLight \
    python bench/dev/sk_bwd_ncu.py >"$OUT/ncu_sk_bwd.txt" 2>&1
  grep -E "Stall|Warp Cycles|Issued|Eligible|Registers|Occupancy|Duration|Throughput|No Eligible" \
    "$OUT/ncu_sk_bwd.txt" | head -60
else
  echo "no ncu"
fi
