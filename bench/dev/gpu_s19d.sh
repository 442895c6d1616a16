#!/usr/bin/env bash
# Session-19 GPU call 4: the fused prepare's CUDA tests, then the issue-9 bench rows (ours and
# flash-sinkhorn in the same run) and the fresh-process first call.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_prepare_fused.py tests/test_kernels_lse.py} 2>&1 | tail -3 | tee "$OUT/s19d_tests.log"
M="flashsinkhorn-sym-tf32,flash-sinkhorn-sym,flash-sinkhorn-alt"
python3 bench/run.py --cases fwd --providers ours,flash-sinkhorn --sizes 10000x64,50000x64 --methods $M --out "$OUT/fwd" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -9
python3 bench/run.py --cases fwdbwd --providers ours,flash-sinkhorn --sizes 10000x128,40000x128 --methods $M --out "$OUT/fwdbwd" --log /tmp/b2.log 2>&1 | grep -v Warn | tail -9
python3 bench/run.py --cases firstcall --providers ours --out "$OUT/first" --log /tmp/b3.log 2>&1 | grep -v Warn | tail -3
