"""scipy.sparse.linalg.LinearOperator view of the streaming Hessian (float64 matvecs)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator

from .operator import HessianOperator


class HessianLinearOperator(LinearOperator):
    """(N, N) Hessian, N = n·d, rows of the differentiated cloud flattened in C order.

    Matvecs take and return float64 NumPy vectors; they run in the dtype of the points on
    their device. The Sinkhorn solve(s), induced marginals and P y are computed once at
    construction and shared by every matvec (the torch operator is :attr:`torch_operator`;
    diagnostics of the last product in ``torch_operator.last``).
    """

    def __init__(self, op: HessianOperator):
        if op.batched:
            raise ValueError("x, y: hessian_operator needs unbatched (n, d) clouds")
        self.torch_operator = op
        N = op.shape[0] * op.shape[1]
        super().__init__(dtype=np.float64, shape=(N, N))

    def _matvec(self, v):
        op = self.torch_operator
        A = torch.as_tensor(np.ascontiguousarray(v, dtype=np.float64).reshape(op.shape))
        A = A.to(device=op.device, dtype=op.dtype)
        return op.matvec(A).detach().to("cpu", torch.float64).numpy().reshape(-1)

    def _matmat(self, V):
        return np.stack([self._matvec(V[:, k]) for k in range(V.shape[1])], 1)

    # The Hessian is symmetric.
    def _rmatvec(self, v):
        return self._matvec(v)

    def _adjoint(self):
        return self


def hessian_operator(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    wrt: str = "x",
    **options,
) -> HessianLinearOperator:
    """The Hessian of OT_eps w.r.t. ``x`` (or ``y``) as a scipy ``LinearOperator``.

    ``eigsh(op, k=1, which="SA")`` gives the smallest eigenvalue; every matvec is one streaming
    HVP (memory O((n + m) d)). Options as in :class:`~flashsinkhorn.HessianOperator`
    (``debias``, ``tau``, ``cg_tol``, ``cg_max_iter``, solver options).

    Args:
        x: (n, d) source points.
        y: (m, d) target points.
        a: (n,) weights of x, default uniform.
        b: (m,) weights of y, default uniform.
        eps: entropic regularisation.
        wrt: "x" (shape (n·d, n·d)) or "y" (shape (m·d, m·d)).

    Returns:
        A :class:`HessianLinearOperator` (float64 matvec, symmetric).

    Examples:
        >>> import numpy as np
        >>> import torch
        >>> import flashsinkhorn as fs
        >>> x, y = torch.rand(20, 2, dtype=torch.float64), torch.rand(30, 2, dtype=torch.float64)
        >>> H = fs.hessian_operator(x, y, eps=0.5)        # (n·d, n·d) = (40, 40)
        >>> H.shape, (H @ np.ones(40)).shape
        ((40, 40), (40,))
    """
    return HessianLinearOperator(HessianOperator(x, y, a, b, eps=eps, wrt=wrt, **options))
