"""The examples in the docstrings of the main public functions run and print what they say.

Each example is a doctest on small CPU problems (the API pages show them); a main function
whose example was removed fails here too.
"""

from __future__ import annotations

import doctest

import pytest

import flashsinkhorn as fs
from flashsinkhorn import mhc, otdd

MAIN = [
    fs.sinkhorn,
    fs.solve,
    fs.ot_cost,
    fs.sinkhorn_divergence,
    fs.SinkhornDivergence,
    fs.SamplesLoss,
    fs.hvp,
    fs.hessian_operator,
    otdd.otdd_distance,
    otdd.class_distance_matrix,
    mhc.sinkhorn_knopp,
]


@pytest.mark.parametrize("obj", MAIN, ids=lambda o: o.__qualname__)
def test_docstring_example(obj):
    import torch

    tests = doctest.DocTestFinder(recurse=False).find(obj, obj.__qualname__)
    examples = [t for t in tests if t.examples]
    assert examples, f"{obj.__qualname__} has no example in its docstring"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        for test in examples:
            runner.run(test)
    finally:
        torch.random.set_rng_state(state)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} lines failed"
