"""Streaming Hessian–vector products of OT_eps and the debiased divergence (docs/hvp.md).

The package is called ``hessian`` so that ``flashsinkhorn.hvp`` can be the function.

It holds two layers (docs/architecture.md): the operators ``joint.py`` and ``cg.py``, which
the autograd functions below the engine read and which this package exports, and the public
API ``operator.py`` (``hvp``, ``HessianOperator``) and ``linear_operator.py``
(``hessian_operator``), which solve through the engine and are exported by
``flashsinkhorn`` itself: importing the operators never imports the engine.
"""

from .cg import CGInfo, cg_solve
from .joint import TransportHessian

__all__ = ["CGInfo", "TransportHessian", "cg_solve"]
