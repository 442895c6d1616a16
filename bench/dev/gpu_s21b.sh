#!/usr/bin/env bash
# Session-21 GPU call 2: prepare's side means (no n x d temporary in the "zero" shift), the
# once-per-solve scalars in one launch each (backends/triton/sums.py) and the ticket memset
# only for split sweeps. Memory probe, the CUDA tests of what changed, then the three issue-9
# rows it touches with flash-sinkhorn in the same run.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 90 python3 bench/dev/s21_mem.py --sizes 10000x128,40000x128 --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/s21b_mem.txt"
timeout 220 python3 -m pytest -q -p no:cacheprovider -x tests/test_solve_scalars.py tests/test_prepare_fused.py tests/test_plan_step.py tests/test_gpu_transport.py tests/test_solve_graphs.py 2>&1 | tail -4 | tee "$OUT/s21b_cuda_tests.log"
M="flashsinkhorn-sym-tf32,flash-sinkhorn-sym,flash-sinkhorn-alt"
timeout 100 python3 bench/run.py --cases fwd --providers ours,flash-sinkhorn --sizes 10000x64 --methods $M --out "$OUT/fwd" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -4
timeout 100 python3 bench/run.py --cases fwdbwd --providers ours,flash-sinkhorn --sizes 10000x128 --methods $M --out "$OUT/fwdbwd" --log /tmp/b2.log 2>&1 | grep -v Warn | tail -4
timeout 130 python3 bench/run.py --cases fwdbwd --providers ours,flash-sinkhorn --sizes 40000x128 --methods flashsinkhorn-sym-tf32,flash-sinkhorn-sym --out "$OUT/fwdbwd40" --log /tmp/b3.log 2>&1 | grep -v Warn | tail -3
