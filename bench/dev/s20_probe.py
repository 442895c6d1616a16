"""Session-20 probe (development), one GPU call:

1. the gradient's transport pass (float16 P·y dot) over tile shapes, with the whole-wave
   column split (transport.WAVE_SPLIT) and without, at the issue-9 sizes;
2. ten plan steps captured in a CUDA graph, whole-wave split (plan.WAVE_SPLIT) against the
   entry-18 rule;
3. the HVP's width-1 transport pass, whole-wave split or not;
4. the bench's calls (event-timed, one call on an idle device): fwd 10k, d = 64 and fwd+bwd
   10k, d = 128, with prepare's launches replayed from graphs (prepare.USE_GRAPHS) or not.

    python bench/dev/s20_probe.py > out.jsonl
"""

from __future__ import annotations

import json
import statistics

import torch
from _cuda_timing import events_ms, graph_ms

import flashsinkhorn as fs
from flashsinkhorn import _triton_launch as TL
from flashsinkhorn.backends.triton import plan, transport
from flashsinkhorn.backends.triton import prepare as tprep
from flashsinkhorn.problem import prepare

GRAD_SHAPES = {
    128: [(128, 128, 8, 2), (64, 128, 4, 3), (256, 64, 8, 2)],
    64: [(256, 64, 8, 2), (128, 128, 4, 3), (128, 64, 4, 3)],
}


def emit(**row):
    print(json.dumps(row), flush=True)


def problem(n, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.rand(n, d, device="cuda", generator=gen)
    y = torch.rand(n, d, device="cuda", generator=gen)
    a = torch.rand(n, device="cuda", generator=gen) + 0.5
    b = torch.rand(n, device="cuda", generator=gen) + 0.5
    a, b = a / a.sum(), b / b.sum()
    res = fs.sinkhorn(x, y, a, b, eps=0.1, n_iters=10, tol=None, precision="tf32")
    p = prepare(x, y, a, b, rho_x=None, rho_y=None, precision="tf32")
    return x, y, a, b, p, res.f[None].contiguous(), res.g[None].contiguous()


def grad_sweep():
    real = transport.grad_tiles
    for n, d in ((10_000, 128), (40_000, 128), (10_000, 64), (50_000, 64)):
        *_, p, f, g = problem(n, d)
        run = lambda: transport.transport_grad(p.X, p.Y, f, g, 0.1, "tf32")  # noqa: E731
        for shape in GRAD_SHAPES[d]:
            transport.grad_tiles = lambda _d, s=shape: s
            for wave in (False, True):
                transport.WAVE_SPLIT = wave
                run()
                emit(part="grad", n=n, d=d, shape=shape, wave=wave, ms=events_ms(run, 20))
        transport.grad_tiles = real
        transport.WAVE_SPLIT = True
    emit(part="resident", table={str(k[0]) + str(dict(k[1]).get("BLOCK_M")) + "x"
                                 + str(dict(k[1]).get("BLOCK_N")) + "/w"
                                 + str(dict(k[1]).get("num_warps")): v
                                 for k, v in TL._RESIDENT.items()})  # fmt: skip


def plan_ab():
    for n, d in ((10_000, 64), (50_000, 64), (10_000, 128), (40_000, 128)):
        *_, p, f, g = problem(n, d)

        def steps():
            ff, gg = f, g
            for _ in range(10):
                ff, gg, _, _ = plan.symmetric_step(p.X, p.Y, ff, gg, 0.1, 0.5, 0.5, 0.5, False,
                                                   "tf32", "iterate")  # fmt: skip

        for wave in (False, True, False, True):
            plan.WAVE_SPLIT = wave
            emit(part="plan10", n=n, d=d, wave=wave, ms=graph_ms(steps))
        plan.WAVE_SPLIT = True


def hvp_transport_ab():
    *_, p, f, g = problem(10_000, 64)
    V = torch.randn(1, 10_000, 1, device="cuda")
    run = lambda: transport.transport(p.X, p.Y, f, g, 0.1, V, None, None, "tf32")  # noqa: E731
    for wave in (False, True, False, True):
        transport.WAVE_SPLIT = wave
        run()
        emit(part="transport_p1", n=10_000, d=64, wave=wave, ms=events_ms(run, 30))
    transport.WAVE_SPLIT = True


def calls_ab():
    gen = torch.Generator(device="cuda").manual_seed(3)
    x64 = torch.rand(10_000, 64, device="cuda", generator=gen)
    y64 = torch.rand(10_000, 64, device="cuda", generator=gen)
    a = torch.rand(10_000, device="cuda", generator=gen) + 0.5
    b = torch.rand(10_000, device="cuda", generator=gen) + 0.5
    a, b = a / a.sum(), b / b.sum()
    x128 = torch.rand(10_000, 128, device="cuda", generator=gen).requires_grad_()
    y128 = torch.rand(10_000, 128, device="cuda", generator=gen)

    def fwd():
        return fs.sinkhorn(x64, y64, a, b, eps=0.1, n_iters=10, tol=None).value

    def fwdbwd():
        v = fs.ot_cost(x128, y128, a, b, eps=0.1, n_iters=10, tol=None)
        return torch.autograd.grad(v, x128)[0]

    for name, fn in (("fwd 10k d=64", fwd), ("fwdbwd 10k d=128", fwdbwd)):
        for graphs in (False, True, False, True):
            tprep.USE_GRAPHS = graphs
            for _ in range(8):
                fn()
            times = []
            for _ in range(60):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            emit(part="call", case=name, prepare_graphs=graphs, ms=statistics.median(times),
                 ms_min=min(times), prep_graphs=tprep.graph_stats())  # fmt: skip
    tprep.USE_GRAPHS = True


if __name__ == "__main__":
    calls_ab()
    grad_sweep()
    plan_ab()
    hvp_transport_ab()
