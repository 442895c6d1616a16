"""Several nodes under torchrun's conventions, as 2 "nodes" × 2 gloo ranks on one CPU machine.

Each process gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT) and starts with ``fsd.init_process_group()``. Then one
problem is solved over all four ranks, one per node over each node's group (concurrently),
and one over the cross-node group of the ranks with the same local rank: each equals the
single-process solve (float64, 1e-9), whatever the ranks' global numbering.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import flashsinkhorn as fs
from flashsinkhorn import distributed as fsd

from .dist_harness import entries, run_job, shard

NODES, PER_NODE = 2, 2
TOL = 1e-9


def _problem(seed, n, m):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = 0.7 * torch.randn(m, 3, generator=gen, dtype=torch.float64) + 0.3
    return x, y


def _compare(group, group_rank, seed, sizes_x, sizes_y, mode):
    x, y = _problem(seed, sum(sizes_x), sum(sizes_y))
    kw = dict(eps=0.3, tol=None, n_iters=8)
    ref = fs.sinkhorn(x, y, backend="torch", **kw)
    res = fsd.sinkhorn(
        shard(x, sizes_x, group_rank), shard(y, sizes_y, group_rank), group=group, mode=mode,
        **kw,
    )  # fmt: skip
    return max(
        float((res.f - shard(ref.f, sizes_x, group_rank)).abs().max()),
        float((res.g - shard(ref.g, sizes_y, group_rank)).abs().max()),
        abs(float(res.value) - float(ref.value)),
    )


def _placement(rank, world):
    # The harness started the group the same way; called again, it returns the placement.
    place = fsd.init_process_group("gloo")
    row = (
        place.rank, place.world_size, place.local_rank, place.local_world_size, place.node,
        place.n_nodes, str(place.device), dist.get_backend(),
    )  # fmt: skip
    return {"placement": row}


def _groups(rank, world):
    place = fsd.placement_from_env(device="cpu")
    res = {}
    mine = fsd.node_group(place)
    # cross-node groups: the ranks with the same local rank, one per node
    cross = None
    for k in range(PER_NODE):
        g = dist.new_group([k + PER_NODE * j for j in range(NODES)])
        if k == place.local_rank:
            cross = g
    for mode in ("gather", "ring"):
        res[f"world_{mode}"] = _compare(None, rank, 1, [4, 1, 6, 3], [2, 5, 3, 4], mode)
        # each node solves its own problem at the same time
        res[f"node_{mode}"] = _compare(mine, place.local_rank, 10 + place.node, [3, 6],
                                       [5, 2], mode)  # fmt: skip
        res[f"cross_{mode}"] = _compare(cross, place.node, 20 + place.local_rank, [7, 2],
                                        [3, 4], mode)  # fmt: skip
    return res


def _divergence(rank, world):
    res = {}
    res["divergence_ring"] = float(
        fsd.sinkhorn_divergence(
            *_problem(2, 8, 8)[0].split(2)[rank : rank + 1],
            *_problem(2, 8, 8)[1].split(2)[rank : rank + 1],
            eps=0.5,
            mode="ring",
            tol=None,
            n_iters=5,
        )  # fmt: skip
    )
    x, y = _problem(2, 8, 8)
    res["divergence_ref"] = float(fs.sinkhorn_divergence(x, y, eps=0.5, tol=None, n_iters=5))
    return res


def _checks(world):
    return {
        "placement": dict(fn=_placement),
        "groups": dict(fn=_groups),
        "divergence": dict(fn=_divergence),
    }


@pytest.fixture(scope="module")
def job():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = NODES * PER_NODE
    return world, run_job(world, _checks, per_node=PER_NODE)


def test_placement_follows_torchrun_variables(job):
    for rank, res in enumerate(entries(job, "placement")):
        node, local = divmod(rank, PER_NODE)
        assert res["placement"] == (rank, 4, local, PER_NODE, node, NODES, "cpu", "gloo")


@pytest.mark.parametrize("group", ["world", "node", "cross"])
@pytest.mark.parametrize("mode", ["gather", "ring"])
def test_groups_of_nodes_match_single_process(job, group, mode):
    for res in entries(job, "groups"):
        assert res[f"{group}_{mode}"] < TOL, res


def test_divergence_over_nodes(job):
    for res in entries(job, "divergence"):
        assert abs(res["divergence_ring"] - res["divergence_ref"]) < TOL, res


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "4"}, "RANK is not set"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK must be an integer"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK must be in"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3"}, "must divide WORLD_SIZE"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
         "LOCAL_RANK must be in"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
         "node-by-node ranks"),
    ],
)  # fmt: skip
def test_placement_errors_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        fsd.placement_from_env(env, device="cpu")


def test_placement_of_a_second_node():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    place = fsd.placement_from_env(env, device="cpu")
    assert (place.node, place.n_nodes, place.local_rank) == (1, 2, 1)
    with pytest.raises(ValueError, match="device must be"):
        fsd.placement_from_env(env, device="tpu")
