#!/usr/bin/env bash
# The multiscale run on the GPU machine (see bench/README.md and docs/multiscale.md).
#
#   bash bench/gpu_multiscale.sh          # into ./out
#   OUT=/some/dir bash bench/gpu_multiscale.sh
#
# Stages (each under its own time limit, the whole within about 9 minutes on an H100):
#   1. pytest -m gpu tests/test_gpu_multiscale.py  -> $OUT/gpu_multiscale_tests.log
#      (the 4M case takes about 70 s)
#   2. bench_multiscale.py, both shapes, n = 100k and 1M, eps = (0.01·D)², with
#      flash-sinkhorn where its predicted time fits PEER_BUDGET_S
#                                                  -> $OUT/multiscale_<gpu>.json, .log
# Environment: OUT (default ./out), SKIP_TESTS=1, SHAPES (default surfaces,gmm_shell),
# SIZES (default 100000,1000000), PEER_BUDGET_S (default 60; flash-sinkhorn at 1M on the
# surfaces takes about 6 minutes: PEER_BUDGET_S=450 SHAPES=surfaces BENCH_TIMEOUT_S=560 in a
# call of its own), BENCH_TIMEOUT_S (default 330).
# Wheels for the packages the machine lacks (flash-sinkhorn, ...) are carried in .whl/ and
# installed into /tmp/site by bench/gpu_env.sh.
set -uo pipefail

cd "$(dirname "$0")/.."
source bench/gpu_env.sh

if [[ "${SKIP_TESTS:-0}" != "1" ]]; then
    echo "=== gpu tests (tests/test_gpu_multiscale.py)"
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu -rf \
        tests/test_gpu_multiscale.py 2>&1 | tee "$OUT/gpu_multiscale_tests.log"
    echo "gpu tests exit code: ${PIPESTATUS[0]} (124 = timed out)"
fi

echo "=== bench_multiscale.py"
timeout "${BENCH_TIMEOUT_S:-330}" python3 bench/bench_multiscale.py --out "$OUT" \
    --shapes "${SHAPES:-surfaces,gmm_shell}" \
    --eps-factors 0.01 --sizes "${SIZES:-100000,1000000}" --reps 2 --dense-budget 30 \
    --peer-budget "${PEER_BUDGET_S:-60}" 2>&1 | tee "$OUT/multiscale_bench.log" \
    | grep -v Warning | cut -c1-240
echo "bench exit code: ${PIPESTATUS[0]} (124 = timed out)"
