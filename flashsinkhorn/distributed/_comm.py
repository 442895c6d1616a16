"""The few torch.distributed patterns the sharded solver needs.

Everything goes through ``torch.distributed`` collectives and point-to-point operations of the
caller's process group (NCCL for CUDA tensors, gloo for CPU tensors); there is no
communication layer of our own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ._timing import section

NO_GROUP_MESSAGE = (
    "flashsinkhorn.distributed needs an initialised torch.distributed process group: call "
    "torch.distributed.init_process_group (backend 'nccl' with one GPU per rank, or 'gloo' on "
    "CPUs) in every process, e.g. under torchrun, before solving"
)


def require_group(group) -> None:
    """Raises a RuntimeError when torch.distributed is unusable or not initialised."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    if not dist.is_initialized():
        raise RuntimeError(NO_GROUP_MESSAGE)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or None, got {type(group)}"
        )


def comm_device(group, like: object) -> torch.device:
    """Device the collectives of ``group`` take their tensors on.

    NCCL groups need CUDA tensors on the current device, gloo groups CPU tensors; a group with
    several backends follows the points.
    """
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" or not isinstance(like, torch.Tensor):
        return torch.device("cpu")
    return like.device


class Comm:
    """Rank bookkeeping and the collectives of one process group.

    Attributes:
        group: the process group (None is the default group).
        rank: this process's rank in the group.
        world: number of ranks in the group.
        device: device of the communication buffers.
    """

    def __init__(self, group, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        self.next_peer = self.global_rank((self.rank + 1) % self.world)
        self.prev_peer = self.global_rank((self.rank - 1) % self.world)
        # Receive buffers of the ring, per buffer layout (RingBuffers)
        self._pools: dict = {}

    def global_rank(self, group_rank: int) -> int:
        """The default group's rank of this group's rank ``group_rank`` (point-to-point
        operations and broadcasts name peers by their global rank)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduces ``t`` in place over the group and returns it."""
        if self.world > 1:
            with section("comm", t.device):
                dist.all_reduce(t, op=op, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Gathers equally shaped tensors, one per rank, in rank order."""
        if self.world == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.world)]
        with section("comm", t.device):
            dist.all_gather(out, t.contiguous(), group=self.group)
        return out

    def gather_dim1(self, parts: Sequence[torch.Tensor], sizes: Sequence[Sequence[int]]):
        """All-gathers uneven shards along dimension 1, several tensors in one collective.

        Args:
            parts: local tensors (B, n_local, ...) of one dtype; ``parts[i]`` is shard
                ``rank`` of global tensor i.
            sizes: ``sizes[i][r]`` is the length of shard r of tensor i.

        Returns:
            The global tensors (B, sum(sizes[i]), ...), shards concatenated in rank order.
        """
        if self.world == 1:
            return [p.contiguous() for p in parts]
        padded = []
        for p, sz in zip(parts, sizes, strict=True):
            pad = max(sz) - p.shape[1]
            if pad:
                shape = (p.shape[0], pad, *p.shape[2:])
                p = torch.cat([p, p.new_zeros(shape)], dim=1)
            padded.append(p.reshape(p.shape[0], -1))
        flat = torch.cat(padded, dim=1) if len(padded) > 1 else padded[0]
        chunks = self.all_gather(flat)
        out = []
        start = 0
        for p, sz in zip(parts, sizes, strict=True):
            row = math.prod(p.shape[2:])
            width = max(sz) * row
            pieces = [
                c[:, start : start + width].reshape(p.shape[0], max(sz), *p.shape[2:])[:, : sz[r]]
                for r, c in enumerate(chunks)
            ]
            out.append(torch.cat(pieces, dim=1).contiguous())
            start += width
        return out

    def ring(
        self,
        local: list[torch.Tensor],
        shapes: Callable[[int], list[tuple[tuple[int, ...], torch.dtype]]],
        visit: Callable[[int, list[torch.Tensor]], torch.Tensor | None],
        carry: Callable[[int], tuple[tuple[int, ...], torch.dtype]] | None = None,
    ) -> torch.Tensor | None:
        """Passes every rank's buffers once around the ring, overlapping transfer and compute.

        At step s this rank holds the buffers of rank ``(rank - s) mod world``: it posts their
        non-blocking send to the next rank and the receive of the following shard from the
        previous rank (one ``batch_isend_irecv``), calls ``visit(owner, buffers)`` meanwhile,
        then waits for the transfer. The receives land in two slots of flat buffers sized for
        the largest shard, allocated once per layout and reused by every later pass: the slot
        being visited (and sent) is never the one being received into.

        With ``carry``, an accumulator travels with each rank's buffers, one step behind
        them: ``visit`` returns this rank's contribution to the owner's accumulator (a
        tensor of shape and dtype ``carry(owner)``), the contribution of the previous rank
        arrives while it computes, and their sum goes on to the next rank in the following
        step's batch. After the last step one more exchange hands each accumulator, now the
        sum of every rank's contribution, back to its owner.

        Args:
            local: this rank's buffers (contiguous).
            shapes: ``shapes(r)`` gives the (shape, dtype) of each buffer of rank r.
            visit: called once per rank's buffers, this rank's own first; it must not keep
                references to them (the slots are overwritten by the next passes).
            carry: ``carry(r)``: (shape, dtype) of rank r's accumulator, or None for none.

        Returns:
            This rank's accumulator (the sum over ranks), or None without ``carry``.
        """
        if self.world == 1:
            part = visit(self.rank, local)
            return part if carry is not None else None
        layouts = [shapes(r) for r in range(self.world)]
        pool = self._pool(layouts)
        owner, cur = self.rank, local
        acc = None  # the accumulator of the shard visited last, to pass on
        for step in range(self.world):
            ops = []
            if step < self.world - 1:
                src = (owner - 1) % self.world
                slot = pool[step % 2]
                nxt = [
                    buf[: math.prod(s)].view(s)
                    for buf, (s, _) in zip(slot, layouts[src], strict=True)
                ]
                ops += [dist.P2POp(dist.isend, t, self.next_peer, self.group) for t in cur]
                ops += [dist.P2POp(dist.irecv, t, self.prev_peer, self.group) for t in nxt]
            got = None
            if carry is not None and step > 0:
                # the previous rank's sum for the shard in hand; ours goes on to the next
                shape, dtype = carry(owner)
                got = torch.empty(shape, dtype=dtype, device=self.device)
                ops += [dist.P2POp(dist.isend, acc, self.next_peer, self.group)]
                ops += [dist.P2POp(dist.irecv, got, self.prev_peer, self.group)]
            reqs = dist.batch_isend_irecv(ops) if ops else []
            part = visit(owner, cur)
            with section("comm", self.device):
                for r in reqs:
                    r.wait()
            if carry is not None:
                acc = part.contiguous() if got is None else part + got
            if step < self.world - 1:
                owner, cur = src, nxt
        if carry is None:
            return None
        # acc is the whole sum of the next rank's accumulator: hand it over, take ours
        shape, dtype = carry(self.rank)
        own = torch.empty(shape, dtype=dtype, device=self.device)
        ops = [dist.P2POp(dist.isend, acc, self.next_peer, self.group)]
        ops += [dist.P2POp(dist.irecv, own, self.prev_peer, self.group)]
        with section("comm", self.device):
            for r in dist.batch_isend_irecv(ops):
                r.wait()
        return own

    def _pool(self, layouts) -> list[list[torch.Tensor]]:
        """Two slots of flat receive buffers for these per-rank layouts (cached)."""
        key = tuple(tuple((tuple(s), dt) for s, dt in lay) for lay in layouts)
        pool = self._pools.get(key)
        if pool is None:
            sizes = [max(math.prod(lay[i][0]) for lay in layouts) for i in range(len(layouts[0]))]
            dtypes = [dt for _, dt in layouts[0]]
            pool = [
                [
                    torch.empty(n, dtype=dt, device=self.device)
                    for n, dt in zip(sizes, dtypes, strict=True)
                ]
                for _ in range(2)
            ]
            self._pools[key] = pool
        return pool
