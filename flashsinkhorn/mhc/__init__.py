"""mHC: batched small-matrix Sinkhorn–Knopp projection and the manifold-constrained
hyper-connection layer (see docs/mhc.md)."""

from .fused import fused_add_residual, fused_dynamic_weights, fused_stream_mix
from .layer import HyperConnection, SplitHyperConnection
from .reference import HyperConnectionReference, sinkhorn_knopp_reference
from .sinkhorn import VARIANTS, sinkhorn_knopp

__all__ = [
    "HyperConnection",
    "HyperConnectionReference",
    "SplitHyperConnection",
    "VARIANTS",
    "fused_add_residual",
    "fused_dynamic_weights",
    "fused_stream_mix",
    "sinkhorn_knopp",
    "sinkhorn_knopp_reference",
]
