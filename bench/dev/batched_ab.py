"""A/B of soft-min tiles on the batched training shape, in one process (development probe).

64 problems of 1024², d = 3, 10 symmetric iterations, "tf32": wall and CUDA-event time of
``ot_cost`` forward + gradient and of the solve alone, with the library's tile rule ("new") and
with 128 x 64 / 8 warps ("old"), twice each; then a profiler table of one fwd+bwd.

    python bench/dev/batched_ab.py
"""

from __future__ import annotations

import torch
import triton
from _cuda_timing import events_ms, wall_ms

import flashsinkhorn as fs
from flashsinkhorn.backends.triton import configs, lse


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    B, n, d = 64, 1024, 3
    x = torch.rand(B, n, d, device="cuda", generator=g)
    y = torch.rand(B, n, d, device="cuda", generator=g)
    xg = x.clone().requires_grad_(True)
    kw = dict(eps=0.1, n_iters=10, tol=None, precision="tf32")

    def fwd_bwd():
        loss = fs.ot_cost(xg, y, schedule="symmetric", **kw)
        torch.autograd.grad(loss.sum(), xg)

    def fwd():
        fs.sinkhorn(x, y, **kw)

    orig = lse.lse_config

    def old(dd, half=False):
        return configs.LSEConfig(128, 64, max(16, triton.next_power_of_2(dd)), 1, 8, 3)

    for rep in range(2):
        for name, cfg in (("new", orig), ("old", old)):
            lse.lse_config = cfg
            fwd_bwd()
            fwd()
            print(
                f"{rep} {name} fwd+bwd wall {wall_ms(fwd_bwd):.3f} ev {events_ms(fwd_bwd):.3f} | "
                f"fwd wall {wall_ms(fwd):.3f} ev {events_ms(fwd):.3f}",
                flush=True,
            )
    lse.lse_config = orig
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd_bwd()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
