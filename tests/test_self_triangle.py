"""The triangular self step (backends/triton/plan_self.py): T(f) of a self problem read off the
upper triangle of its symmetric plan, its range check and the guarded online-LSE fallback.
Interpreter on CPU, real kernels on CUDA, against the torch backend in float64 and the
online-LSE sweep of the Triton backend."""

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import _triton_launch as L
from flashsinkhorn import tuning
from flashsinkhorn.backends import TorchBackend
from flashsinkhorn.backends.triton import configs, plan_self, softmin
from flashsinkhorn.problem import prepare
from flashsinkhorn.tuning import TUNING

from .clouds import weighted_clouds

F64 = torch.float64


def _self_problem(B, n, d, device, seed=0, cost="sqeuclidean", precision="ieee", rho=None,
                  dtype=torch.float32, null=()):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, n, d, generator=g, dtype=F64)
    a = torch.rand(B, n, generator=g, dtype=F64) + 0.05
    for i in null:
        a[:, i] = 0.0
    a = a / a.sum(1, keepdim=True)
    x, a = x.to(device=device, dtype=dtype), a.to(device=device, dtype=dtype)
    return prepare(x, x, a, a, rho_x=rho, rho_y=rho, precision=precision, cost=cost)


def _iterate(X64, eps, k=3):
    """f after k float64 self steps of the loop from zero: a plain update, then averages."""
    tb = TorchBackend()
    lam = X64.damping(eps)
    f = torch.zeros_like(X64.sq)
    for i in range(k):
        al, w = (0.0, 1.0) if i == 0 else (0.5, 0.5)
        f, _ = tb.softmin(X64, X64, f, eps, f, al, w * lam, False, "ieee")
    return f


def _spy_flags(mp):
    """Records the fallback flag of each triangular step (1: the online-LSE step redid it)."""
    flags = []
    real = plan_self.guarded_softmin

    def spy(*args):
        # (not the recorded launches of a first step's parallel compile on CUDA)
        if L._RECORDING.get() is None:
            flags.append(int(args[-1].item()))
        return real(*args)

    mp.setattr(plan_self, "guarded_softmin", spy)
    return flags


def _step_with_flag(monkeypatch, *args, **kw):
    with monkeypatch.context() as mp:
        flags = _spy_flags(mp)
        out = plan_self.self_step(*args, **kw)
    return out, flags[-1]


def _check_against_float64(got, lse, want):
    """fp32 accuracy, and never worse than the online-LSE sweep with the same operands (the
    euclidean cost and the float16 operands of "tf32" lose digits for both)."""
    want = want.cpu()
    err = (got.double().cpu() - want).abs().max()
    lse_err = (lse.double().cpu() - want).abs().max()
    assert err <= max(2e-6 * want.abs().max(), 1.5 * lse_err), (float(err), float(lse_err))


CASES = [(2, 37, 3), (3, 70, 17), (1, 129, 3), (2, 129, 17), (1, 45, 130)]


@pytest.mark.parametrize("B,n,d", CASES)
@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
def test_self_step_matches_float64(device, monkeypatch, B, n, d, cost):
    eps = 0.2 if cost == "sqeuclidean" else 0.1
    p = _self_problem(B, n, d, device, cost=cost)
    p64 = _self_problem(B, n, d, "cpu", cost=cost, dtype=F64)
    f = _iterate(p64.X, eps).float().to(device)
    f0 = f.clone()
    (out, raw), flag = _step_with_flag(monkeypatch, p.X, f, eps, 0.5, 0.5, True, "ieee")
    assert flag == 0  # in range: the triangle's own result, not the fallback's
    assert torch.equal(f, f0)  # read, never written
    want = TorchBackend().softmin(p64.X, p64.X, f.double().cpu(), eps, f.double().cpu(),
                                  0.5, 0.5, True, "ieee")  # fmt: skip
    lse = softmin.softmin(p.X, p.X, f, eps, f, 0.5, 0.5, True, "ieee")
    for got, lse_got, w in zip((out, raw), lse, want, strict=True):
        _check_against_float64(got, lse_got, w)
    # Without the raw output the update is the same number.
    out2, none = plan_self.self_step(p.X, f, eps, 0.5, 0.5, False, "ieee")
    assert none is None and torch.equal(out2, out)


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("B,n,d", [(2, 37, 17), (1, 70, 3)])
def test_precisions_match_the_online_lse_sweep(device, monkeypatch, precision, B, n, d):
    eps = 0.2
    p = _self_problem(B, n, d, device, precision=precision)
    p64 = _self_problem(B, n, d, "cpu", dtype=F64)
    f = _iterate(p64.X, eps).float().to(device)
    (out, raw), flag = _step_with_flag(monkeypatch, p.X, f, eps, 0.5, 0.5, True, precision)
    assert flag == 0
    want = TorchBackend().softmin(p64.X, p64.X, f.double().cpu(), eps, f.double().cpu(),
                                  0.5, 0.5, True, "ieee")  # fmt: skip
    lse = softmin.softmin(p.X, p.X, f, eps, f, 0.5, 0.5, True, precision)
    for got, lse_got, w in zip((out, raw), lse, want, strict=True):
        _check_against_float64(got, lse_got, w)


@pytest.mark.parametrize("B,n,d", [(2, 70, 3), (3, 37, 17)])
def test_zero_weight_points(device, monkeypatch, B, n, d):
    """Zero-weight points add nothing to the other rows, and their own rows (the soft-min of
    the others) come out right too, in every block of the triangle."""
    eps = 0.2
    null = (0, 5, n // 2, n - 1)
    p = _self_problem(B, n, d, device, null=null)
    p64 = _self_problem(B, n, d, "cpu", dtype=F64, null=null)
    assert p.X.has_null
    f = _iterate(p64.X, eps).float().to(device)
    (out, raw), flag = _step_with_flag(monkeypatch, p.X, f, eps, 0.5, 0.5, True, "ieee")
    assert flag == 0
    want = TorchBackend().softmin(p64.X, p64.X, f.double().cpu(), eps, f.double().cpu(),
                                  0.5, 0.5, True, "ieee")  # fmt: skip
    lse = softmin.softmin(p.X, p.X, f, eps, f, 0.5, 0.5, True, "ieee")
    for got, lse_got, w in zip((out, raw), lse, want, strict=True):
        assert torch.isfinite(got).all()
        _check_against_float64(got, lse_got, w)


@pytest.mark.parametrize("groups_per_sm,split", [(1, 1), (1, 3), (4, 5), (4, None)])
@pytest.mark.parametrize("rows_per_tile", [32, 64], ids=["square", "two-column-tiles"])
def test_groups_and_chunks(device, monkeypatch, groups_per_sm, split, rows_per_tile):
    """Several pairs of row blocks in one program (their partial row reused), the pairs'
    tiles in chunks that cross from one block of the pair to the other, and row blocks as
    tall as two column tiles (the GPU's d <= 128 tiles: a diagonal block of two tiles)."""
    eps = 0.2
    B, n, d = 2, 161 if rows_per_tile == 32 else 259, 3
    monkeypatch.setattr(configs, "GROUPS_PER_SM", groups_per_sm)
    monkeypatch.setattr(TUNING, "softmin_split", split)
    if device.type == "cpu":
        tall = configs.LSEConfig(rows_per_tile, 32, 16, 1, 4, 1)
        monkeypatch.setattr(plan_self, "self_plan_config", lambda d, half=False: tall)
    p = _self_problem(B, n, d, device, seed=1, rho=0.6)
    p64 = _self_problem(B, n, d, "cpu", seed=1, rho=0.6, dtype=F64)
    cfg = plan_self.self_plan_config(d)
    groups, n_split, _, pairs = plan_self.layout(n, B, cfg, p.X.x.device)
    if groups_per_sm == 1 and device.type == "cpu":
        assert groups < pairs  # grouped
    f = _iterate(p64.X, eps).float().to(device)
    lam = p.X.damping(eps)
    (out, raw), flag = _step_with_flag(monkeypatch, p.X, f, eps, 0.5, 0.5 * lam, True, "ieee")
    assert flag == 0
    want = TorchBackend().softmin(p64.X, p64.X, f.double().cpu(), eps, f.double().cpu(),
                                  0.5, 0.5 * lam, True, "ieee")  # fmt: skip
    lse = softmin.softmin(p.X, p.X, f, eps, f, 0.5, 0.5 * lam, True, "ieee")
    for got, lse_got, w in zip((out, raw), lse, want, strict=True):
        _check_against_float64(got, lse_got, w)


@pytest.mark.parametrize("n", [1000, 4097, 10_000, 40_000, 100_000])
@pytest.mark.parametrize("rows", [128, 256])
def test_layout_on_a_gpu(monkeypatch, n, rows):
    """The H100's grid (132 SMs, 2 blocks each): chunks cover each pair's tiles, every pair
    has a program, the partial rows stay within the cap, and a grid of one wave or more takes
    within 15 % of the time of a perfectly balanced one (waves × tiles per chunk)."""
    monkeypatch.setattr(plan_self, "sm_count", lambda device: 132)
    cfg = configs.LSEConfig(rows, 128, 64, 1, 4, 3, blocks_per_sm=2)
    B = 2
    groups, split, tpc, pairs = plan_self.layout(n, B, cfg, torch.device("cuda"))
    nb, nt = -(-n // rows), -(-n // 128)
    t_pair = 2 * nt - (nb - 1) * (rows // 128) if nb > 1 else nt
    assert pairs == -(-nb // 2) and 1 <= groups <= pairs
    assert (split - 1) * tpc < t_pair <= split * tpc
    assert groups * split <= configs.GROUPS_PER_SM * 132
    programs, slots = groups * B * split, 2 * 132
    if groups == pairs and programs >= slots:
        assert -(-programs // slots) * tpc <= 1.15 * B * pairs * t_pair / slots


@pytest.mark.parametrize("split", [None, 2])
@pytest.mark.parametrize("offset", [8.0, -8.0])
def test_out_of_range_sums_fall_back_to_online_lse(device, monkeypatch, offset, split):
    """A potential far above (overflow) or below (underflow) the balanced one: the guarded
    online-LSE step must redo the step (its kernel is the two-sweep step's, so equal to the
    single sweep's up to how the compiler contracts the same code), also with its columns
    split and merged by the guarded combine launch."""
    monkeypatch.setattr(TUNING, "softmin_split", split)
    eps = 0.05
    p = _self_problem(2, 45, 5, device, seed=3)
    p64 = _self_problem(2, 45, 5, "cpu", seed=3, dtype=F64)
    f = (_iterate(p64.X, eps) + offset).float().to(device)
    (out, raw), flag = _step_with_flag(monkeypatch, p.X, f, eps, 0.5, 0.5, True, "ieee")
    assert flag == 1
    want = softmin.softmin(p.X, p.X, f, eps, f, 0.5, 0.5, True, "ieee")
    for got, w in zip((out, raw), want, strict=True):
        assert torch.isfinite(got).all()
        assert (got - w).abs().max() <= 1e-6 * w.abs().max()
        if device.type == "cpu":
            assert torch.equal(got, w)


def test_flag_is_reset_every_step(device, monkeypatch):
    eps = 0.1
    p = _self_problem(1, 33, 3, device, seed=5)
    p64 = _self_problem(1, 33, 3, "cpu", seed=5, dtype=F64)
    f = _iterate(p64.X, eps).float().to(device)
    _, flag = _step_with_flag(monkeypatch, p.X, f + 10.0, eps, 0.5, 0.5, False, "ieee")
    assert flag == 1
    _, flag = _step_with_flag(monkeypatch, p.X, f, eps, 0.5, 0.5, False, "ieee")
    assert flag == 0


def test_second_phase_shift(device, monkeypatch):
    """The first averaged step after the plain update from zero, with the plan's shift: in
    range and right."""
    eps = 0.05
    B, n, d = 2, 70, 5
    p = _self_problem(B, n, d, device, seed=7)
    p64 = _self_problem(B, n, d, "cpu", seed=7, dtype=F64)
    f = _iterate(p64.X, eps, k=1).float().to(device)
    (out, _), flag = _step_with_flag(
        monkeypatch, p.X, f, eps, 0.5, 0.5, False, "ieee", phase="second"
    )
    assert flag == 0
    want, _ = TorchBackend().softmin(p64.X, p64.X, f.double().cpu(), eps, f.double().cpu(),
                                     0.5, 0.5, False, "ieee")  # fmt: skip
    lse, _ = softmin.softmin(p.X, p.X, f, eps, f, 0.5, 0.5, False, "ieee")
    _check_against_float64(out, lse, want)


@pytest.mark.parametrize(
    "B,n,m,rho", [(None, 37, 37, None), (2, 33, 33, 0.7), (None, 37, 29, None)]
)
def test_divergence_value_and_gradient(device, monkeypatch, B, n, m, rho):
    """sinkhorn_divergence with the Triton backend (self terms through the triangle) against
    the torch backend in float64."""
    kw = dict(eps=0.1, tol=None, n_iters=6, schedule="symmetric", scaling=None, rho_x=rho,
              rho_y=rho)  # fmt: skip
    # d > 32: where the backend takes the plan steps on CUDA too (plan.preferred)
    x, y, a, b = weighted_clouds(n, m, 40, B=B, seed=11)
    ref_in = [t.clone().requires_grad_() for t in (x, y)]
    ref = fs.sinkhorn_divergence(ref_in[0], ref_in[1], a, b, backend="torch", **kw)
    ref_g = torch.autograd.grad(ref.sum(), ref_in)
    got_in = [t.float().to(device).requires_grad_() for t in (x, y)]
    calls = []
    real = plan_self.self_step

    def counting(*args, **kwargs):
        calls.append(args[7])
        return real(*args, **kwargs)

    with tuning.override(solve_graphs=False), monkeypatch.context() as mp:
        flags = _spy_flags(mp)
        mp.setattr(plan_self, "self_step", counting)
        got = fs.sinkhorn_divergence(
            got_in[0], got_in[1], a.float().to(device), b.float().to(device),
            backend="triton", precision="ieee", **kw,
        )  # fmt: skip
        got_g = torch.autograd.grad(got.sum(), got_in)
    # every step but the plain update from zero, of one stacked self solve or of two
    assert calls == (["second"] + ["iterate"] * 4) * (1 if n == m else 2)
    assert flags[-1] == 0
    scale = ref.abs().max()
    assert (got.detach().double().cpu() - ref.detach()).abs().max() <= 2e-5 * scale + 1e-7
    for gg, gr in zip(got_g, ref_g, strict=True):
        assert (gg.double().cpu() - gr).abs().max() <= 2e-5 * gr.abs().max() + 1e-7


@pytest.mark.gpu
@pytest.mark.parametrize("n", [3000, 4097])
@pytest.mark.parametrize("d", [17, 64, 128])
def test_gpu_self_step_matches_float64(monkeypatch, n, d):
    eps = 0.1
    null = (0, 1000, n - 1) if d == 64 else ()
    p64 = _self_problem(2, n, d, "cuda", seed=2, dtype=F64, null=null)
    f = _iterate(p64.X, eps, k=4).float()
    want = TorchBackend().softmin(p64.X, p64.X, f.double(), eps, f.double(), 0.5, 0.5, True,
                                  "ieee")  # fmt: skip
    for precision in ("ieee", "tf32x3", "tf32"):
        p = _self_problem(2, n, d, "cuda", seed=2, null=null, precision=precision)
        (out, raw), flag = _step_with_flag(monkeypatch, p.X, f, eps, 0.5, 0.5, True, precision)
        assert flag == 0
        lse = softmin.softmin(p.X, p.X, f, eps, f, 0.5, 0.5, True, precision)
        for got, lse_got, w in zip((out, raw), lse, want, strict=True):
            _check_against_float64(got, lse_got, w)


def _spy_phases(mp):
    """Records (phase, fallback flag) of each triangular step."""
    steps, phases = [], []
    real_step, real_guard = plan_self.self_step, plan_self.guarded_softmin

    def step(*args, **kw):
        phases.append(args[7])
        return real_step(*args, **kw)

    def guard(*args):
        if L._RECORDING.get() is None:
            steps.append((phases[-1], int(args[-1].item())))
        return real_guard(*args)

    mp.setattr(plan_self, "self_step", step)
    mp.setattr(plan_self, "guarded_softmin", guard)
    return steps


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_divergence_matches_torch(monkeypatch, d):
    """The bench's problem (uniform clouds, eps = 0.1, 10 iterations) at 4097 points: value
    and gradient against the torch backend in float64, never worse than with the online-LSE
    self steps, and no step from an iterate falls back."""
    x, y, a, b = weighted_clouds(4097, 4097, d, seed=d)
    kw = dict(eps=0.1, tol=None, n_iters=10, schedule="symmetric", scaling=None)
    ref_in = [t.cuda().requires_grad_() for t in (x, y)]
    ref = fs.sinkhorn_divergence(*ref_in, a.cuda(), b.cuda(), backend="torch", **kw)
    ref_g = torch.autograd.grad(ref, ref_in)
    ref = ref.detach()

    def run(precision):
        inp = [t.float().cuda().requires_grad_() for t in (x, y)]
        s = fs.sinkhorn_divergence(inp[0], inp[1], a.float().cuda(), b.float().cuda(),
                                   backend="triton", precision=precision, **kw)  # fmt: skip
        return s.detach().double(), [g.double() for g in torch.autograd.grad(s, inp)]

    for precision in ("ieee", "tf32x3"):
        with tuning.override(solve_graphs=False), monkeypatch.context() as mp:
            steps = _spy_phases(mp)
            got, got_g = run(precision)
        assert [ph for ph, _ in steps] == ["second"] + ["iterate"] * 8
        assert all(flag == 0 for ph, flag in steps if ph == "iterate"), steps
        with tuning.override(plan_step=False):
            lse, lse_g = run(precision)
        err, lse_err = (got - ref).abs(), (lse - ref).abs()
        assert err <= max(1e-5 * ref.abs(), 2.0 * lse_err), (precision, err, lse_err)
        for gg, lg, rg in zip(got_g, lse_g, ref_g, strict=True):
            err, lse_err = (gg - rg).abs().max(), (lg - rg).abs().max()
            assert err <= max(1e-4 * rg.abs().max(), 2.0 * lse_err), (precision, err, lse_err)


@pytest.mark.gpu
def test_gpu_graphs_replay_the_triangle():
    """Fixed-iteration solves captured and replayed as CUDA graphs, and the tolerance blocks
    replayed from graphs, give the eager solve: the triangular step never synchronises."""
    from flashsinkhorn import engine
    from flashsinkhorn.options import SinkhornOptions
    from flashsinkhorn.solvers import blocks

    x, y, a, b = (t.float().cuda() for t in weighted_clouds(3000, 3000, 64, B=2, seed=4))
    kw = dict(eps=0.1, tol=None, n_iters=10, schedule="symmetric", scaling=None)
    with tuning.override(solve_graphs=False):
        eager = fs.sinkhorn_divergence(x, y, a, b, **kw)
    for _ in range(3):  # seen, captured, replayed
        got = fs.sinkhorn_divergence(x, y, a, b, **kw)
        assert (got - eager).abs().max() <= 1e-6 * eager.abs().max()

    opts = SinkhornOptions.build(x, y, eps=0.05, tol=1e-4, n_iters=3000, scaling=None,
                                 backend="triton", precision="ieee")  # fmt: skip
    with tuning.override(tolerance_graphs=False):
        ref = engine.solve_divergence(x, y, a, b, opts)
    before = blocks.stats()["replayed"]
    for _ in range(2):  # the second solve replays its blocks from the first on
        res = engine.solve_divergence(x, y, a, b, opts)
    assert blocks.stats()["replayed"] > before
    for got, want in zip(res[1:], ref[1:], strict=True):  # the self terms
        assert got.converged and want.converged
        assert abs(got.n_iters - want.n_iters) <= 3  # at most one test window apart
        assert (got.value - want.value).abs().max() <= 1e-5 * want.value.abs().max()


@pytest.mark.gpu
def test_gpu_no_recompile_for_new_n():
    """A new n at a known d reuses the compiled kernels (n and its strides not specialised)."""
    kernels = (plan_self._plan_self_fwd_kernel, plan_self._plan_self_bias_kernel,
               plan_self._plan_self_finish_kernel)  # fmt: skip

    def n_compiled():
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    def step(n):
        p = _self_problem(2, n, 64, "cuda", seed=n, precision="tf32")
        f = torch.zeros_like(p.X.sq)
        plan_self.self_step(p.X, f, 0.1, 0.5, 0.5, False, "tf32")

    step(1000)
    before = n_compiled()
    for n in (1537, 3001, 4097, 20_011):
        step(n)
    assert n_compiled() == before
