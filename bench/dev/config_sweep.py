"""Dev only: separate the effects of operand dtype, tile config and split rule at 10k, d=64."""

import json, os, torch, triton
import flashsinkhorn as fs
from flashsinkhorn.backends.triton import lse, configs, dense

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
rows = []
g = torch.Generator(device="cuda").manual_seed(0)


def data(n, d):
    x = torch.rand(n, d, device="cuda", generator=g)
    y = torch.rand(n, d, device="cuda", generator=g)
    a = torch.rand(n, device="cuda", generator=g) + 0.1
    b = torch.rand(n, device="cuda", generator=g) + 0.1
    return x, y, a / a.sum(), b / b.sum()


orig_ops, orig_cfg = lse.operands, lse.lse_config


def fp32_ops(rows_, cols_, precision):
    return rows_.x, cols_.x, 1.0, precision


for n, d in ((10000, 64), (40000, 128)):
    x, y, a, b = data(n, d)
    for opname, ops in (("fp16", orig_ops), ("fp32", fp32_ops)):
        for cfg in (
            (64, 128, 4, 2),
            (128, 64, 8, 3),
            (128, 64, 4, 2),
            (128, 128, 8, 2),
            (64, 64, 4, 3),
        ):
            for split in (None, 1, 2, 4):
                if n == 40000 and split not in (None,):
                    continue
                lse.operands = ops
                lse.lse_config = lambda dd, half=False, c=cfg: configs.LSEConfig(
                    c[0], c[1], max(16, triton.next_power_of_2(dd)), 1, c[2], c[3]
                )
                lse.FORCE_SPLIT = split
                for sch in ("symmetric", "alternating"):
                    fn = lambda: fs.sinkhorn(
                        x, y, a, b, eps=0.1, n_iters=10, tol=None, schedule=sch, check_finite=False
                    )
                    try:
                        fn()
                        ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
                    except Exception as e:
                        ms = float("nan")
                        print("ERR", repr(e)[:200])
                    r = dict(
                        n=n, d=d, ops=opname, cfg=cfg, split=split, schedule=sch, ms=round(ms, 3)
                    )
                    rows.append(r)
                    print(r, flush=True)
lse.operands, lse.lse_config, lse.FORCE_SPLIT = orig_ops, orig_cfg, None
# dense tiles
from flashsinkhorn.problem import prepare

x, y, a, b = data(10000, 512)
p = prepare(x, y, a, b, rho_x=None, rho_y=None, precision="tf32")
K = dense.DenseTritonBackend(p).gram  # rows padded to 16 floats, as the kernel assumes
f = torch.zeros_like(p.X.sq)
gg = torch.zeros_like(p.Y.sq)
out = torch.empty_like(f)
for tr in (False, True):
    for bm, bn, w in (
        (128, 64, 8),
        (64, 128, 4),
        (32, 256, 4),
        (16, 256, 4),
        (256, 32, 8),
        (128, 128, 8),
        (64, 256, 8),
    ):
        pm = torch.empty(4, 1, 10000, device="cuda")
        ps = torch.empty_like(pm)
        cps = triton.cdiv(triton.cdiv(10000, 4), bn) * bn

        def run():
            dense._dense_softmin_kernel[(triton.cdiv(10000, bm), 1, triton.cdiv(10000, cps))](
                K,
                p.X.sq,
                p.Y.sq,
                p.Y.logw,
                gg,
                f,
                out,
                out,
                pm,
                ps,
                10000,
                10000,
                cps,
                4,
                K.stride(0),
                K.stride(1),
                10000,
                10000,
                10000,
                0.1,
                0.0,
                1.0,
                BLOCK_M=bm,
                BLOCK_N=bn,
                TRANSPOSED=tr,
                WRITE_RAW=False,
                num_warps=w,
                num_stages=3,
            )

        try:
            run()
            ms = triton.testing.do_bench(run, warmup=20, rep=100, return_mode="median")
        except Exception as e:
            ms = float("nan")
            print("ERR", repr(e)[:200])
        r = dict(
            dense_transposed=tr, bm=bm, bn=bn, warps=w, ms=round(ms, 4), gbps=round(4e8 / ms / 1e6)
        )
        rows.append(r)
        print(r, flush=True)
json.dump(rows, open(f"{OUT}/exp.json", "w"), indent=1)
