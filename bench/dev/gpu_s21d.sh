#!/usr/bin/env bash
# Session-21 GPU call 4 (last seconds of the budget): the CUDA tests of the solve value and
# shifts that the earlier calls did not reach on the final tree, and the one HVP test cut off
# in call 3 (flash-sinkhorn's HVP against ours).
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
git log --oneline -1 2>/dev/null | tee "$OUT/s21d_cuda_tests.log"
timeout 170 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_gpu_solver.py tests/test_gpu_numerics.py tests/test_gpu_costs.py "tests/test_gpu_hvp.py::test_peer_hvp_from_potentials_agrees_with_ours" 2>&1 | tail -12 | tee -a "$OUT/s21d_cuda_tests.log"
