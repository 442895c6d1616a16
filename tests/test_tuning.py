"""The switches in force live in a context variable: an override is scoped to its block and
its thread (and the backward passes that thread runs), never a mutated process global."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

from flashsinkhorn import tuning
from flashsinkhorn.tuning import TUNING


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_override_is_scoped_to_its_block_and_restored_on_error():
    assert TUNING.plan_step is True
    with tuning.override(plan_step=False, softmin_split=3):
        assert TUNING.plan_step is False and TUNING.softmin_split == 3
        with tuning.override(plan_step=True):
            assert TUNING.plan_step is True and TUNING.softmin_split == 3
        assert TUNING.plan_step is False
    assert TUNING.plan_step is True and TUNING.softmin_split is None
    with pytest.raises(RuntimeError, match="inside"):
        with tuning.override(plan_step=False):
            raise RuntimeError("inside")
    assert TUNING.plan_step is True


def test_an_override_does_not_reach_another_thread():
    seen = {}
    inside, release = threading.Event(), threading.Event()

    def other():
        inside.wait()
        seen["other"] = TUNING.plan_step
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with tuning.override(plan_step=False):
        inside.set()
        release.wait()
        seen["here"] = TUNING.plan_step
    t.join()
    assert seen == {"other": True, "here": False}


def test_a_thread_keeps_its_own_override():
    def run():
        with tuning.override(global_labels=True):
            return TUNING.global_labels

    assert _in_thread(run) is True
    assert TUNING.global_labels is False


def test_an_autograd_worker_thread_reads_the_launching_context():
    # PyTorch keeps the context that called backward in the thread state of its device
    # threads; a worker thread without switches of its own reads them from there.
    stash = getattr(torch._C, "_stash_obj_in_tls", None)
    if stash is None:
        pytest.skip("this torch keeps no launching context")
    with tuning.override(fp16_grad=False):
        launching = contextvars.copy_context()

    # torch 2.6 has no _remove_obj_from_tls: there the entry ends with the worker thread
    remove = getattr(torch._C, "_remove_obj_from_tls", lambda key: None)

    def worker():
        torch._C._stash_obj_in_tls("context", launching)
        try:
            return TUNING.fp16_grad
        finally:
            remove("context")

    assert _in_thread(worker) is False
    assert _in_thread(lambda: TUNING.fp16_grad) is True


def test_a_read_without_switches_looks_up_no_launching_context(monkeypatch):
    # once switches were set somewhere in the process, a read in a context without any still
    # costs one context-variable look-up (and, while some context holds switches, one C call:
    # is a launching context kept here?), not the look-up of the launching context
    with tuning.override(plan_step=False):
        assert TUNING.plan_step is False

    def looked_up():
        raise AssertionError("the launching context was looked up")

    monkeypatch.setattr(tuning, "_launching_context", looked_up)
    got = _in_thread(lambda: (TUNING.plan_step, TUNING.mhc_small_bwd, tuning.current()))
    assert got == (True, tuning.Tuning.mhc_small_bwd, tuning._DEFAULTS)
    assert got[2] is tuning._DEFAULTS


def test_switches_count_as_held_while_a_context_holds_them():
    # the launching-context look-up is skipped only while no context holds switches: one
    # copied inside an override (an asyncio task, a backward's launching context) holds them
    # after the block
    def run():
        with tuning.override(plan_step=False):
            key = id(tuning.current())
            assert key in tuning._LIVE
            held = contextvars.copy_context()
        assert key in tuning._LIVE and held.run(lambda: TUNING.plan_step) is False
        del held
        assert key not in tuning._LIVE

    contextvars.Context().run(run)


def test_attribute_writes_are_checked_and_scoped_to_the_context():
    with pytest.raises(AttributeError, match="unknown tuning switch"):
        TUNING.no_such_switch = 1
    with pytest.raises(TypeError):
        TUNING.plan_step = "yes"

    def run():
        TUNING.softmin_split = 2
        return TUNING.softmin_split

    assert _in_thread(run) == 2
    assert TUNING.softmin_split is None
    with pytest.raises(ValueError, match="unknown tuning switch"):
        with tuning.override(no_such_switch=1):
            pass


def _torch_hands_over_the_context() -> bool:
    """Whether this torch keeps the context that called ``backward`` in the thread state its
    device threads read (a CPU backward runs on the calling thread, with the same stash)."""
    found = []

    class Look(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            try:
                found.append(bool(torch._C._is_key_in_tls("context")))
            except (AttributeError, RuntimeError):
                found.append(False)
            return g

    Look.apply(torch.ones(1, requires_grad=True)).sum().backward()
    return found == [True]


def _probe(library: bool):
    """``(Probe, seen)``: an autograd function whose backward records ``TUNING.fp16_grad`` in
    ``seen``; ``library``: written as the library's are (``tuning.keep_for_backward`` in the
    forward, ``backward_autocast_off`` around the backward)."""
    from flashsinkhorn._boundary import backward_autocast_off

    seen = []

    def backward(ctx, g):
        seen.append(TUNING.fp16_grad)
        return g * 2.0

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            if library:
                tuning.keep_for_backward(ctx)
            return x * 2.0

    Probe.backward = staticmethod(backward_autocast_off(backward) if library else backward)
    return Probe, seen


def _override_around_a_cuda_backward(library: bool) -> list:
    Probe, seen = _probe(library)
    x = torch.ones(4, device="cuda", requires_grad=True)
    with tuning.override(fp16_grad=False):
        Probe.apply(x).sum().backward()
    Probe.apply(x).sum().backward()
    return seen


@pytest.mark.gpu
def test_an_override_around_a_cuda_backward_reaches_the_library_functions():
    # the library's functions keep the forward's switches for a torch that hands its device
    # threads no context (tuning.keep_for_backward, read by backward_autocast_off)
    assert _override_around_a_cuda_backward(library=True) == [False, True]


@pytest.mark.gpu
def test_an_override_around_a_cuda_backward_reaches_its_function():
    if not _torch_hands_over_the_context():
        pytest.skip(f"torch {torch.__version__} hands its device threads no launching context")
    assert _override_around_a_cuda_backward(library=False) == [False, True]


def test_a_backward_without_a_launching_context_runs_with_the_forward_switches():
    Probe, seen = _probe(library=True)
    with tuning.override(fp16_grad=False):
        y = Probe.apply(torch.ones(3, requires_grad=True)).sum()
    # a thread of its own, with no switches (and a launching context without any): the
    # forward's hold
    _in_thread(y.backward)
    assert seen == [False]
    assert TUNING.fp16_grad is True
