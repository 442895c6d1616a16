"""Process placement under torchrun, on one node or several.

torchrun (``--nnodes N --nproc-per-node P``) starts P processes per node and tells each its
global ``RANK`` (0 .. N·P − 1, node by node), ``WORLD_SIZE``, its ``LOCAL_RANK`` on its node
(0 .. P − 1), ``LOCAL_WORLD_SIZE`` (P) and ``GROUP_RANK`` (the node's index). The device of
a process is chosen by its *local* rank (GPU ``LOCAL_RANK`` of its node), while the process
group and the shards are indexed by the *global* rank. :func:`init_process_group` does both;
:func:`node_group` gives the ranks of one node as a group of their own (node-local solves).

The ring mode passes shards from rank r to rank r + 1: with torchrun's node-by-node ranks,
one pass crosses each node boundary once, the other hops stay on the node's NVLink.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Placement:
    """Where this process sits.

    Attributes:
        rank: global rank (``RANK``), the index of this process's shards.
        world_size: number of processes (``WORLD_SIZE``).
        local_rank: rank on its node (``LOCAL_RANK``), which picks its GPU.
        local_world_size: processes per node (``LOCAL_WORLD_SIZE``).
        node: index of its node (``GROUP_RANK``, else rank // local_world_size).
        n_nodes: number of nodes.
        device: the device this process computes on (``cuda:local_rank``, or the CPU).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    n_nodes: int
    device: torch.device


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise ValueError(
                f"the environment variable {name} is not set: launch with torchrun (which sets "
                "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and "
                "MASTER_PORT) or set it"
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"the environment variable {name} must be an integer, got {raw!r}"
        ) from None
    if value < 0:
        raise ValueError(f"the environment variable {name} must be >= 0, got {value}")
    return value


def placement_from_env(
    env: Mapping[str, str] | None = None, device: str | None = None
) -> Placement:
    """This process's :class:`Placement` from torchrun's environment variables.

    Args:
        env: the variables (default: ``os.environ``). LOCAL_RANK and LOCAL_WORLD_SIZE default
            to RANK and WORLD_SIZE (one node), GROUP_RANK to rank // local_world_size.
        device: "cuda", "cpu" or None (CUDA when available).

    Raises:
        ValueError: a variable missing, not an integer, or inconsistent with the others
            (naming it).
    """
    env = os.environ if env is None else env
    rank = _env_int(env, "RANK")
    world = _env_int(env, "WORLD_SIZE")
    local = _env_int(env, "LOCAL_RANK", rank)
    per_node = _env_int(env, "LOCAL_WORLD_SIZE", world)
    if world < 1 or rank >= world:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE = {world}), got {rank}")
    if per_node < 1 or world % per_node:
        raise ValueError(
            f"LOCAL_WORLD_SIZE must divide WORLD_SIZE (the same number of processes on every "
            f"node), got {per_node} and {world}"
        )
    if local >= per_node:
        raise ValueError(f"LOCAL_RANK must be in [0, LOCAL_WORLD_SIZE = {per_node}), got {local}")
    node = _env_int(env, "GROUP_RANK", rank // per_node)
    if node * per_node + local != rank:
        raise ValueError(
            f"RANK={rank} is not GROUP_RANK·LOCAL_WORLD_SIZE + LOCAL_RANK = {node}·{per_node} + "
            f"{local}: flashsinkhorn.distributed expects torchrun's node-by-node ranks"
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cpu' or None, got {device!r}")
    dev = torch.device("cpu")
    if device == "cuda":
        count = torch.cuda.device_count()
        if local >= count:
            raise ValueError(
                f"LOCAL_RANK={local} needs GPU {local} of this node, but {count} CUDA device(s) "
                "are visible: start at most as many processes per node as GPUs "
                "(--nproc-per-node)"
            )
        dev = torch.device("cuda", local)
    return Placement(rank, world, local, per_node, node, world // per_node, dev)


def init_process_group(
    backend: str | None = None, *, timeout: timedelta | None = None
) -> Placement:
    """Initialises the default process group from torchrun's environment.

    Selects this process's GPU by its local rank (``torch.cuda.set_device(LOCAL_RANK)``) for
    NCCL, then initialises ``torch.distributed`` with the global rank and world size
    (rendezvous at MASTER_ADDR:MASTER_PORT). Works alike on one node and on several.

    Args:
        backend: "nccl", "gloo" or None (NCCL when CUDA is available, else gloo).
        timeout: the process group's collective timeout (None: torch's default).

    Returns:
        This process's :class:`Placement`.

    Raises:
        ValueError: the environment does not describe a torchrun launch (naming the
            variable), or the backend is neither "nccl" nor "gloo".
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    place = placement_from_env(device="cuda" if backend == "nccl" else "cpu")
    kw = {} if timeout is None else {"timeout": timeout}
    if backend == "nccl":
        torch.cuda.set_device(place.device)
        kw["device_id"] = place.device
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method="env://", rank=place.rank, world_size=place.world_size, **kw
        )
    return place


def node_group(place: Placement):
    """The process group of this process's node (its ``local_world_size`` ranks).

    A collective: every rank of the default group calls it (``torch.distributed.new_group``
    is called for every node, in node order, as it requires).
    """
    mine = None
    for node in range(place.n_nodes):
        ranks = list(range(node * place.local_world_size, (node + 1) * place.local_world_size))
        group = dist.new_group(ranks)
        if node == place.node:
            mine = group
    return mine
