#!/usr/bin/env bash
# Session-21 GPU call 3 (last): the issue-9 rows with flash-sinkhorn sym in the same run (fwd
# 10k d=64, fwd+bwd 10k d=128), the fresh-process first call, one compiled kernel for the
# solve scalars, then the CUDA runs of the transport, split-operand and HVP tests.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
M="flashsinkhorn-sym-tf32,flash-sinkhorn-sym"
timeout 150 python3 bench/run.py --cases fwd --providers ours,flash-sinkhorn --sizes 10000x64 --methods $M --out "$OUT/fwd" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -3
timeout 150 python3 bench/run.py --cases fwdbwd --providers ours,flash-sinkhorn --sizes 10000x128 --methods $M --out "$OUT/fwdbwd" --log /tmp/b2.log 2>&1 | grep -v Warn | tail -3
timeout 60 python3 bench/run.py --cases firstcall --providers ours --out "$OUT/first" --log /tmp/b3.log 2>&1 | grep -v Warn | tail -2
timeout 40 python3 - <<'PY' 2>&1 | grep -v Warn | tee "$OUT/s21c_scalar_kernel.txt"
import torch, flashsinkhorn as fs
from flashsinkhorn.backends.triton import sums
x = torch.randn(3000, 64, device="cuda"); y = torch.randn(2000, 64, device="cuda")
fs.sinkhorn(x, y, eps=0.1, n_iters=5, tol=None, rho_x=0.5)  # zero, second, value
fs.sinkhorn(x, y, eps=0.1, n_iters=5, tol=None, schedule="alternating", cost="euclidean")
k = sums._solve_scalar_kernel
caches = getattr(k, "device_caches", None) or getattr(k, "cache", None)
print("compiled variants of _solve_scalar_kernel:", {str(d): len(c[0] if isinstance(c, tuple) else c) for d, c in caches.items()})
PY
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_transport.py tests/test_split_operands.py tests/test_solve_scalars.py tests/test_gpu_hvp.py 2>&1 | tail -4 | tee "$OUT/s21c_cuda_tests.log"
