"""Functional API: validate the arguments into options, then run the engine.

:func:`sinkhorn` solves between two point clouds; :func:`solve` for a given cost matrix.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import _validation as V
from ._boundary import entry_point
from ._convergence import report, warn_unconverged
from ._numpy import numpy_io
from .costs import transform_points
from .engine import solve_matrix, solve_points
from .option_table import document_options
from .options import SinkhornOptions, public_options
from .result import SinkhornResult


@entry_point
@numpy_io(("x", "y", "a", "b", "feature_map", "label_x", "label_y", "label_cost"))
@document_options()
def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    n_iters: int = 1000,
    tol: float | None = 1e-3,
    check_every: int = 10,
    schedule: str = "auto",
    acceleration: str = "auto",
    omega: float | None = None,
    anderson_memory: int = 5,
    scaling: float | str | None = "auto",
    diameter: float | None = None,
    rho_x: float | None = None,
    rho_y: float | None = None,
    backend: str = "auto",
    precision: str = "auto",
    check_finite: bool = True,
    path: str = "auto",
    progress: bool | Callable[[int, float], object] | None = None,
    cost: str = "sqeuclidean",
    feature_map: torch.Tensor | None = None,
    label_x: torch.Tensor | None = None,
    label_y: torch.Tensor | None = None,
    label_cost: torch.Tensor | None = None,
    feature_weight: float = 1.0,
    label_weight: float = 1.0,
) -> SinkhornResult:
    r"""Entropic optimal transport between two point clouds, cost C_ij = ‖x_i − y_j‖² by default.

    Solves $\min_P \langle C, P\rangle + \varepsilon\,\mathrm{KL}(P \,\|\, a \otimes b)$ (plus
    $\rho$ KL terms on relaxed marginals) in the log domain with streaming soft-min updates;
    the n × m cost is never stored on the Triton path.

    Args:
        x: (n, d) or (B, n, d) source points; float16/bfloat16/float32/float64. A NumPy
            array (then every array argument is one) is solved on the CPU in its dtype and
            gives a result of NumPy arrays (docs/conventions.md, "NumPy inputs").
        y: (m, d) or (B, m, d) target points, same dtype and device as ``x``.
        a: weights of ``x``, (n,) or (B, n), non-negative; default uniform 1/n.
        b: weights of ``y``, (m,) or (B, m); default uniform 1/m.
        {options}

    Returns:
        A :class:`SinkhornResult` with potentials ``f``, ``g``, ``value``, ``n_iters``,
        ``converged``, ``marginal_error``, the error history ``errors``, and the ``schedule``
        and ``acceleration`` that ran; ``print(result)`` summarises it. Issues a
        ``ConvergenceWarning`` when ``tol`` was not reached in ``n_iters`` iterations.
        Potentials are not differentiable; use :func:`flashsinkhorn.ot_cost` for gradients.

    Raises:
        ValueError, TypeError: for invalid arguments, naming the argument.

    Examples:
        >>> import torch
        >>> import flashsinkhorn as fs
        >>> x, y = torch.rand(200, 3), torch.rand(300, 3)
        >>> res = fs.sinkhorn(x, y, eps=0.1)
        >>> res.f.shape, res.g.shape
        (torch.Size([200]), torch.Size([300]))
        >>> bool(res.converged), bool(res.marginal_error <= 1e-3)
        (True, True)
    """
    V.check_points("x", x)
    V.check_points("y", y)
    V.check_pair(x, y)
    opts = SinkhornOptions.build(x, y, **public_options(locals()))
    with torch.no_grad():
        x, y = transform_points(x, opts.cost), transform_points(y, opts.cost)
    res = solve_points(x, y, a, b, opts)
    _warn("sinkhorn", res, opts)
    return res


@entry_point
@numpy_io(("C", "a", "b"))
@document_options()
def solve(
    C: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    n_iters: int = 1000,
    tol: float | None = 1e-3,
    check_every: int = 10,
    schedule: str = "auto",
    acceleration: str = "auto",
    omega: float | None = None,
    anderson_memory: int = 5,
    scaling: float | str | None = "auto",
    rho_x: float | None = None,
    rho_y: float | None = None,
    progress: bool | Callable[[int, float], object] | None = None,
) -> SinkhornResult:
    """Entropic optimal transport for a given cost matrix C (POT's ``ot.sinkhorn`` form).

    Solves min_P <C, P> + eps KL(P | a⊗b) (plus rho KL terms on relaxed marginals) with the
    solver loop of :func:`sinkhorn`: same schedules, acceleration, stopping rule, annealing and
    result. Use it when the cost is not a function of two point clouds (a graph distance, a
    learned cost, a precomputed matrix). The soft-mins read C in row blocks with torch
    operations, on the CPU or a GPU, so the n × m cost is stored (by the caller): for
    squared-Euclidean clouds :func:`sinkhorn` streams it instead.

    Args:
        C: (n, m) cost, or (B, n, m) for B problems solved together; float32 or float64
            (float16/bfloat16 are read in float32), on any device. Its entries must be finite
            (checked in the one synchronisation of the weight checks). A NumPy array (with
            ``a``, ``b`` NumPy too) gives a result of NumPy arrays, as in :func:`sinkhorn`.
        a: weights of the rows, (n,) or (B, n) (a shared (n,) for a batched C), non-negative;
            default uniform 1/n.
        b: weights of the columns, (m,) or (B, m); default uniform 1/m.
        eps: entropic regularisation, > 0, in units of C.
        {options}
        scaling: "auto" (default), None or a value in (0, 1): eps annealing as in
            :func:`sinkhorn`, starting at the spread R = max C − min C (the role of
            diameter²: eps is divided by ``scaling²`` per iteration); "auto" anneals only
            with ``tol`` set and eps/R < 1e-3.
        rho_x: KL relaxation strength of the row marginal (unbalanced OT); None (default) is
            a hard constraint.
        rho_y: the same for the column marginal.
        progress: None (default), True (a progress bar) or a callable
            ``progress(iteration, error)`` called at each convergence test, as in
            :func:`sinkhorn` (needs ``tol``).

    Returns:
        A :class:`SinkhornResult`: potentials ``f`` (n,) / (B, n) and ``g`` (m,) / (B, m) with
        P_ij = a_i b_j exp((f_i + g_j − C_ij)/eps), ``value`` (OT_eps, () or (B,), float32 or
        float64), ``n_iters``, ``converged``, ``marginal_error``, ``marginals()``,
        ``apply``/``apply_T`` (P V and Pᵀ U) and ``plan()``; ``result.path`` is "matrix".
        ``value`` is differentiable: d value/dC = P and, like :func:`ot_cost`, d value/da = f,
        d value/db = g for a balanced problem (defined up to a constant on the simplex) and the
        partial derivative of the dual objective for relaxed marginals (docs/transport.md).
        The potentials are not differentiable.

    Raises:
        TypeError: C, a or b not a real floating tensor; an option of the wrong type.
        ValueError: a wrong shape, NaN/inf in C, invalid weights or an option out of range,
            naming the argument.

    Examples:
        >>> import torch
        >>> import flashsinkhorn as fs
        >>> x, y = torch.rand(200, 3), torch.rand(300, 3)
        >>> C = torch.cdist(x, y) ** 2                  # any (n, m) cost
        >>> P = fs.solve(C, eps=0.1).plan()             # (n, m), rows sum to a = 1/n
        >>> P.shape, torch.allclose(P.sum(1), torch.full((200,), 1 / 200), atol=1e-3)
        (torch.Size([200, 300]), True)
    """
    opts = SinkhornOptions.build(**public_options(locals()))
    res = solve_matrix(C, a, b, opts)
    _warn("solve", res, opts)
    return res


def _warn(where: str, res: SinkhornResult, opts: SinkhornOptions) -> None:
    # the result says converged=False itself, but a user who reads only f, g or value
    # should not miss it: warn like the losses (ConvergenceWarning)
    # the batch flag from the problem: reading res.f would form the gauged potentials (three
    # reductions and eight launches per call) on the fixed-iteration path, which never warns
    what = "batched Sinkhorn solve" if res.solution.problem.batched else "Sinkhorn solve"
    warn_unconverged(where, [report("OT(x, y)", res)], opts.n_iters, opts.tol, what)
