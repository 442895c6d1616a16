#!/usr/bin/env bash
# Session 22, first GPU call: the dense path's plan step (docs/performance.md entry 21)
# measured against the two dense sweeps at the issue-9 d = 512 / 1024 sizes, then the CUDA
# tests of every kernel change session 21 could not run on CUDA (sums KL series, prepare's
# separate y sum, the DENSE plan variant).
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$OUT/s22a_gpu.txt"
timeout 230 python3 bench/dev/s22_dense_plan.py --out "$OUT/s22_dense_plan.jsonl" 2>&1 | grep -v Warn | tee "$OUT/s22_dense_plan.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_solve_scalars.py tests/test_prepare_fused.py "tests/test_plan_step.py" -k "not slow" 2>&1 | tail -6 | tee "$OUT/s22a_cuda_tests.log"
