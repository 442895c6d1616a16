"""One OT problem sharded over the ranks of a torch.distributed process group.

Each rank holds contiguous shards of the rows of x and y (and of their weights); the solve is
a collective that returns this rank's slices of the potentials and the global value, equal to
the single-process :func:`flashsinkhorn.sinkhorn` on the concatenated clouds. Two modes:
"gather" (clouds all-gathered once, potentials all-gathered every iteration) and "ring"
(shards circulate, O((n + m) d / world) memory per rank). Launch with torchrun; NCCL with one
GPU per rank, gloo on CPUs; :func:`init_process_group` sets a process up from torchrun's
environment, on one node or several. See docs/distributed.md.

Importing this module initialises nothing; the functions need an initialised process group.
"""

from .launch import Placement, init_process_group, node_group, placement_from_env
from .losses import ot_cost, sinkhorn_divergence
from .solver import DistributedSinkhornResult, sinkhorn

__all__ = [
    "DistributedSinkhornResult",
    "Placement",
    "init_process_group",
    "node_group",
    "ot_cost",
    "placement_from_env",
    "sinkhorn",
    "sinkhorn_divergence",
]
