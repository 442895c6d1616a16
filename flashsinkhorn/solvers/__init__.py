"""Solver loop, schedules and the quantities derived from potentials."""

from .annealing import MAX_ANNEALING_STEPS, eps_schedule, estimate_diameter, geometric_ladder
from .loop import SolveState, solve
from .objective import dual_value, marginal_error, marginals

__all__ = [
    "MAX_ANNEALING_STEPS",
    "SolveState",
    "dual_value",
    "eps_schedule",
    "estimate_diameter",
    "geometric_ladder",
    "marginal_error",
    "marginals",
    "solve",
]
