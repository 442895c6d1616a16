"""Streaming Hessian–vector products of OT_eps and the debiased divergence (docs/hvp.md).

The package is called ``hessian`` so that ``flashsinkhorn.hvp`` can be the function.

It holds two layers (docs/architecture.md): the operators ``joint.py`` and ``cg.py``, which
the autograd functions below the engine read, and the public API ``operator.py`` and
``linear_operator.py``, which solve through the engine. The public names are imported on
first access, so that importing the operators never imports the engine.
"""

from importlib import import_module

from .cg import CGInfo, cg_solve
from .joint import TransportHessian

_PUBLIC = {
    "HVPResult": ".operator",
    "HessianOperator": ".operator",
    "hvp": ".operator",
    "HessianLinearOperator": ".linear_operator",
    "hessian_operator": ".linear_operator",
}

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


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
