"""Optimal-transport couplings for generative training (flow matching, OT-CFM).

Layers: :mod:`.minibatch` and :mod:`.plan_sampler` (public API: a one-call coupling of two
minibatches and the torchcfm-style ``OTPlanSampler``) → :mod:`.sampling` (pairs and argmax
from a solved plan) → ``Backend.plan_argmax`` (torch reference, Triton kernel). See
docs/couplings.md.
"""

from .minibatch import couple, couple_indices
from .plan_sampler import OTPlanSampler
from .sampling import plan_argmax, sample_pairs

__all__ = ["OTPlanSampler", "couple", "couple_indices", "plan_argmax", "sample_pairs"]
