"""The losses inside torch.compile'd training steps: values and gradients equal to eager.

Every entry point is a graph break (``_boundary.entry_point``): the code around the call is
compiled, the solve and its backward run eagerly. The CPU tests compile with backend
"inductor" (it generates and builds C++ kernels on this machine; about 6 s for the first
function of a process on 2 cores, far less once its on-disk cache is warm), in float64 so
that "equal" means equal to round-off. The GPU test does the same on CUDA in float32.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import flashsinkhorn as fs

F64 = torch.float64

LOSSES = {
    "ot_cost": lambda z, y: fs.ot_cost(z, y, eps=0.1),
    "sinkhorn_divergence": lambda z, y: fs.sinkhorn_divergence(z, y, eps=0.1, rho_x=2.0, rho_y=2.0),
    "SinkhornDivergence": fs.SinkhornDivergence(eps=0.1, scaling=0.7),
    "SamplesLoss": fs.SamplesLoss(blur=0.3, scaling=0.7),
    # solve() of the squared distances, differentiable through C to z
    "solve": lambda z, y: fs.solve(((z[:, None] - y[None]) ** 2).sum(-1), eps=0.1).value,
}


def data(device="cpu", dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(23, 3, generator=g, dtype=dtype)
    y = torch.randn(31, 3, generator=g, dtype=dtype) + 0.3
    W = torch.randn(3, 3, generator=g, dtype=dtype)
    return x.to(device), y.to(device), W.to(device)


def make_step(loss_fn):
    def step(W, x, y):
        z = torch.tanh(x @ W)  # compiled before the graph break
        return 2.0 * loss_fn(z, y) + (W**2).sum()  # and after it

    return step


def loss_and_grad(step, W, x, y):
    W = W.clone().requires_grad_()
    loss = step(W, x, y)
    loss.backward()
    return loss.detach(), W.grad


@pytest.mark.parametrize("name", list(LOSSES))
def test_compiled_step_equals_eager_on_cpu(name):
    torch._dynamo.reset()
    x, y, W = data()
    step = make_step(LOSSES[name])
    compiled = torch.compile(step, backend="inductor")
    ref_loss, ref_grad = loss_and_grad(step, W, x, y)
    for _ in range(2):  # the second call runs the cached graphs
        loss, grad = loss_and_grad(compiled, W, x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    assert ref_grad.abs().max() > 0.1  # the loss moves W


def train(step, W, x, y, lr, n):
    """n SGD steps; ``step`` returns the loss after its own backward."""
    W = W.clone().requires_grad_()
    opt = torch.optim.SGD([W], lr=lr)
    losses = []
    for _ in range(n):
        opt.zero_grad()
        losses.append(step(W, x, y))
        opt.step()
    return torch.stack(losses), W.detach()


# torch 2.6's dynamo stops on this step with "SpeculationLog diverged"
@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7),
    reason="torch < 2.7: dynamo cannot trace a backward inside the compiled step",
)
def test_compiled_training_step_with_backward_inside():
    torch._dynamo.reset()
    x, y, W = data(seed=1)
    inner = make_step(LOSSES["sinkhorn_divergence"])

    def step(W, x, y):
        loss = inner(W, x, y)
        loss.backward()  # inside the compiled function: a graph break, run eagerly
        return loss.detach()

    got, W_got = train(torch.compile(step, backend="inductor"), W, x, y, 0.05, 3)
    ref, W_ref = train(step, W, x, y, 0.05, 3)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(W_got, W_ref, rtol=1e-12, atol=1e-14)
    assert got[-1] < got[0]


def test_sinkhorn_result_inside_compiled_function():
    torch._dynamo.reset()
    x, y, _ = data(seed=2)

    def fn(x, y):
        res = fs.sinkhorn(x * 1.5, y, eps=0.2)
        return res.value + 1.0, res.f, res.barycentric_map(), res.apply(y), res.marginal_error

    compiled = torch.compile(fn, backend="inductor")
    for got, ref in zip(compiled(x, y), fn(x, y), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.skipif(
    "reason" not in inspect.signature(torch.compiler.disable).parameters,
    reason="torch.compiler.disable has no reason= in this torch: the graph break has no name",
)
def test_fullgraph_names_the_graph_break():
    torch._dynamo.reset()
    x, y, W = data()
    compiled = torch.compile(make_step(LOSSES["ot_cost"]), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="flashsinkhorn solves run eagerly"):
        compiled(W, x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LOSSES))
def test_compiled_step_equals_eager_on_cuda(name):
    torch._dynamo.reset()
    x, y, W = data("cuda", torch.float32)
    step = make_step(LOSSES[name])
    compiled = torch.compile(step, backend="inductor")
    ref_loss, ref_grad = loss_and_grad(step, W, x, y)
    for _ in range(2):
        loss, grad = loss_and_grad(compiled, W, x, y)
        # inductor's Triton kernels and cuBLAS round tanh(x @ W) differently (fp32)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-3, atol=1e-4)
