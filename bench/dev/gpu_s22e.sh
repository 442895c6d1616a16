#!/usr/bin/env bash
# Session 22, GPU call 5: the fused dense step after the compile fix, with K's rows padded to
# 16 floats (vector loads in both dense kernels): CUDA tests, the tile sweep against the two
# sweeps, then the d = 512 / 1024 forward rows with OTT-JAX dense (the machine's own jax;
# ott-jax and its pure-Python dependencies carried in .whl), flash-sinkhorn sym and ours.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_dense_step.py tests/test_kernels_lse.py tests/test_solve_graphs.py tests/test_plan_step.py 2>&1 | grep -v Warn | tail -12 | tee "$OUT/s22e_cuda_tests.log"
timeout 120 python3 bench/dev/s22_dense_step.py --out "$OUT/s22e_dense_step.jsonl" 2>&1 | grep -v Warn | cut -c1-300 | tee "$OUT/s22e_dense_step.txt"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 60 python3 -c "import jax, ott; print('jax', jax.__version__, 'ott', ott.__version__, jax.devices())" 2>&1 | tail -3
M="flashsinkhorn-sym-tf32,flashsinkhorn-alt-tf32,ott-dense,flash-sinkhorn-sym"
timeout 130 python3 bench/run.py --cases fwd --providers ours,ott,flash-sinkhorn --sizes 10000x512 --methods $M --out "$OUT/fwd512" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -7
timeout 150 python3 bench/run.py --cases fwd --providers ours,ott,flash-sinkhorn --sizes 20000x1024 --methods $M --out "$OUT/fwd1024" --log /tmp/b2.log 2>&1 | grep -v Warn | tail -7
grep -i -m5 "error\|Traceback" /tmp/b1.log /tmp/b2.log | cut -c1-300
