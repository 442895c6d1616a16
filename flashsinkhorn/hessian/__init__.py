"""Streaming Hessian–vector products of OT_eps and the debiased divergence (docs/hvp.md).

The package is called ``hessian`` so that ``flashsinkhorn.hvp`` can be the function.
"""

from .cg import CGInfo, cg_solve
from .joint import TransportHessian
from .linear_operator import HessianLinearOperator, hessian_operator
from .operator import HessianOperator, HVPResult, hvp

__all__ = [
    "CGInfo",
    "HVPResult",
    "HessianLinearOperator",
    "HessianOperator",
    "TransportHessian",
    "cg_solve",
    "hessian_operator",
    "hvp",
]
