"""Cached CUDA graphs of fixed-iteration solves (solvers/graphs.py).

The key must change with every tensor address and every option the launches depend on; on the
GPU a replay must give bitwise the eager result on new data at the same addresses, and solves
with a tolerance, a warm start or the dense path must never be graphed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends.torch_ref import TorchBackend
from flashsinkhorn.backends.triton import TritonBackend
from flashsinkhorn.options import SinkhornOptions
from flashsinkhorn.problem import prepare
from flashsinkhorn.solvers import graphs
from flashsinkhorn.solvers.loop import solve
from flashsinkhorn.tuning import TUNING

from .conftest import HAS_CUDA


def _problem(device, seed=0, B=3, n=37, m=29, d=3, precision="tf32"):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, n, d, generator=g).to(device)
    y = torch.rand(B, m, d, generator=g).to(device)
    return prepare(x, y, None, None, rho_x=None, rho_y=None, precision=precision)


def test_key_follows_every_tensor_address_and_option():
    p = _problem("cpu")
    base = graphs._side_key(p.X)
    # a copy of the same values at another address is another key
    moved = dataclasses.replace(p.X, x=p.X.x.clone())
    assert graphs._side_key(moved) != base
    for field, value in (("rho", 1.0), ("kscale", 2.0 * p.X.kscale), ("has_null", True)):
        assert graphs._side_key(dataclasses.replace(p.X, **{field: value})) != base
    assert graphs._side_key(dataclasses.replace(p.X)) == base


def test_no_key_on_cpu_or_for_a_stateful_backend():
    p = _problem("cpu")
    assert graphs.solve_key(p, TritonBackend(), [0.1], 5, "symmetric") is None
    assert graphs.solve_key(p, TorchBackend(), [0.1], 5, "symmetric") is None
    assert not TorchBackend.capabilities.graph_safe


@pytest.mark.gpu
def test_run_captures_on_second_sight_and_replays_on_current_data():
    graphs.clear()
    a = torch.randn(1000, device="cuda")
    dev = a.device

    def work():
        return a * 2.0, a + 1.0

    key = ("unit-test", 1)
    f1, _ = graphs.run(key, work, dev)  # eager
    assert graphs.stats() == {"captured": 0, "failed": 0, "replayed": 0}
    f2, g2 = graphs.run(key, work, dev)  # captured, then replayed
    assert graphs.stats() == {"captured": 1, "failed": 0, "replayed": 1}
    old = a.clone()
    a.copy_(torch.randn(1000, device="cuda"))
    f3, g3 = graphs.run(key, work, dev)  # replayed on the new values of a
    assert graphs.stats()["replayed"] == 2
    assert torch.equal(f1, old * 2.0) and torch.equal(f2, old * 2.0) and torch.equal(g2, old + 1)
    assert torch.equal(f3, a * 2.0) and torch.equal(g3, a + 1.0)
    # the caller owns what it got: a replay does not overwrite earlier outputs
    assert f2.data_ptr() != f3.data_ptr()

    def sync_inside():
        return a * float(a.sum()), a  # a host synchronisation cannot be captured

    key2 = ("unit-test", 2)
    for _ in range(3):
        f, _ = graphs.run(key2, sync_inside, dev)
        assert torch.equal(f, a * float(a.sum()))
    assert graphs.stats()["failed"] == 1


def _results(calls, kw):
    # Only host copies are kept: the device tensors of one call are freed before the next, as
    # in a training loop, so the caching allocator hands out the same addresses again.
    out = []
    for x, y in calls:
        res = fs.sinkhorn(x, y, **kw)
        out.append((res.f.cpu(), res.g.cpu(), res.value.cpu(), res.n_iters, res.converged))
        del res
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["symmetric", "alternating"])
def test_replay_equals_eager_on_new_data(monkeypatch, schedule):
    graphs.clear()
    kw = dict(eps=0.1, n_iters=7, tol=None, schedule=schedule, precision="tf32")
    gen = torch.Generator(device="cuda").manual_seed(0)
    clouds = [
        (torch.rand(5, 300, 3, device="cuda", generator=gen),
         torch.rand(5, 211, 3, device="cuda", generator=gen))
        for _ in range(6)
    ]  # fmt: skip
    monkeypatch.setattr(TUNING, "solve_graphs", False)
    eager = _results(clouds, kw)
    monkeypatch.setattr(TUNING, "solve_graphs", True)
    got = _results(clouds, kw)
    st = graphs.stats()
    # the caching allocator reuses the addresses of prepare's tensors from call to call
    assert st["captured"] >= 1 and st["replayed"] >= 2 and st["failed"] == 0
    for e, r in zip(eager, got, strict=True):
        for te, tr in zip(e[:3], r[:3], strict=True):
            assert torch.equal(te, tr)
        assert r[3] == e[3] == 7 and r[4] is False


@pytest.mark.gpu
def test_training_loop_losses_and_gradients_equal_eager(monkeypatch):
    graphs.clear()
    gen = torch.Generator(device="cuda").manual_seed(1)
    y = torch.rand(4, 257, 3, device="cuda", generator=gen)
    xs = [torch.rand(4, 300, 3, device="cuda", generator=gen) for _ in range(6)]

    def run():
        out = []
        for x0 in xs:
            x = x0.clone().requires_grad_(True)
            loss = fs.sinkhorn_divergence(x, y, eps=0.05, n_iters=10, tol=None).sum()
            (gx,) = torch.autograd.grad(loss, x)
            out.append((loss.detach().cpu(), gx.cpu()))
            del x, loss, gx
        return out

    monkeypatch.setattr(TUNING, "solve_graphs", False)
    eager = run()
    monkeypatch.setattr(TUNING, "solve_graphs", True)
    got = run()
    assert graphs.stats()["replayed"] >= 3
    for (le, ge), (lg, gg) in zip(eager, got, strict=True):
        assert torch.equal(le, lg) and torch.equal(ge, gg)


@pytest.mark.gpu
def test_not_graphed_with_tolerance_warm_start_or_dense_path():
    graphs.clear()
    p = _problem("cuda", precision="ieee")
    for _ in range(3):
        opts = SinkhornOptions(eps=0.1, n_iters=5, tol=1e-3, check_every=2,
                               schedule="symmetric", acceleration="none")  # fmt: skip
        solve(p, TritonBackend(), [0.1], opts)
        init = (torch.zeros_like(p.X.sq), torch.zeros_like(p.Y.sq))
        solve(p, TritonBackend(), [0.1], opts.replace(tol=None), init=init)
        fs.sinkhorn(torch.rand(2, 40, 300, device="cuda"), torch.rand(2, 30, 300, device="cuda"),
                    eps=0.5, n_iters=3, tol=None, path="dense")  # fmt: skip
    assert graphs.stats() == {"captured": 0, "failed": 0, "replayed": 0}


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU path")
def test_cpu_solves_never_touch_the_cache():
    graphs.clear()
    for _ in range(3):
        fs.sinkhorn(torch.rand(20, 3), torch.rand(17, 3), eps=0.1, n_iters=3, tol=None)
    assert graphs.stats() == {"captured": 0, "failed": 0, "replayed": 0}
    assert graphs.seen() == 0


def _labelled(V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(2, 17, 3, generator=g), torch.rand(2, 13, 3, generator=g)
    lx, ly = torch.randint(0, V, (17,), generator=g), torch.randint(0, V, (13,), generator=g)
    W = torch.rand(V, V, generator=g)
    return prepare(x, y, None, None, rho_x=None, rho_y=None, precision="ieee",
                   labels=(lx, ly, W))  # fmt: skip


def test_key_holds_the_staged_label_table_the_launches_read():
    from flashsinkhorn import tuning
    from flashsinkhorn.backends.triton import operands
    from flashsinkhorn.backends.triton.configs import ONCHIP_MAX_V

    p = _labelled(5)
    be = TritonBackend()
    staged = be.launch_tensors(p)
    # the kernels read the float16 parts of W from operands.py's cache, not W itself
    assert len(staged) == 2 and all(t.dtype == torch.float16 for t in staged)
    key = graphs.launch_key(p, be)
    assert graphs.tensor_key(staged[0]) in key[-1]
    assert graphs.launch_key(p, be) == key  # the same table: the same staged parts
    # another table at W's place (same shape) is staged anew: another key, no stale replay
    W2 = p.X.lcost.clone()
    moved = dataclasses.replace(p, X=dataclasses.replace(p.X, lcost=W2))
    assert graphs.launch_key(moved, be)[-1] != key[-1]
    # W changed in place: its version moves, the parts are staged again
    before = operands.staged_table(p.X.lcost)[0]
    p.X.lcost.mul_(2.0)
    assert operands.staged_table(p.X.lcost)[0] is not before
    assert graphs.launch_key(p, be)[-1] != key[-1]
    # tables read from global memory are problem fields already: nothing extra
    with tuning.override(global_labels=True):
        assert be.launch_tensors(p) == ()
    big = _labelled(ONCHIP_MAX_V + 1)
    assert be.launch_tensors(big) == ()
    # a backend that reads nothing but the problem
    assert TorchBackend().launch_tensors(p) == ()
    assert graphs.launch_key(p, TorchBackend())[-1] == ()


@pytest.mark.parametrize("eager_runs", [1, 2])
def test_a_key_is_captured_after_its_eager_runs(monkeypatch, eager_runs):
    # prepare's launches wait for a third call (a capture costs as much as a small solve's
    # host work); the solves capture on the second
    from flashsinkhorn import _cuda_graph
    from flashsinkhorn.backends.triton import prepare as tp

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    captures, runs = [], []
    monkeypatch.setattr(
        _cuda_graph, "capture", lambda fn, device: captures.append(1) or (Graph(), fn())
    )
    cache = _cuda_graph.GraphCache(4, eager_runs=eager_runs)
    out = torch.zeros(1)
    for call in range(eager_runs + 3):
        cache.run(("k",), lambda n=call: runs.append(n) or (out,), "cpu")
        assert len(captures) == (call >= eager_runs)
    assert runs == [*range(eager_runs), eager_runs]  # eager runs, then the capture's own
    assert Graph.replays == 3 and cache.stats()["replayed"] == 3
    assert tp._graphs("cpu").eager_runs == tp.PREPARE_EAGER_RUNS == 2
    assert graphs._cache("cpu").eager_runs == 1


def test_one_runtime_per_device_holds_every_graph_cache():
    from flashsinkhorn import _cuda_graph
    from flashsinkhorn.backends.triton import prepare as tp
    from flashsinkhorn.solvers import blocks

    cpu = _cuda_graph.runtime("cpu")
    assert _cuda_graph.runtime(torch.device("cpu")) is cpu
    assert _cuda_graph.runtime("meta") is not cpu
    solve_cache = graphs._cache("cpu")
    assert blocks.cache("cpu") is cpu.caches()["blocks"]
    assert tp._graphs("cpu") is cpu.caches()["prepare"]
    assert cpu.caches()["solve"] is solve_cache and graphs._cache("cpu") is solve_cache
    assert graphs._cache("meta") is not solve_cache
    # a key met once is remembered by its device's cache, and the runtime frees them all
    solve_cache.run(("k",), lambda: (torch.zeros(1),), torch.device("cpu"))
    blocks.cache("cpu").see(("b",))
    assert graphs.seen() >= 1 and blocks.cache("cpu").known(("b",))
    cpu.clear()
    assert solve_cache.seen() == 0 and not blocks.cache("cpu").known(("b",))


def test_staged_copy_keeps_every_field_and_alias():
    p = _problem("cpu", m=37)
    for prob in (p, dataclasses.replace(p, Y=p.X)):
        tensors = graphs._problem_tensors(prob)
        st = graphs._Staged(prob, tensors).problem
        assert (st.X is st.Y) == (prob.X is prob.Y)
        for s_side, p_side in ((st.X, prob.X), (st.Y, prob.Y)):
            for f in dataclasses.fields(p_side):
                a, b = getattr(s_side, f.name), getattr(p_side, f.name)
                if isinstance(b, torch.Tensor):
                    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)
                else:
                    assert a == b
        # a tensor two fields share (the y side's nominal mass is the x side's weights) is
        # one buffer in the copy too
        if prob.Y.mass_of is not None:
            assert (st.Y.mass_of is st.X.w) == (prob.Y.mass_of is prob.X.w)
        assert len(graphs._problem_tensors(st)) == len(tensors)


def test_staged_copy_moves_carved_tensors_as_one_span():
    # prepare's layout: the float32 outputs carved from one block (with padding between
    # them), the float16 ones from another, and a caller's tensor of its own
    from flashsinkhorn.backends.triton.prepare import _carve

    g = torch.Generator().manual_seed(3)
    specs = [((2, 5), torch.float32), ((2, 37, 3), torch.float32), ((2, 37), torch.float32),
             ((2, 37, 3), torch.float16), ((2, 29, 3), torch.float16)]  # fmt: skip
    carved = _carve("cpu", specs)
    for t in carved:
        t.copy_(torch.randn(t.shape, generator=g))
    alone = torch.randn(2, 29, generator=g)
    big = torch.randn(1000, generator=g)
    small_view = big[500:510]  # a view of a much larger storage: copied alone
    tensors = [*carved, alone, small_view]
    spans, place = graphs._spans(tensors)
    assert len(spans) == 4  # float32 block, float16 block, the two lone tensors
    assert [n for _, _, n in spans][2:] == [alone.numel(), small_view.numel()]
    views = graphs._span_views(tensors, spans)
    for t, (k, off) in zip(tensors, place, strict=True):
        got = views[k].as_strided(t.shape, t.stride(), views[k].storage_offset() + off)
        assert torch.equal(got, t) and got.data_ptr() == t.data_ptr()
    # a staged problem from carved tensors: fewer buffers than tensors, every value kept
    p = _problem("cpu")
    x_b, sq_b = _carve(
        "cpu", [(tuple(p.X.x.shape), p.X.x.dtype), (tuple(p.X.sq.shape), p.X.sq.dtype)]
    )
    x_b.copy_(p.X.x)
    sq_b.copy_(p.X.sq)
    prob = dataclasses.replace(p, X=dataclasses.replace(p.X, x=x_b, sq=sq_b))
    tensors = graphs._problem_tensors(prob)
    staged = graphs._Staged(prob, tensors)
    assert len(staged.buffers) == len(tensors) - 1
    assert torch.equal(staged.problem.X.x, prob.X.x) and torch.equal(staged.problem.X.sq, prob.X.sq)
    assert staged.problem.X.x.data_ptr() != prob.X.x.data_ptr()
    # the layout is part of the key: the same tensors carved apart are another layout
    apart = dataclasses.replace(p, X=dataclasses.replace(p.X, x=x_b.clone(), sq=sq_b.clone()))
    assert graphs._spans(graphs._problem_tensors(apart))[1] != graphs._spans(tensors)[1]


def test_no_staging_on_cpu():
    p = _problem("cpu")
    with graphs.staged(p, TritonBackend()) as q:
        assert q is p


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["alternating", "symmetric"])
def test_new_cloud_of_a_known_shape_replays_from_its_first_call(monkeypatch, schedule):
    from flashsinkhorn.solvers import blocks

    kw = dict(eps=0.05, tol=1e-4, schedule=schedule)
    gen = torch.Generator(device="cuda").manual_seed(1)
    # every cloud stays alive: the prepared tensors of each land at other addresses
    clouds = [
        (torch.rand(700, 5, device="cuda", generator=gen),
         torch.rand(650, 5, device="cuda", generator=gen))
        for _ in range(4)
    ]  # fmt: skip

    def replayed(x, y):
        # a cloud solved twice: the second solve replays every block of the first
        fs.sinkhorn(x, y, **kw)
        return fs.sinkhorn(x, y, **kw)

    graphs.clear()
    for _ in range(2):
        fs.sinkhorn(*clouds[0], **kw)  # the shape becomes known
    captured = blocks.stats()["captured"]
    got = []
    for x, y in clouds[1:]:
        before = blocks.stats()["replayed"]
        got.append(fs.sinkhorn(x, y, **kw))
        assert blocks.stats()["replayed"] > before  # from its first call
    assert blocks.stats()["captured"] == captured
    # the same launches as a second solve of each cloud on its own (bitwise), and the
    # caller's problem in the result
    for (x, y), res in zip(clouds[1:], got, strict=True):
        graphs.clear()
        ref = replayed(x, y)
        assert torch.equal(res.f, ref.f) and torch.equal(res.g, ref.g)
        assert torch.equal(res.value, ref.value) and res.n_iters == ref.n_iters
    # unstaged, a new cloud's solve runs eagerly, with the over-relaxation factor mixed as
    # in a graph (a tensor, after the kernel): bitwise the replayed result
    monkeypatch.setattr(graphs, "STAGE_MAX_BYTES", 0)
    graphs.clear()
    for (x, y), res in zip(clouds[1:], got, strict=True):
        plain = fs.sinkhorn(x, y, **kw)
        assert torch.equal(res.f, plain.f) and torch.equal(res.g, plain.g)
        assert torch.equal(res.value, plain.value) and res.n_iters == plain.n_iters
