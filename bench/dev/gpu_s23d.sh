#!/usr/bin/env bash
# Session 23, call 4: the projection backward sweep around the new default (column-sum identity,
# keep_a 9), then the whole mHC GPU suite and benchmark at the new default (bench/gpu_mhc.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/sweep" "$OUT/mhc"
SK_NCU=0 OUT="$OUT/sweep" timeout 200 bash bench/dev/gpu_sk_bwd.sh 2>&1 | grep -E "^ ?[0-9]+ opts"
MHC_TEST_TIMEOUT=200 MHC_BENCH_TIMEOUT=180 OUT="$OUT/mhc" bash bench/gpu_mhc.sh 2>&1 | grep -v -i warn | tail -40
