import json, os, time
import torch, triton
import flashsinkhorn as fs
from flashsinkhorn.backends.triton import lse, configs

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
rows = []
dev = torch.cuda.get_device_name()
print(dev, torch.__version__, triton.__version__, flush=True)


def data(n, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.rand(n, d, device="cuda", generator=g)
    y = torch.rand(n, d, device="cuda", generator=g)
    a = torch.rand(n, device="cuda", generator=g) + 0.1
    b = torch.rand(n, device="cuda", generator=g) + 0.1
    return x, y, a / a.sum(), b / b.sum()


# first call
x, y, a, b = data(10000, 64)
t = time.perf_counter()
r = fs.sinkhorn(x, y, a, b, eps=0.1, n_iters=10, tol=None)
torch.cuda.synchronize()
print("first call s", time.perf_counter() - t, flush=True)
t = time.perf_counter()
r = fs.sinkhorn(x, y, a, b, eps=0.1, n_iters=10, tol=None, schedule="alternating")
torch.cuda.synchronize()
print("first call alt s", time.perf_counter() - t, flush=True)


def bench(n, d, schedule, precision, cfg=None):
    x, y, a, b = data(n, d)
    orig = lse.lse_config
    if cfg is not None:
        lse.lse_config = lambda dd, half=False: (
            configs.LSEConfig(*cfg)
            if cfg[3]
            else configs.LSEConfig(cfg[0], cfg[1], cfg[2], triton.cdiv(dd, cfg[2]), cfg[4], cfg[5])
        )
    try:
        fn = lambda: fs.sinkhorn(
            x,
            y,
            a,
            b,
            eps=0.1,
            n_iters=10,
            tol=None,
            schedule=schedule,
            precision=precision,
            check_finite=False,
        )
        fn()
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    except Exception as e:
        ms = float("nan")
        print("ERR", n, d, cfg, repr(e)[:300], flush=True)
    finally:
        lse.lse_config = orig
    row = dict(n=n, d=d, schedule=schedule, precision=precision, cfg=cfg, ms=ms)
    rows.append(row)
    print(row, flush=True)


for n, d in [(10000, 64), (50000, 64), (40000, 128), (10000, 512), (20000, 1024)]:
    for sch in ("symmetric", "alternating"):
        bench(n, d, sch, "tf32")
# dense: row-mode vs column-mode sweeps over K at 10k d=512
from flashsinkhorn.backends.triton.dense import DenseTritonBackend
from flashsinkhorn.problem import prepare

x, y, a, b = data(10000, 512)
p = prepare(x, y, a, b, rho_x=None, rho_y=None, precision="tf32")
db = DenseTritonBackend(p)
f = torch.zeros_like(p.X.sq)
g = torch.zeros_like(p.Y.sq)
for name, args in (
    ("row", (p.X, p.Y, g, 0.1, f, 0.0, 1.0, False, "tf32")),
    ("col", (p.Y, p.X, f, 0.1, g, 0.0, 1.0, False, "tf32")),
):
    ms = triton.testing.do_bench(
        lambda: db.softmin(*args), warmup=25, rep=100, return_mode="median"
    )
    print("dense", name, ms, "GB/s", 4e8 / ms / 1e6, flush=True)
    rows.append(dict(dense=name, ms=ms))
# accuracy of precisions vs float64 torch
x, y, a, b = data(10000, 64, seed=3)
ref = fs.sinkhorn(x.double(), y.double(), a.double(), b.double(), eps=0.1, n_iters=10, tol=None)
for p in ("ieee", "tf32x3", "tf32"):
    for path in ("streaming",):
        r = fs.sinkhorn(x, y, a, b, eps=0.1, n_iters=10, tol=None, precision=p, path=path)
        print(path, end=" ")
        rel_v = ((r.value.double() - ref.value).abs() / ref.value.abs()).item()
        rel_f = ((r.f.double() - ref.f).norm() / ref.f.norm()).item()
        rows.append(dict(acc=p, rel_value=rel_v, rel_f=rel_f))
        print(p, rel_v, rel_f, flush=True)
json.dump(dict(device=dev, rows=rows), open(f"{OUT}/smoke.json", "w"), indent=1)
