#!/usr/bin/env bash
# For the next session's first GPU call: the dense path's plan step (docs/performance.md
# entry 21) measured against the two dense sweeps at the issue-9 d = 512 / 1024 sizes, its
# CUDA tests, and the CUDA tests session 21 could not reach on its final tree.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 240 python3 bench/dev/s22_dense_plan.py --out "$OUT/s22_dense_plan.jsonl" 2>&1 | grep -v Warn | tee "$OUT/s22_dense_plan.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -k "dense or peer_hvp" tests/test_plan_step.py tests/test_gpu_hvp.py tests/test_kernels_lse.py tests/test_solve_graphs.py 2>&1 | tail -4 | tee "$OUT/s22a_cuda_tests.log"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_costs.py tests/test_gpu_otdd.py 2>&1 | tail -4 | tee -a "$OUT/s22a_cuda_tests.log"
