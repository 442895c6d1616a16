"""Two forward+backward calls of the HyperConnection layer at the bench shape (an ncu target).

ncu -k regex:_hc_dx_kernel --launch-skip 1 --launch-count 1 python bench/dev/mhc_layer_ncu.py
"""

import torch

from flashsinkhorn.mhc import HyperConnection

torch.manual_seed(0)
T, n, C = 16 * 2048, 4, 4096
x = torch.randn(T, n, C, device="cuda", requires_grad=True)
g = torch.randn(T, n, C, device="cuda")
mod = HyperConnection(C, n, n_iters=20).cuda()
for _ in range(2):
    torch.autograd.grad(mod(x), [x, *mod.parameters()], g)
torch.cuda.synchronize()
print("done")
