"""The cost contract: every public cost reaches the backends as a kernel cost whose kind says
how the kernels and the gradient read it, and nothing unknown falls back to a default."""

import dataclasses

import pytest

from flashsinkhorn.backends import kernel_costs as K
from flashsinkhorn.backends.matrix import MATRIX
from flashsinkhorn.costs import COSTS, KERNEL_COST_OF, CostSpec


@pytest.mark.parametrize("cost", COSTS)
def test_every_public_cost_has_a_kernel_contract(cost):
    spec = CostSpec(cost=cost)
    c = K.contract(spec.kernel_cost)
    assert c.kind in K.KINDS and c.kind != "matrix"
    assert K.cost_id(c.name) == K.KERNEL_COSTS[c.name]
    assert K.power(c.name) == (2 if c.kind == "dot-product" else 1)
    assert K.shifted(c.name) == (c.kind == "dot-product")


def test_an_unknown_cost_is_refused_not_mapped_to_sqeuclidean():
    spec = dataclasses.replace(CostSpec(), cost="l1")
    with pytest.raises(ValueError, match="'l1' has no kernel cost"):
        _ = spec.kernel_cost
    with pytest.raises(ValueError, match="unknown kernel cost 'l1'"):
        K.contract("l1")
    with pytest.raises(ValueError, match="unknown kernel cost"):
        K.cost_id("l1")


def test_the_matrix_cost_is_a_kind_of_its_own():
    c = K.contract(MATRIX)
    assert c.kind == "matrix" and c.id is None and c.power is None
    assert MATRIX not in K.KERNEL_COSTS
    with pytest.raises(ValueError, match="not streamed"):
        K.cost_id(MATRIX)
    with pytest.raises(ValueError, match="not a power"):
        K.power(MATRIX)


def test_kernel_ids_are_distinct_and_public_names_cover_the_kernels():
    ids = list(K.KERNEL_COSTS.values())
    assert len(set(ids)) == len(ids)
    assert set(KERNEL_COST_OF.values()) == set(K.KERNEL_COSTS)
