"""Is one exp per pair for both half-steps faster than the fused symmetric kernel? (dev probe)

The symmetric schedule updates f and g from the same (f, g). Both soft-mins can then be read
off one tile of the plan π_ij = exp((f_i + g_j − C_ij)/eps) a_i b_j: T(g)_i = f_i − eps ln(r_i/a_i)
and T(f)_j = g_j − eps ln(c_j/b_j) with r, c its row and column sums (docs/performance.md,
entry 16). That halves the exps and the x·yᵀ products of an iteration, but the column sums
must be reduced across the rows of a tile, which the row sweep of the soft-min never does.

This probe times, on prepared float16 operands (precision "tf32"), 10 launches of
- ``lib``: the library's fused symmetric step (two online-LSE half-steps);
- ``fixref``: both half-steps with a fixed per-row reference instead of the running max;
- ``plan``: one sweep over x-row blocks forming the plan tile once: row sums kept per program,
  column sums of each tile written to a [row blocks, m] buffer and summed by torch.

    python bench/dev/plan_probe.py --out DIR          # DIR/plan_probe.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from _cuda_timing import events_ms

from flashsinkhorn._triton_launch import FP_FUSION, cdiv
from flashsinkhorn.backends import resolve_backend
from flashsinkhorn.problem import prepare


@triton.jit(do_not_specialize=["n_rows", "n_cols", "cps"])
def _fixref_kernel(R, C, Rref, Cbias, Psum, n_rows, n_cols, cps, scale2,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                   DEFER: tl.constexpr):  # fmt: skip
    # One half-step with the exp shifted by a given per-row reference (no running max).
    i_m, i_s = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    o_d = tl.arange(0, D)
    b_r = tl.load(R + o_m.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_m[:, None], other=0.0)
    b_ref = tl.load(Rref + o_m, mask=m_m, other=0.0)
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    c0 = i_s * cps
    for start_n in range(c0, tl.minimum(c0 + cps, n_cols), BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < n_cols
        b_c = tl.load(
            C + o_n.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0
        )
        b_h = tl.load(Cbias + o_n, mask=m_n, other=float("-inf"))
        b_s = tl.dot(b_r, tl.trans(b_c))
        b_p = tl.exp2(b_s * scale2 + b_h[None, :] - b_ref[:, None])
        if DEFER:
            b_acc += b_p
        else:
            b_sum += tl.sum(b_p, 1)
    if DEFER:
        b_sum = tl.sum(b_acc, 1)
    tl.store(Psum + i_s * n_rows + o_m, b_sum, mask=m_m)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "cps"])
def _plan_kernel(R, C, Rbias, Cbias, Prow, Pcol, n_rows, n_cols, cps, scale2,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):  # fmt: skip
    # One sweep for both half-steps: plan tile exp2(s·scale2 + u_i + v_j) once; row sums kept,
    # column sums of the tile stored per row block.
    i_m, i_s = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    o_d = tl.arange(0, D)
    b_r = tl.load(R + o_m.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_m[:, None], other=0.0)
    b_u = tl.load(Rbias + o_m, mask=m_m, other=float("-inf"))
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    c0 = i_s * cps
    p_col = Pcol + i_m.to(tl.int64) * n_cols
    for start_n in range(c0, tl.minimum(c0 + cps, n_cols), BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < n_cols
        b_c = tl.load(
            C + o_n.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0
        )
        b_v = tl.load(Cbias + o_n, mask=m_n, other=float("-inf"))
        b_s = tl.dot(b_r, tl.trans(b_c))
        b_p = tl.exp2(b_s * scale2 + b_v[None, :] + b_u[:, None])
        b_sum += tl.sum(b_p, 1)
        tl.store(p_col + o_n, tl.sum(b_p, 0), mask=m_n)
    tl.store(Prow + i_s * n_rows + o_m, b_sum, mask=m_m)


def _split(n_prog, n_cols, bn):
    target = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, min(cdiv(target, n_prog), cdiv(n_cols, 4 * bn)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--sizes", default="10000:64,50000:64")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    be = resolve_backend("triton", torch.device("cuda"), torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for tok in args.sizes.split(","):
        n, d = (int(v) for v in tok.split(":"))
        x = torch.rand(1, n, d, device="cuda", generator=gen)
        y = torch.rand(1, n, d, device="cuda", generator=gen)
        p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
        X, Y = p.X, p.Y

        def lib():
            f, g = torch.zeros_like(X.sq), torch.zeros_like(Y.sq)
            for k in range(10):
                al, w = (0.0, 1.0) if k == 0 else (0.5, 0.5)
                f, g, _, _ = be.symmetric_step(X, Y, f, g, 0.1, al, w, w, False, "tf32")

        lib()
        t = events_ms(lib, 7)
        rows.append(dict(n=n, d=d, variant="lib", ms=t))
        print(f"n={n} d={d} lib {t:.3f} ms", flush=True)
        xk, yk = X.xk[0].contiguous(), Y.xk[0].contiguous()
        assert xk.shape[1] == d
        scale2 = 2.0 * 1.4426950408889634 * X.kscale * Y.kscale / 0.1
        bias_x = torch.randn(n, device="cuda") * 0.1 - 13.0
        bias_y = torch.randn(n, device="cuda") * 0.1 - 13.0
        ref = torch.full((n,), 400.0, device="cuda")
        for bm, bn, nw, ns in [(128, 64, 4, 3), (128, 64, 8, 3), (256, 64, 8, 3), (128, 128, 8, 3),
                               (64, 64, 4, 3), (64, 128, 4, 3), (256, 32, 8, 3)]:  # fmt: skip
            nb = cdiv(n, bm)
            for defer in (False, True):
                split = _split(2 * nb, n, bn)
                cps = cdiv(cdiv(n, split), bn) * bn
                split = cdiv(n, cps)
                ps = torch.empty(split, n, device="cuda")

                def fixref():
                    for _ in range(10):
                        for R, Cc, bias in ((xk, yk, bias_y), (yk, xk, bias_x)):
                            _fixref_kernel[(nb, split)](
                                R, Cc, ref, bias, ps, n, n, cps, scale2, BLOCK_M=bm,
                                BLOCK_N=bn, D=d, DEFER=defer, num_warps=nw, num_stages=ns,
                                **FP_FUSION,
                            )  # fmt: skip
                            ps.sum(0)

                try:
                    fixref()
                    t = events_ms(fixref, 7)
                except Exception as e:  # noqa: BLE001 - a probe: report and go on
                    t = float("nan")
                    print("fixref failed", bm, bn, nw, defer, repr(e)[:200])
                rows.append(dict(n=n, d=d, variant="fixref", bm=bm, bn=bn, warps=nw, defer=defer,
                                 split=split, ms=t))  # fmt: skip
                print(
                    f"n={n} fixref {bm}x{bn}/{nw} defer={defer} split={split}: {t:.3f}", flush=True
                )
            split = _split(nb, n, bn)
            cps = cdiv(cdiv(n, split), bn) * bn
            split = cdiv(n, cps)
            pr = torch.empty(split, n, device="cuda")
            pc = torch.empty(nb, n, device="cuda")

            def plan():
                for _ in range(10):
                    _plan_kernel[(nb, split)](
                        xk, yk, bias_x, bias_y, pr, pc, n, n, cps, scale2, BLOCK_M=bm, BLOCK_N=bn,
                        D=d, num_warps=nw, num_stages=ns, **FP_FUSION,
                    )  # fmt: skip
                    pr.sum(0)
                    pc.sum(0)

            try:
                plan()
                t = events_ms(plan, 7)
            except Exception as e:  # noqa: BLE001
                t = float("nan")
                print("plan failed", bm, bn, nw, repr(e)[:200])
            rows.append(dict(n=n, d=d, variant="plan", bm=bm, bn=bn, warps=nw, split=split, ms=t))
            print(f"n={n} plan {bm}x{bn}/{nw} split={split}: {t:.3f}", flush=True)
    with open(os.path.join(args.out, "plan_probe.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
