#!/usr/bin/env bash
# Session-20 GPU call 3: the call timelines (s19 probe), then the issue-9 bench rows with
# flash-sinkhorn in the same run.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
python3 bench/dev/s19_probe.py --out /tmp/probe 2>&1 | grep -v Warn > "$OUT/s20_timeline_h200.txt"
grep -v "   kern" "$OUT/s20_timeline_h200.txt" | head -40
M="flashsinkhorn-sym-tf32,flash-sinkhorn-sym,flash-sinkhorn-alt"
python3 bench/run.py --cases fwd --providers ours,flash-sinkhorn --sizes 10000x64,50000x64 --methods $M --out "$OUT/fwd" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -9
python3 bench/run.py --cases fwdbwd --providers ours,flash-sinkhorn --sizes 10000x128,40000x128 --methods $M --out "$OUT/fwdbwd" --log /tmp/b2.log 2>&1 | grep -v Warn | tail -9
