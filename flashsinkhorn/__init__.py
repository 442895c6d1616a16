"""flashsinkhorn: IO-aware entropic optimal transport for PyTorch.

Each Sinkhorn half-step is an online log-sum-exp over streamed tiles (Triton on CUDA), so the
n × m cost matrix is never stored. A plain PyTorch backend runs everywhere else.
"""

from ._convergence import ConvergenceWarning
from .functional import sinkhorn, solve
from .losses import ot_cost, sinkhorn_divergence
from .nn import SamplesLoss, SinkhornDivergence
from .result import SinkhornResult

__version__ = "0.1.0"

__all__ = [
    "ConvergenceWarning",
    "SamplesLoss",
    "SinkhornDivergence",
    "SinkhornResult",
    "__version__",
    "ot_cost",
    "sinkhorn",
    "sinkhorn_divergence",
    "solve",
]

# Second order: streaming Hessian–vector products and the scipy LinearOperator.
from .hessian import HessianOperator, HVPResult, hessian_operator, hvp  # noqa: E402

__all__ += ["HVPResult", "HessianOperator", "hessian_operator", "hvp"]

# OTDD (optimal transport dataset distance): flashsinkhorn.otdd.
from . import otdd  # noqa: E402

__all__ += ["otdd"]

# One problem sharded over a torch.distributed process group: flashsinkhorn.distributed.
from . import distributed  # noqa: E402

__all__ += ["distributed"]

# Couplings for flow matching: pairs drawn from streamed plans; flashsinkhorn.coupling.
from . import coupling  # noqa: E402
from .coupling import OTPlanSampler, couple, couple_indices, plan_argmax, sample_pairs  # noqa: E402

__all__ += ["OTPlanSampler", "couple", "couple_indices", "coupling", "plan_argmax", "sample_pairs"]

# mHC (batched small-matrix Sinkhorn–Knopp and the hyper-connection layer): flashsinkhorn.mhc.
# Imported on first access: it imports Triton at module level (~150 ms on CPU).
__all__ += ["mhc"]


def __getattr__(name: str):
    if name == "mhc":
        import importlib

        return importlib.import_module(".mhc", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
