"""OTDD: the batched class-distance builder and the label-augmented dataset distance.

References written here, independently of the library: a dense float64 log-domain Sinkhorn
on an explicitly built augmented cost matrix, debiased by hand.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.otdd import augment_labels, class_distance_matrix, otdd_distance

D64 = torch.float64


# ----------------------------------------------------------------------------- fixtures


def _dataset(sizes, d, seed, shift=0.0, dtype=D64):
    """Clustered labelled cloud: class k has sizes[k] points around a class centre."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(len(sizes), d, generator=g, dtype=dtype)
    x, l = [], []
    for k, s in enumerate(sizes):
        x.append(centres[k] + 0.4 * torch.randn(s, d, generator=g, dtype=dtype) + shift)
        l.append(torch.full((s,), k, dtype=torch.int64))
    # Interleave the classes so that grouping by label is exercised.
    perm = torch.randperm(sum(sizes), generator=g)
    return torch.cat(x)[perm], torch.cat(l)[perm]


def _weights(n, seed, dtype=D64):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=g, dtype=dtype) + 0.5
    return w / w.sum()


# ----------------------------------------------------------------------------- dense reference


def _sqdist(x, y):
    return ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)


def _dense_ot(C, a, b, eps, iters=50000, tol=1e-13):
    """Log-domain Sinkhorn on a dense cost to float64 convergence; returns (value, plan).

    Alternating updates in general; a self problem (b is a, C symmetric) uses the averaged
    fixed-point iteration f <- (f + T(f)) / 2 of its symmetric potential, which converges
    fast even when the classes are nearly disconnected (alternating updates crawl there).
    The reference refuses to return an unconverged plan.
    """
    la, lb = a.log(), b.log()
    sym = b is a and torch.equal(C, C.T)
    f = torch.zeros_like(a)
    g = torch.zeros_like(b)
    for _ in range(iters):
        if sym:
            f = 0.5 * (f - eps * torch.logsumexp(la[None, :] + (f[None, :] - C) / eps, dim=1))
            g = f
        else:
            f = -eps * torch.logsumexp(lb[None, :] + (g[None, :] - C) / eps, dim=1)
            g = -eps * torch.logsumexp(la[:, None] + (f[:, None] - C) / eps, dim=0)
        P = torch.exp(la[:, None] + lb[None, :] + (f[:, None] + g[None, :] - C) / eps)
        err = (P.sum(1) - a).abs().sum() + (P.sum(0) - b).abs().sum()
        if err < tol:
            return (a * f).sum() + (b * g).sum(), P
    raise AssertionError(f"dense reference did not converge (marginal error {err:.2e})")


def _dense_divergence(x, y, a, b, eps):
    xy, _ = _dense_ot(_sqdist(x, y), a, b, eps)
    xx, _ = _dense_ot(_sqdist(x, x), a, a, eps)
    yy, _ = _dense_ot(_sqdist(y, y), b, b, eps)
    return xy - 0.5 * (xx + yy)


def _dense_W(x1, l1, x2, l2, eps, a1=None, a2=None):
    """W over the union of label sets by a double loop of dense divergences."""
    clouds = []
    for x, l, a in ((x1, l1, a1), (x2, l2, a2)):
        for k in range(int(l.max()) + 1):
            m = l == k
            w = torch.full((int(m.sum()),), 1.0, dtype=x.dtype) if a is None else a[m]
            clouds.append((x[m], w / w.sum()))
    V = len(clouds)
    W = torch.zeros(V, V, dtype=x1.dtype)
    for i, j in itertools.combinations(range(V), 2):
        W[i, j] = W[j, i] = _dense_divergence(*clouds[i][:1], *clouds[j][:1], clouds[i][1],
                                              clouds[j][1], eps)  # fmt: skip
    return W


def _dense_otdd(x1, l1, x2, l2, W, eps, fw, lw, a1, a2):
    """Debiased OTDD with the augmented cost built explicitly; also the envelope gradients."""
    V1 = int(l1.max()) + 1
    m1, m2 = l1, l2 + V1
    C12 = fw * _sqdist(x1, x2) + lw * W[m1][:, m2]
    C11 = fw * _sqdist(x1, x1) + lw * W[m1][:, m1]
    C22 = fw * _sqdist(x2, x2) + lw * W[m2][:, m2]
    v12, P12 = _dense_ot(C12, a1, a2, eps)
    v11, P11 = _dense_ot(C11, a1, a1, eps)
    v22, P22 = _dense_ot(C22, a2, a2, eps)
    value = v12 - 0.5 * (v11 + v22)
    # Envelope gradients at fixed W: ∂C12_ij/∂x1_i = 2 fw (x1_i − x2_j); the self term sees
    # x1 on both sides, and its plan is symmetric.
    g1 = 2 * fw * ((P12.sum(1)[:, None] * x1 - P12 @ x2) - (P11.sum(1)[:, None] * x1 - P11 @ x1))
    g2 = 2 * fw * ((P12.sum(0)[:, None] * x2 - P12.T @ x1) - (P22.sum(1)[:, None] * x2 - P22 @ x2))
    return value, g1, g2


# ----------------------------------------------------------------------------- W builder


@pytest.mark.parametrize("max_batch_elements", [None, 40])
@pytest.mark.parametrize("weighted", [False, True])
def test_class_distance_matrix_equals_loop_of_divergences(max_batch_elements, weighted):
    # Ragged classes, unequal label sets (3 vs 4 classes); max_batch_elements=40 forces
    # batches of one or two pairs (chunking). Fixed iteration count: the batched solve and the
    # loop run exactly the same iterations, so they agree to round-off.
    x1, l1 = _dataset([5, 9, 2], 3, seed=1)
    x2, l2 = _dataset([7, 1, 4, 6], 3, seed=2, shift=0.3)
    a1 = _weights(len(l1), 3) if weighted else None
    a2 = _weights(len(l2), 4) if weighted else None
    kw = dict(eps=0.3, n_iters=60, tol=None)
    W = class_distance_matrix(
        x1, l1, x2, l2, a1=a1, a2=a2, max_batch_elements=max_batch_elements, **kw
    )
    assert W.shape == (7, 7) and W.dtype == D64
    clouds = []
    for x, l, a in ((x1, l1, a1), (x2, l2, a2)):
        for k in range(int(l.max()) + 1):
            m = l == k
            w = None if a is None else a[m] / a[m].sum()
            clouds.append((x[m], w))
    for i, j in itertools.combinations(range(7), 2):
        (xi, wi), (xj, wj) = clouds[i], clouds[j]
        ref = fs.sinkhorn_divergence(xi, xj, wi, wj, **kw)
        assert torch.allclose(W[i, j], ref, rtol=1e-11, atol=1e-12), (i, j, W[i, j], ref)
        assert W[j, i] == W[i, j]


def test_class_distance_matrix_against_dense_reference():
    x1, l1 = _dataset([6, 4, 8], 2, seed=5)
    x2, l2 = _dataset([5, 7], 2, seed=6, shift=0.5)
    eps = 0.5
    W = class_distance_matrix(x1, l1, x2, l2, eps=eps, tol=1e-12, n_iters=20000)
    ref = _dense_W(x1, l1, x2, l2, eps)
    assert torch.allclose(W, ref, rtol=1e-6, atol=1e-9)


def test_class_distance_matrix_properties():
    x1, l1 = _dataset([8, 3, 5, 6], 4, seed=7)
    x2, l2 = _dataset([4, 9, 2], 4, seed=8, shift=1.0)
    W = class_distance_matrix(x1, l1, x2, l2, eps=0.2)
    assert W.shape == (7, 7)
    assert torch.equal(W, W.T)
    assert torch.equal(W.diagonal(), torch.zeros(7, dtype=D64))
    assert (W >= 0).all()
    # Distinct clusters: every off-diagonal entry is clearly positive.
    off = W[~torch.eye(7, dtype=torch.bool)]
    assert (off > 1e-3).all()
    # Identical datasets: the cross block carries the within-dataset distances and a zero
    # diagonal (class k against its copy).
    # (identical classes: the symmetric schedule converges, the alternating one crawls there)
    Wsame = class_distance_matrix(
        x1, l1, x1.clone(), l1.clone(), eps=0.2, tol=1e-9, schedule="symmetric"
    )
    V1 = 4
    assert torch.allclose(Wsame[:V1, V1:], Wsame[:V1, :V1], atol=1e-7)
    assert Wsame[:V1, V1:].diagonal().abs().max() <= 1e-7


def test_class_distance_matrix_float32_and_num_classes():
    x1, l1 = _dataset([4, 6], 3, seed=9, dtype=torch.float32)
    x2, l2 = _dataset([5, 3, 4], 3, seed=10, dtype=torch.float32)
    W32 = class_distance_matrix(x1, l1, x2, l2, eps=0.3, tol=1e-6)
    W64 = class_distance_matrix(x1.double(), l1, x2.double(), l2, eps=0.3, tol=1e-9)
    assert W32.dtype == torch.float32
    assert torch.allclose(W32.double(), W64, rtol=1e-4, atol=1e-5)
    # num_classes equal to the natural values changes nothing; int32 labels are accepted.
    W = class_distance_matrix(x1, l1.int(), x2, l2.int(), eps=0.3, tol=1e-6, num_classes=(2, 3))
    assert torch.equal(W, W32)


def test_class_distance_matrix_differentiable():
    x1, l1 = _dataset([4, 5], 2, seed=11)
    x2, l2 = _dataset([3, 4], 2, seed=12)
    x1.requires_grad_(True)
    kw = dict(eps=0.4, tol=1e-12, n_iters=20000)
    W = class_distance_matrix(x1, l1, x2, l2, **kw)
    assert not W.requires_grad  # default: no graph through the class problems
    W = class_distance_matrix(x1, l1, x2, l2, differentiable=True, **kw)
    probe = torch.linspace(0.5, 2.0, 16, dtype=D64).reshape(4, 4)
    (grad,) = torch.autograd.grad((W * probe).sum(), x1)
    # Central finite differences along a random direction.
    g = torch.Generator().manual_seed(0)
    v = torch.randn(x1.shape, generator=g, dtype=D64)
    h = 1e-5
    with torch.no_grad():
        up = (class_distance_matrix(x1 + h * v, l1, x2, l2, **kw) * probe).sum()
        dn = (class_distance_matrix(x1 - h * v, l1, x2, l2, **kw) * probe).sum()
    fd = (up - dn) / (2 * h)
    assert torch.allclose((grad * v).sum(), fd, rtol=1e-6, atol=1e-9)


def test_progress_bar_runs(capsys):
    pytest.importorskip("tqdm")
    x1, l1 = _dataset([3, 4], 2, seed=13)
    x2, l2 = _dataset([4, 2], 2, seed=14)
    W = class_distance_matrix(x1, l1, x2, l2, eps=0.5, progress=True, max_batch_elements=8)
    assert W.shape == (4, 4)
    assert "class distances" in capsys.readouterr().err


# ----------------------------------------------------------------------------- OTDD


@pytest.mark.parametrize("weighted", [False, True])
def test_otdd_distance_against_dense_reference(weighted):
    x1, l1 = _dataset([6, 3, 5], 3, seed=20)
    x2, l2 = _dataset([4, 7], 3, seed=21, shift=0.4)
    n1, n2 = len(l1), len(l2)
    a1 = _weights(n1, 22) if weighted else torch.full((n1,), 1.0 / n1, dtype=D64)
    a2 = _weights(n2, 23) if weighted else torch.full((n2,), 1.0 / n2, dtype=D64)
    eps, fw, lw = 0.5, 0.7, 0.4
    W = _dense_W(x1, l1, x2, l2, eps, a1, a2)
    ref, g1, g2 = _dense_otdd(x1, l1, x2, l2, W, eps, fw, lw, a1, a2)

    x1g, x2g = x1.clone().requires_grad_(True), x2.clone().requires_grad_(True)
    kw = dict(eps=eps, feature_weight=fw, label_weight=lw, tol=1e-12, n_iters=20000)
    kw_a = dict(a1=a1, a2=a2) if weighted else {}
    # W built inside (detached): the value and the fixed-W gradient.
    val = otdd_distance(x1g, l1, x2g, l2, **kw_a, **kw)
    assert torch.allclose(val, ref, rtol=1e-6, atol=0)
    gx1, gx2 = torch.autograd.grad(val, (x1g, x2g))
    assert torch.allclose(gx1, g1, rtol=1e-6, atol=1e-9)
    assert torch.allclose(gx2, g2, rtol=1e-6, atol=1e-9)
    # The same with the reference W given.
    val_w = otdd_distance(x1, l1, x2, l2, label_cost=W, **kw_a, **kw)
    assert torch.allclose(val_w, ref, rtol=1e-6, atol=0)


def test_label_cost_solve_against_dense_reference():
    # The raw label-cost solve through the public API with augment_labels.
    x1, l1 = _dataset([5, 4], 2, seed=30)
    x2, l2 = _dataset([3, 6, 2], 2, seed=31)
    W = class_distance_matrix(x1, l1, x2, l2, eps=0.3, tol=1e-12, n_iters=20000)
    lx, ly = augment_labels(l1, l2)
    a1 = torch.full((9,), 1 / 9, dtype=D64)
    a2 = torch.full((11,), 1 / 11, dtype=D64)
    val = fs.ot_cost(
        x1, x2, eps=0.3, label_x=lx, label_y=ly, label_cost=W, tol=1e-12, n_iters=20000,
        feature_weight=0.5, label_weight=0.5,
    )  # fmt: skip
    C = 0.5 * _sqdist(x1, x2) + 0.5 * W[lx][:, ly]
    ref, _ = _dense_ot(C, a1, a2, 0.3)
    assert torch.allclose(val, ref, rtol=1e-6, atol=0)


def test_otdd_gradient_through_w_matches_finite_differences():
    x1, l1 = _dataset([4, 5], 2, seed=40)
    x2, l2 = _dataset([5, 3], 2, seed=41, shift=0.3)
    kw = dict(eps=0.5, tol=1e-12, n_iters=20000, feature_weight=0.5, label_weight=0.5)
    x1g = x1.clone().requires_grad_(True)
    val = otdd_distance(x1g, l1, x2, l2, differentiable_w=True, **kw)
    (grad,) = torch.autograd.grad(val, x1g)
    val_fixed = otdd_distance(x1g, l1, x2, l2, **kw)
    (grad_fixed,) = torch.autograd.grad(val_fixed, x1g)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(x1.shape, generator=g, dtype=D64)
    h = 1e-5
    with torch.no_grad():
        fd = (
            otdd_distance(x1 + h * v, l1, x2, l2, **kw)
            - otdd_distance(x1 - h * v, l1, x2, l2, **kw)
        ) / (2 * h)
    assert torch.allclose((grad * v).sum(), fd, rtol=1e-6, atol=1e-9)
    # The detached-W gradient misses the class-distance term: here it differs.
    assert not torch.allclose((grad_fixed * v).sum(), fd, rtol=1e-3, atol=0)


def test_otdd_properties():
    x1, l1 = _dataset([4, 5, 3], 3, seed=50)
    # identical datasets: the symmetric schedule converges (the alternating one crawls there)
    kw = dict(eps=0.5, tol=1e-10, n_iters=20000, schedule="symmetric")
    same = otdd_distance(x1, l1, x1.clone(), l1.clone(), **kw)
    assert abs(same.item()) <= 1e-8
    x2, l2 = _dataset([4, 5, 3], 3, seed=51, shift=0.5)
    # Exchanging the datasets gives the same distance; the cross term needs about 2,200
    # iterations to reach the tolerance on these clouds.
    d12 = otdd_distance(x1, l1, x2, l2, eps=0.5, tol=1e-5, n_iters=5000)
    d21 = otdd_distance(x2, l2, x1, l1, eps=0.5, tol=1e-5, n_iters=5000)
    assert d12 > 1e-3
    assert torch.allclose(d12, d21, rtol=1e-8)
    # Shuffling labels of dataset 2 (a relabelled copy of dataset 1) changes nothing once
    # the classes are permuted consistently.
    perm = torch.tensor([2, 0, 1])
    d_perm = otdd_distance(x1, l1, x1.clone(), perm[l1], **kw)
    assert abs(d_perm.item()) <= 1e-8


# ----------------------------------------------------------------------------- Triton


def test_class_distance_matrix_triton_interpreter(device):
    x1, l1 = _dataset([7, 3, 5], 3, seed=60, dtype=torch.float32)
    x2, l2 = _dataset([4, 9], 3, seed=61, dtype=torch.float32)
    x1, l1, x2, l2 = x1.to(device), l1.to(device), x2.to(device), l2.to(device)
    kw = dict(eps=0.3, n_iters=8, tol=None, precision="ieee")
    W_tr = class_distance_matrix(x1, l1, x2, l2, backend="triton", **kw)
    W_to = class_distance_matrix(x1, l1, x2, l2, backend="torch", **kw)
    assert torch.allclose(W_tr, W_to, rtol=1e-4, atol=1e-5)


def test_otdd_distance_triton_interpreter(device):
    x1, l1 = _dataset([7, 3, 5], 3, seed=62, dtype=torch.float32)
    x2, l2 = _dataset([4, 9, 2], 3, seed=63, dtype=torch.float32)
    x1, l1, x2, l2 = x1.to(device), l1.to(device), x2.to(device), l2.to(device)
    W = class_distance_matrix(x1, l1, x2, l2, eps=0.3, backend="torch", tol=1e-6)
    kw = dict(eps=0.3, n_iters=30, tol=None, precision="ieee", label_cost=W,
              feature_weight=0.5, label_weight=0.5)  # fmt: skip
    x1g = x1.clone().requires_grad_(True)
    v_tr = otdd_distance(x1g, l1, x2, l2, backend="triton", **kw)
    (g_tr,) = torch.autograd.grad(v_tr, x1g)
    v_to = otdd_distance(x1g, l1, x2, l2, backend="torch", **kw)
    (g_to,) = torch.autograd.grad(v_to, x1g)
    assert torch.allclose(v_tr, v_to, rtol=1e-4, atol=1e-6)
    assert torch.allclose(g_tr, g_to, rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------- bad input


def _ok():
    x1, l1 = _dataset([3, 4], 2, seed=70)
    x2, l2 = _dataset([2, 5], 2, seed=71)
    return x1, l1, x2, l2


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(l1=torch.tensor([0.0, 1.0])), TypeError, "l1 must have an integer dtype"),
        (dict(l2="labels"), TypeError, "l2 must be a torch.Tensor"),
        (dict(l1=torch.zeros(3, dtype=torch.bool)), TypeError, "l1 must have an integer dtype"),
        (dict(l1=torch.zeros(5, dtype=torch.int64)), ValueError, r"l1 must have shape \(n,\)"),
        (dict(l1=torch.zeros(7, 1, dtype=torch.int64)), ValueError, r"l1 must have shape"),
        (dict(l2=torch.tensor([0, 1, 1, -1, 0, 1, 1])), ValueError, "l2 must hold class indices"),
        (dict(l1=torch.tensor([0, 2, 2, 0, 2, 0, 2])), ValueError, r"l1 has empty classes \[1\]"),
        (dict(x2=torch.rand(7, 3, dtype=D64)), ValueError, "x1 and x2 must have the same feature"),
        (dict(x2=torch.rand(7, 2)), TypeError, "x1 and x2 must have the same dtype"),
        (dict(x1=torch.rand(1, 7, 2, dtype=D64)), ValueError, r"x1 must be 2-D \(n, d\)"),
        (dict(x1=torch.zeros(0, 2, dtype=D64)), ValueError, "x1 must not be empty"),
        (dict(x1=[[0.0, 1.0]]), TypeError, "x1 must be a torch.Tensor"),
        (dict(a1=torch.ones(3, dtype=D64)), ValueError, r"a1 must have shape \(n,\)"),
        (dict(a2=-torch.ones(7, dtype=D64)), ValueError, "a2 must be non-negative"),
        (dict(num_classes=(2,)), TypeError, "num_classes must be None or a pair"),
        (dict(num_classes=(1, 2)), ValueError, "l1 holds class index 1, out of range"),
        (dict(num_classes=(2, 3)), ValueError, r"l2 has empty classes \[2\]"),
        (dict(eps=0.0), ValueError, "eps must be finite and > 0"),
        (dict(n_iters=0), ValueError, "n_iters must be >= 1"),
        (dict(tol=-1.0), ValueError, "tol must be finite and > 0"),
        (dict(schedule="fast"), ValueError, "schedule must be one of"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
        (dict(scaling=1.5), ValueError, r"scaling must be in \(0, 1\)"),
        (dict(max_batch_elements=0), ValueError, "max_batch_elements must be >= 1"),
        (dict(differentiable=1), TypeError, "differentiable must be a bool"),
    ],
)
def test_class_distance_matrix_bad_input(change, exc, match):
    x1, l1, x2, l2 = _ok()
    args = dict(x1=x1, l1=l1, x2=x2, l2=l2, eps=0.5)
    args.update(change)
    with pytest.raises(exc, match=match):
        class_distance_matrix(**args)


def test_class_with_zero_weights_is_refused():
    x1, l1, x2, l2 = _ok()
    a1 = torch.ones(7, dtype=D64)
    a1[l1 == 1] = 0.0
    with pytest.raises(ValueError, match=r"a1 is zero on every point of classes \[1\] of l1"):
        class_distance_matrix(x1, l1, x2, l2, eps=0.5, a1=a1 / a1.sum())


def test_progress_without_tqdm(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError("No module named 'tqdm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    x1, l1, x2, l2 = _ok()
    with pytest.raises(ImportError, match="progress=True needs the tqdm package"):
        class_distance_matrix(x1, l1, x2, l2, eps=0.5, progress=True)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(label_cost=torch.zeros(3, 3, dtype=D64)), ValueError, r"label_cost must have shape"),
        (dict(label_cost=torch.zeros(4, 4, dtype=torch.int64)), TypeError, "label_cost must have"),
        (dict(label_cost=[[0.0]]), TypeError, "label_cost must be a torch.Tensor"),
        (dict(feature_weight=-1.0), ValueError, "feature_weight must be finite and >= 0"),
        (dict(label_weight="1"), TypeError, "label_weight must be a finite number"),
        (dict(w_options={"bogus": 1}), ValueError, r"w_options got unknown keys \['bogus'\]"),
        (dict(w_options=[1]), TypeError, "w_options must be a dict"),
        (
            dict(label_cost=torch.zeros(4, 4, dtype=D64), differentiable_w=True),
            ValueError,
            "must be left unset when label_cost is given",
        ),
        (dict(l2=torch.tensor([0, 1])), ValueError, r"l2 must have shape \(n,\)"),
        (dict(differentiable_w="yes"), TypeError, "differentiable_w must be a bool"),
        (dict(eps=-1.0), ValueError, "eps must be finite and > 0"),
        (dict(precision="fp8"), ValueError, "precision must be one of"),
    ],
)
def test_otdd_distance_bad_input(change, exc, match):
    x1, l1, x2, l2 = _ok()
    args = dict(x1=x1, l1=l1, x2=x2, l2=l2, eps=0.5)
    args.update(change)
    with pytest.raises(exc, match=match):
        otdd_distance(**args)


def test_augment_labels():
    l1 = torch.tensor([0, 2, 1, 2], dtype=torch.int32)
    l2 = torch.tensor([1, 0, 0])
    lx, ly = augment_labels(l1, l2)
    assert lx.dtype == ly.dtype == torch.int64
    assert lx.tolist() == [0, 2, 1, 2] and ly.tolist() == [4, 3, 3]
    _, ly = augment_labels(l1, l2, num_classes=(5, 2))
    assert ly.tolist() == [6, 5, 5]
    with pytest.raises(ValueError, match=r"l1 must be 1-D"):
        augment_labels(l1[None], l2)
    with pytest.raises(TypeError, match="l2 must have an integer dtype"):
        augment_labels(l1, l2.float())


@pytest.mark.parametrize("which", ["l1", "l2"])
def test_augment_labels_refuses_a_meta_tensor(which):
    # A meta tensor has no values to read: the error names the argument (it failed inside
    # torch's item() before).
    labels = {"l1": torch.tensor([0, 1]), "l2": torch.tensor([1, 0, 0])}
    labels[which] = torch.zeros(3, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=f"{which} is a meta tensor"):
        augment_labels(labels["l1"], labels["l2"])
