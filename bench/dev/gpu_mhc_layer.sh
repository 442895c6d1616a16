#!/usr/bin/env bash
# One device call for the layer: GPU layer tests, the layer benchmark (bench_mhc.py
# --layer-only), then ncu stall reasons of the dX pass. Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/mhc/test_layer.py 2>&1 | tail -3 | tee "$OUT/mhc_layer_gpu_tests.txt"
timeout 240 python bench/bench_mhc.py --layer-only --out "$OUT" 2>&1 | tee "$OUT/mhc_layer_bench.txt" | grep -E "mhc_layer|speed-up|_kernel"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && [ -n "${NCU_KERNELS:-}" ]; then
  timeout 150 "$NCU" -k "regex:${NCU_KERNELS}" --launch-skip 0 --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis \
    --metrics "regex:smsp__warp_issue_stalled_.*_per_warp_active.pct" \
    python bench/dev/mhc_layer_ncu.py >"$OUT/ncu_layer.txt" 2>&1
  grep -E "^  _hc|Duration|DRAM Through|Memory Through|Registers Per|Achieved Occ|Theoretical Occ|Issued Warp|stalled_(long|lg|mio|short|barrier|math|wait|drain|no_inst|not_sel|selected|dispatch|imc|branch|sleep|tex|membar)" "$OUT/ncu_layer.txt" | grep -v " 0$" | head -90
fi
