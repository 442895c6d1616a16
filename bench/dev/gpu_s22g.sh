#!/usr/bin/env bash
# Session 22, GPU call 7: the whole CUDA test selection at the final library tree (the gpu-marked
# suite without tests/mhc, then the gpu-marked mHC tests).
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/mhc 2>&1 | grep -v Warn | tail -8 | tee "$OUT/s22g_gpu_suite.log"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/mhc 2>&1 | grep -v Warn | tail -6 | tee "$OUT/s22g_gpu_mhc.log"
true
