#!/usr/bin/env bash
# One device call for the projection backward: compile the candidates of sk_bwd_sweep.py in 8
# processes, check and time them, then ncu stall reasons of the baseline and the two fastest.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for i in 0 1 2 3 4 5 6 7; do
  python bench/dev/sk_bwd_sweep.py --compile-share $i --shares 8 &
done
wait
timeout 300 python bench/dev/sk_bwd_sweep.py --out "$OUT" 2>&1 | tee "$OUT/sk_bwd_sweep.txt"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ "${SK_NCU:-1}" = 1 ] && [ -n "$NCU" ] && [ -f "$OUT/sk_bwd_sweep.json" ]; then
  CANDS=${SK_NCU_CANDS:-}
  [ -n "$CANDS" ] || CANDS=$(python -c "import json; r=json.load(open('$OUT/sk_bwd_sweep.json'))['rows']; b=sorted(r, key=lambda x: x['ms_2e24'])[:2]; print(','.join(str(x) for x in sorted({0, 1, *[x['cand'] for x in b]})))")
  echo "ncu candidates: $CANDS"
  timeout 200 "$NCU" -k "regex:_sk_small_bwd" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section InstructionStats --section MemoryWorkloadAnalysis --metrics "regex:smsp__warp_issue_stalled_.*_per_warp_active.pct" \
    python bench/dev/sk_bwd_sweep.py --ncu "$CANDS" >"$OUT/ncu_sk_bwd.txt" 2>&1
  grep -E "_sk_small_bwd|Duration|Registers Per|L1/TEX Hit|L2 Hit|Mem Busy|Local Memory|DRAM Throughput|Achieved Occ|Issued Warp|Issue Slots|Executed Instructions |stalled_(long|lg|mio|short|barrier|math|wait|drain|no_inst|not_sel|selected|dispatch|imc|branch|sleep|tex|membar)" "$OUT/ncu_sk_bwd.txt" | grep -v " 0$" | head -160
fi
