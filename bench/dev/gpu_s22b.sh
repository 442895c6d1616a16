#!/usr/bin/env bash
# Session 22, GPU call 2: the dense path's fused symmetric sweep (dense._dense_sym_kernel,
# docs/performance.md entry 22) against the two dense sweeps at the issue-9 d = 512 / 1024
# sizes over seven tile shapes, then its CUDA tests and the dense / graph / plan-step tests.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 200 python3 bench/dev/s22_dense_step.py --out "$OUT/s22_dense_step.jsonl" 2>&1 | grep -v Warn | cut -c1-400 | tee "$OUT/s22_dense_step.txt"
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_dense_step.py tests/test_plan_step.py tests/test_solve_graphs.py tests/test_kernels_lse.py 2>&1 | tail -6 | tee "$OUT/s22b_cuda_tests.log"
