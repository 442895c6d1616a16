"""Launches the 4×4 projection backward a few times at B = 2^22 (the target of an ncu profile).

    ncu -k regex:_sk_small_bwd --launch-skip 2 --launch-count 1 --section WarpStateStats \
        python bench/dev/sk_bwd_ncu.py
"""

import torch

from flashsinkhorn.mhc.sk_triton import sk_backward_triton

torch.manual_seed(0)
m = 4 * torch.randn(2**22, 4, 4, device="cuda")
g = torch.randn_like(m)
for _ in range(4):
    sk_backward_triton(m, g, 20, "log", 0.0)
torch.cuda.synchronize()
print("done")
