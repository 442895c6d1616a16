"""Spawning gloo ranks on the CPU for the flashsinkhorn.distributed tests.

One job per world size runs every check of a test module on every rank and sends back a table
of plain results (numbers and strings). A rank that waits in a collective longer than
``TIMEOUT_S`` fails its check (gloo's timeout), and the parent gives up on a job after
``JOB_TIMEOUT_S``, so a hang fails the tests instead of stalling the suite.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashsinkhorn import distributed as fsd

TIMEOUT_S = 60
JOB_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard(t, sizes, rank):
    """Rank ``rank``'s contiguous rows of ``t`` (None stays None)."""
    if t is None:
        return None
    start = sum(sizes[:rank])
    return t[start : start + sizes[rank]]


def expect_error(fn) -> str:
    """``"Type: message"`` of the error ``fn`` raises, or ``"no error"``."""
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _torchrun_env(rank: int, world: int, per_node: int, port: int) -> dict:
    """torchrun's variables for ``rank`` of ``world`` ranks in nodes of ``per_node``."""
    node, local = divmod(rank, per_node)
    return dict(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
        LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(node), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip


def _worker(rank, world, port, out, checks_fn, env, backend, per_node):
    os.environ.update(env)
    torch.set_num_threads(1)
    results = {}
    try:
        timeout = timedelta(seconds=TIMEOUT_S)
        if per_node is not None:
            # as a torchrun launch would start it: the group comes from the variables alone
            os.environ.update(_torchrun_env(rank, world, per_node, port))
            fsd.init_process_group(backend, timeout=timeout)
        else:
            kw = {}
            if backend == "nccl":
                torch.cuda.set_device(rank)
                kw["device_id"] = torch.device("cuda", rank)
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                timeout=timeout, **kw,
            )  # fmt: skip
        for name, spec in checks_fn(world).items():
            spec = dict(spec)
            fn = spec.pop("fn")
            try:
                results[name] = fn(rank, world, **spec)
            except Exception:  # reported to the test, which fails with the traceback
                results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results["__setup__"] = {"exception": traceback.format_exc()}
    out.put((rank, results))


def run_job(
    world: int,
    checks_fn,
    env: dict | None = None,
    backend: str = "gloo",
    per_node: int | None = None,
) -> list[dict]:
    """Runs ``checks_fn(world)`` (name -> dict(fn=callable(rank, world, **kw), **kw)) on
    ``world`` spawned ranks (gloo on the CPU, or NCCL with GPU r for rank r); returns each
    rank's results. With ``per_node``, the ranks are numbered node by node in nodes of that
    many, get torchrun's variables and start with ``fsd.init_process_group``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(r, world, port, out, checks_fn, env or {}, backend, per_node)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world):
            rank, res = out.get(timeout=JOB_TIMEOUT_S)
            got[rank] = res
    except queue_mod.Empty:
        got = {r: {"__setup__": {"exception": "rank did not finish (hang)"}} for r in range(world)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return [got.get(r, {"__setup__": {"exception": "no result"}}) for r in range(world)]


def entries(job, name) -> list[dict]:
    """Every rank's result of check ``name``, failing on exceptions."""
    world, per_rank = job
    rows = []
    for rank, res in enumerate(per_rank):
        assert "__setup__" not in res, res["__setup__"]
        assert name in res, f"check {name} missing on rank {rank}"
        r = res[name]
        assert "exception" not in r, f"rank {rank}:\n{r['exception']}"
        rows.append(r)
    return rows


def assert_each_below(job, name, tol: float) -> None:
    """Every value of check ``name`` on every rank is below ``tol`` (the failing key named)."""
    for r in entries(job, name):
        for k, v in r.items():
            assert v < tol, (k, r)
