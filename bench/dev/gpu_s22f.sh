#!/usr/bin/env bash
# Session 22, GPU call 6 (final tree): the fused dense step removed, the two dense sweeps with
# padded K rows. CUDA tests of the dense path, then the d = 512 / 1024 forward rows with
# OTT-JAX dense (machine's jax 0.11.2, ott-jax 0.6.0 carried), flash-sinkhorn sym and ours.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_dense_step.py tests/test_kernels_lse.py 2>&1 | grep -v Warn | tail -3 | tee "$OUT/s22f_cuda_tests.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
M="flashsinkhorn-sym-tf32,flashsinkhorn-alt-tf32,ott-dense,flash-sinkhorn-sym"
timeout 150 python3 bench/run.py --cases fwd --providers ours,ott,flash-sinkhorn --sizes 10000x512 --methods $M --out "$OUT/fwd512" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -7
timeout 170 python3 bench/run.py --cases fwd --providers ours,ott,flash-sinkhorn --sizes 20000x1024 --methods $M --out "$OUT/fwd1024" --log /tmp/b2.log 2>&1 | grep -v Warn | tail -7
true
