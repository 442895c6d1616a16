#!/usr/bin/env bash
# Session 24, call 9: the gpu-marked OT suite, then the dense-path and gradient tests on CUDA, at
# the session's final library code (covers f45a45d, the dense kernels' shared LSE helper, which
# session 23 compiled locally but did not run on a GPU). Carry .whl (geomloss, flash-sinkhorn).
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 430 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/mhc 2>&1 | grep -v Warn | tail -4 | tee "$OUT/s24h_gpu_suite.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_dense_step.py tests/test_gradients.py 2>&1 | grep -v Warn | tail -3 | tee "$OUT/s24h_dense_cuda.log"
