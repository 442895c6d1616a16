#!/usr/bin/env bash
# Session-19 GPU call 6: first-call breakdown in fresh processes (empty Triton cache, compile
# log), the bench's first-call row, then the whole gpu-marked suite.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
(cd bench/dev && for mode in first first; do
  TRITON_CACHE_DIR="$(mktemp -d)" FLASHSINKHORN_COMPILE_LOG=1 python3 s18_probe.py --compile "$mode" 2>&1 | grep -v Warn
done) | tee "$OUT/s19_compile.txt"
python3 bench/run.py --cases firstcall --providers ours --out "$OUT/first" --log /tmp/b3.log 2>&1 | grep -v Warn | tail -2
timeout 420 python3 -m pytest -q -p no:cacheprovider ${FINAL_TESTS:--m gpu tests --ignore=tests/mhc} 2>&1 | tail -4 | tee "$OUT/gpu_tests_h200_s19_final.log"
