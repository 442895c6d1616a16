import sys, statistics, torch, triton

sys.path.insert(0, "bench/dev")
from _cuda_timing import wall_ms, events_ms
import flashsinkhorn as fs
from flashsinkhorn.backends.triton import lse, configs

g = torch.Generator(device="cuda").manual_seed(0)
B, n, d = 64, 1024, 3
x = torch.rand(B, n, d, device="cuda", generator=g)
y = torch.rand(B, n, d, device="cuda", generator=g)
xg = x.clone().requires_grad_(True)


def fb():
    loss = fs.ot_cost(xg, y, eps=0.1, n_iters=10, tol=None, schedule="symmetric", precision="tf32")
    (gx,) = torch.autograd.grad(loss.sum(), xg)


def fwd():
    fs.sinkhorn(x, y, eps=0.1, n_iters=10, tol=None, precision="tf32")


orig = lse.lse_config
old = lambda dd, half=False: configs.LSEConfig(
    128, 64, max(16, triton.next_power_of_2(dd)), 1, 8, 3
)
for rep in range(2):
    for name, cfg in (("new", orig), ("old", old)):
        lse.lse_config = cfg
        fb()
        fwd()
        print(
            rep,
            name,
            "fwd+bwd wall %.3f ev %.3f | fwd wall %.3f ev %.3f"
            % (wall_ms(fb), events_ms(fb), wall_ms(fwd), events_ms(fwd)),
            flush=True,
        )
lse.lse_config = orig
from torch.profiler import profile, ProfilerActivity

with profile(activities=[ProfilerActivity.CUDA]) as prof:
    fb()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
