"""OTDD: the optimal transport dataset distance between labelled datasets (docs/otdd.md).

- :func:`class_distance_matrix`: the class-to-class distances W over the union of both label
  sets, every class pair solved in a few batched problems;
- :func:`otdd_distance`: the debiased OTDD with the label-augmented cost
  ``feature_weight · ‖x − y‖² + label_weight · W[ℓ, ℓ']``;
- :func:`augment_labels`: the labels of both datasets as indices into W.
"""

from .class_distance import class_distance_matrix
from .distance import augment_labels, otdd_distance

__all__ = ["augment_labels", "class_distance_matrix", "otdd_distance"]
