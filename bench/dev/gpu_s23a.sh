#!/usr/bin/env bash
# For the next session's first GPU call: the dense path's envelope gradient from K
# (DenseTritonBackend.transport_grad, built at the end of session 22 and not yet run on CUDA).
# Its CUDA tests, then fwd+bwd at 10k, d = 512 with OTT-JAX dense in the same run (carry .whl
# with flash-sinkhorn, geomloss, ott_jax, jaxopt and ott's pure-Python dependencies: see
# bench/README.md). Prediction (docs/performance.md after entry 22): 12.9 -> ~5.3 ms, ~2x OTT.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_dense_step.py tests/test_gradients.py 2>&1 | grep -v Warn | tail -3 | tee "$OUT/s23a_cuda_tests.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 150 python3 bench/run.py --cases fwdbwd --providers ours,ott --sizes 10000x512 --methods flashsinkhorn-sym-tf32,flashsinkhorn-alt-tf32,ott-dense --out "$OUT/fb512" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -6
timeout 150 python3 bench/run.py --cases fwd --providers ours --sizes 10000x512 --methods flashsinkhorn-sym-tf32 --out "$OUT/f512" --log /tmp/b2.log 2>&1 | grep -v Warn | tail -3
true
