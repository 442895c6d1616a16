#!/usr/bin/env bash
# Session 23, call 6: the dense envelope gradient's softmax kernel (dense_grad.py) on CUDA: its
# tests, fwd+bwd 10k d=512 with OTT-JAX dense in the same run (carry .whl), and the y-side
# (transposed) orientation timed against the x side. Prediction (docs/performance.md after
# entry 22): gradient pass 2.7 -> ~0.8 ms, fwd+bwd 6.6 -> ~4.7 ms.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_dense_step.py tests/test_gradients.py 2>&1 | grep -v Warn | tail -3 | tee "$OUT/s23f_cuda_tests.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 150 python3 bench/run.py --cases fwdbwd --providers ours,ott --sizes 10000x512 --methods flashsinkhorn-sym-tf32,flashsinkhorn-alt-tf32,ott-dense --out "$OUT/fb512" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -6
timeout 120 python3 - <<'PY' 2>&1 | grep -v Warn | tee "$OUT/s23f_sides.txt"
import torch, flashsinkhorn as fs
torch.manual_seed(0)
x = torch.randn(10000, 512, device="cuda") / 512**0.5
y = torch.randn(10000, 512, device="cuda") / 512**0.5 + 0.1
kw = dict(eps=0.1, n_iters=10, tol=None, precision="tf32")
def run(wrt):
    xr, yr = x.clone().requires_grad_("x" in wrt), y.clone().requires_grad_("y" in wrt)
    loss = fs.ot_cost(xr, yr, **kw)
    return torch.autograd.grad(loss, [t for t in (xr, yr) if t.requires_grad])
for wrt in ("x", "y", "xy", "x", "y", "xy"):
    run(wrt); torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); run(wrt); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); print(f"fwd+bwd wrt {wrt:2s}: median {ts[10]:.3f} ms  min {ts[0]:.3f} ms")
PY
true
