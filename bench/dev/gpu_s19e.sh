#!/usr/bin/env bash
# Session-19 GPU call 5: transport tests after the tile change, transport tile timings at 10k
# and 40k (d = 128), then Nsight Compute on one plan step (10k, d = 64 / 128) and the gradient
# pass (10k, d = 128, two tile shapes).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider tests/test_transport.py tests/test_gpu_transport.py tests/test_gradients.py 2>&1 | tail -3 | tee "$OUT/s19e_tests.log"
cd bench/dev
python3 s19_ncu.py --time 2>&1 | grep -v Warn | tee "$OUT/s19_transport_tiles.txt"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 300 "$NCU" -k "regex:_plan_fwd_kernel|_apply_fwd_kernel" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats \
  --metrics "regex:smsp__warp_issue_stalled_.*_per_warp_active.pct" \
  python3 s19_ncu.py > "$OUT/s19_ncu.txt" 2>&1
grep -E "_plan_fwd|_apply_fwd|Duration|Registers Per|Achieved Occ|Theoretical Occ|Block Limit|Issued Warp|Issue Slots Busy|Executed Ipc A|Compute \(SM\) Th|Memory Th|Waves Per|Shared Memory Config|Dynamic Shared" "$OUT/s19_ncu.txt" | head -80
grep -E "stalled_" "$OUT/s19_ncu.txt" | awk '$NF+0 > 3' | head -60
