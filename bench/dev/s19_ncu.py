"""Session-19 probe (development): one plan step at 10k (d = 64 and 128) and the gradient's
transport pass at 10k, d = 128 (two tile shapes), for Nsight Compute; and with ``--time``, the
transport tile shapes timed at 10k and 40k, d = 128.

    ncu -k "regex:_plan_fwd_kernel|_apply_fwd_kernel" ... python bench/dev/s19_ncu.py
    python bench/dev/s19_ncu.py --time
"""

from __future__ import annotations

import argparse
import json

import torch

import flashsinkhorn as fs
from flashsinkhorn.backends import triton as tb
from flashsinkhorn.backends.triton import plan, transport
from flashsinkhorn.problem import prepare

SHAPES = [(256, 64, 8, 2), (128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 4, 2), (64, 128, 4, 2)]


def problem(n, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.rand(n, d, device="cuda", generator=gen)
    y = torch.rand(n, d, device="cuda", generator=gen)
    tb.USE_PLAN_STEP = False  # the only plan launches are the profiled ones
    res = fs.sinkhorn(x, y, eps=0.1, n_iters=10, tol=None, precision="tf32")
    tb.USE_PLAN_STEP = True
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
    return p, res.f[None].contiguous(), res.g[None].contiguous()


def with_shape(shape):
    return lambda d: shape


def main(time_it: bool) -> None:
    if not time_it:
        for d in (64, 128):
            p, f, g = problem(10_000, d)
            plan.symmetric_step(p.X, p.Y, f, g, 0.1, 0.5, 0.5, 0.5, False, "tf32", "iterate")
        real = transport.grad_tiles
        for shape in SHAPES[:2]:
            transport.grad_tiles = with_shape(shape)
            transport.transport_grad(p.X, p.Y, f, g, 0.1, "tf32")
        transport.grad_tiles = real
        torch.cuda.synchronize()
        return
    from _cuda_timing import events_ms

    rows = []
    for n in (10_000, 40_000):
        p, f, g = problem(n, 128)
        for shape in SHAPES:
            transport.grad_tiles = with_shape(shape)
            transport.transport_grad(p.X, p.Y, f, g, 0.1, "tf32")
            ms = events_ms(lambda: transport.transport_grad(p.X, p.Y, f, g, 0.1, "tf32"), 20)
            rows.append(dict(n=n, d=128, shape=shape, grad_ms=ms))
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", action="store_true")
    main(ap.parse_args().time)
