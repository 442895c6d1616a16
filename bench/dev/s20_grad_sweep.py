"""Session-20 probe (development): the envelope gradient's transport pass with the float16
P·y dot (transport.FP16_GRAD) against the TF32 dot, over a few tile shapes, at the issue-9
sizes; and one event-timed ot_cost fwd+bwd at 10k, d = 128 with each.

    python bench/dev/s20_grad_sweep.py > out.jsonl
"""

from __future__ import annotations

import json

import torch
from _cuda_timing import events_ms

import flashsinkhorn as fs
from flashsinkhorn.backends.triton import transport
from flashsinkhorn.problem import prepare

SHAPES = {
    128: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 4, 2), (256, 64, 8, 2), (128, 64, 8, 3),
          (128, 64, 4, 3), (64, 128, 4, 3), (256, 128, 8, 2)],
    64: [(256, 64, 8, 2), (256, 64, 8, 3), (128, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 2),
         (256, 128, 8, 2)],
}  # fmt: skip


def problem(n, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.rand(n, d, device="cuda", generator=gen)
    y = torch.rand(n, d, device="cuda", generator=gen)
    res = fs.sinkhorn(x, y, eps=0.1, n_iters=10, tol=None, precision="tf32")
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
    return x, y, p, res.f[None].contiguous(), res.g[None].contiguous()


def rel(u, v):
    return float((u - v).abs().max() / v.abs().max())


def main() -> None:
    real = transport.grad_tiles
    for n, d in ((10_000, 128), (40_000, 128), (10_000, 64), (50_000, 64)):
        x, y, p, f, g = problem(n, d)
        run = lambda: transport.transport_grad(p.X, p.Y, f, g, 0.1, "tf32")  # noqa: E731
        transport.FP16_GRAD = False
        ref, _ = run()
        base = events_ms(run, 20)
        print(json.dumps(dict(n=n, d=d, fp16=False, shape=list(real(d)), ms=base)), flush=True)
        transport.FP16_GRAD = True
        for shape in SHAPES[d]:
            transport.grad_tiles = lambda _d, s=shape: s
            try:
                out, _ = run()
                ms = events_ms(run, 20)
                row = dict(n=n, d=d, fp16=True, shape=list(shape), ms=ms, rel_vs_tf32=rel(out, ref))
            except Exception as e:  # noqa: BLE001 (out of shared memory, say)
                row = dict(n=n, d=d, fp16=True, shape=list(shape), error=str(e)[:120])
            print(json.dumps(row), flush=True)
        transport.grad_tiles = real
    # end to end, as the bench's fwd+bwd row (events around one call on an idle device)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.rand(10_000, 128, device="cuda", generator=gen).requires_grad_()
    y = torch.rand(10_000, 128, device="cuda", generator=gen)

    def fwdbwd():
        v = fs.ot_cost(x, y, eps=0.1, n_iters=10, tol=None)
        (gx,) = torch.autograd.grad(v, x)
        return gx

    for fp16 in (False, True, False, True):
        transport.FP16_GRAD = fp16
        for _ in range(5):
            fwdbwd()
        ms = events_ms(fwdbwd, 40)
        print(json.dumps(dict(case="fwdbwd 10k d=128", fp16=fp16, ms=ms)), flush=True)
    transport.FP16_GRAD = True


if __name__ == "__main__":
    main()
