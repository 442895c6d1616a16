#!/usr/bin/env bash
# Session 23, call 10: the dense soft-min and the gradient's softmax kernel now share one score
# tile (dense_grad._k_scores; the gradient's K loads masked at the padded width as the soft-min's
# were). CUDA tests of the dense path, then fwd and fwd+bwd 10k d=512 with OTT dense (carry .whl):
# expected unchanged or faster (call 8: fwd+bwd 4.56 ms; session 22: fwd 3.67 ms).
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_dense_step.py tests/test_gradients.py 2>&1 | grep -v Warn | tail -3 | tee "$OUT/s23i_cuda_tests.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 200 python3 bench/run.py --cases fwd,fwdbwd --providers ours,ott --sizes 10000x512 --methods flashsinkhorn-sym-tf32,flashsinkhorn-alt-tf32,ott-dense --out "$OUT/b512" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -12
