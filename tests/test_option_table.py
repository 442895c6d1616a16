"""The option table against every public signature, docstring and the options object, and
the refusal of options that do nothing in a combination."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import coupling, distributed, otdd
from flashsinkhorn.costs import COST_DEFAULTS
from flashsinkhorn.option_table import BY_NAME, OPTIONS, REQUIRED, option_parameters
from flashsinkhorn.options import SOLVER_DEFAULTS, HVPOptions, SinkhornOptions

_COUPLE = {"eps", "tol", "n_iters", "backend", "precision", "path"}

#: Every public entry point with solve options, and the table's options it does not take
#: (with the reason in a comment).
ENTRY_POINTS = {
    "sinkhorn": (fs.sinkhorn, {"hvp_options"}),  # no gradients
    "ot_cost": (fs.ot_cost, set()),
    "sinkhorn_divergence": (fs.sinkhorn_divergence, set()),
    # a given cost matrix: no points to take a cost, path, backend or diameter of
    "solve": (
        fs.solve,
        {"diameter", "backend", "precision", "check_finite", "path", "hvp_options", *COST_DEFAULTS},
    ),
    # sharded clouds: the streaming path and the plain squared Euclidean cost; no progress
    # report (the convergence test is an all-reduce of every rank)
    "distributed.sinkhorn": (
        distributed.sinkhorn,
        {"path", "hvp_options", "progress", *COST_DEFAULTS},
    ),
    "distributed.ot_cost": (
        distributed.ot_cost,
        {"path", "hvp_options", "progress", *COST_DEFAULTS},
    ),
    "distributed.sinkhorn_divergence": (
        distributed.sinkhorn_divergence,
        {"path", "hvp_options", "progress", *COST_DEFAULTS},
    ),
    # OTDD builds its own label cost; the class terms are balanced OT
    "otdd.otdd_distance": (
        otdd.otdd_distance,
        {"rho_x", "rho_y", "path", "hvp_options", "cost", "feature_map", "label_x", "label_y"},
    ),
    "otdd.class_distance_matrix": (
        otdd.class_distance_matrix,
        {"rho_x", "rho_y", "path", "hvp_options", *COST_DEFAULTS},
    ),
    # minibatch couplings: a few solver options (``rho`` and ``mode`` are their own)
    "coupling.couple": (coupling.couple, set(BY_NAME) - _COUPLE),
    "coupling.couple_indices": (coupling.couple_indices, set(BY_NAME) - _COUPLE),
    # POT/torchcfm's signature: reg is eps, reg_m the relaxation
    "coupling.OTPlanSampler": (coupling.OTPlanSampler.__init__, set(BY_NAME) - {"tol", "backend"}),
}

#: (entry point, option) whose default differs from the table's on purpose.
OWN_DEFAULTS = {
    # None picks eps from the batches (a fraction of their mean squared distance)
    ("coupling.couple", "eps"),
    ("coupling.couple_indices", "eps"),
    # a bar over OTDD's batched class solves (a bool), not one solve's report
    ("otdd.otdd_distance", "progress"),
    ("otdd.class_distance_matrix", "progress"),
}


#: The parameters of each entry point that are not solve options: its data and its own
#: settings. A new keyword anywhere else must be a row of the table (this test fails
#: otherwise), so that it is checked, documented and defaulted like the others.
OWN_PARAMETERS = {
    "sinkhorn": {"x", "y", "a", "b"},
    "ot_cost": {"x", "y", "a", "b"},
    "sinkhorn_divergence": {"x", "y", "a", "b"},
    "solve": {"C", "a", "b"},
    "distributed.sinkhorn": {"x_local", "y_local", "a_local", "b_local", "group", "mode",
                             "compute_error"},
    "distributed.ot_cost": {"x_local", "y_local", "a_local", "b_local", "group", "mode"},
    "distributed.sinkhorn_divergence": {"x_local", "y_local", "a_local", "b_local", "group",
                                        "mode"},
    "otdd.otdd_distance": {"x1", "l1", "x2", "l2", "a1", "a2", "num_classes",
                           "differentiable_w", "w_options", "progress"},
    "otdd.class_distance_matrix": {"x1", "l1", "x2", "l2", "a1", "a2", "num_classes",
                                   "differentiable", "max_batch_elements", "progress"},
    "coupling.couple": {"x0", "x1", "mode", "rho", "k", "replace", "generator", "seed"},
    "coupling.couple_indices": {"x0", "x1", "mode", "rho", "k", "replace", "generator", "seed"},
    "coupling.OTPlanSampler": {"self", "method", "reg", "reg_m", "normalize_cost",
                               "num_threads", "warn", "generator"},
}  # fmt: skip


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_keyword_is_an_option_of_the_table_or_the_entry_points_own(name):
    fn, _ = ENTRY_POINTS[name]
    names = set(inspect.signature(fn).parameters)
    stray = names - set(BY_NAME) - OWN_PARAMETERS[name]
    assert not stray, (name, sorted(stray))


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_signature_matches_the_table(name):
    fn, without = ENTRY_POINTS[name]
    params = option_parameters(fn)
    assert set(params) == set(BY_NAME) - without, name
    for key, p in params.items():
        opt = BY_NAME[key]
        if (name, key) in OWN_DEFAULTS:
            continue
        if not name.startswith("coupling."):  # the couplings take them positionally too
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, (name, key)
        assert _same(p.default, opt.default), (name, key, p.default, opt.default)
        assert p.annotation == opt.type, (name, key, p.annotation, opt.type)


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_docstring_documents_every_option(name):
    fn, _ = ENTRY_POINTS[name]
    # a class documents its constructor; couple_indices refers to couple's Args
    source = {coupling.OTPlanSampler.__init__: coupling.OTPlanSampler,
              coupling.couple_indices: coupling.couple}  # fmt: skip
    doc = inspect.getdoc(source.get(fn, fn))
    assert "{options}" not in doc
    args = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
    documented = {line.strip().split(":", 1)[0] for line in args.splitlines() if ":" in line}
    missing = set(option_parameters(fn)) - documented
    assert not missing, (name, sorted(missing))


def test_sinkhorn_documents_the_table_text():
    doc = inspect.getdoc(fs.sinkhorn)
    flat = " ".join(doc.split())
    for opt in OPTIONS:
        if opt.name in option_parameters(fs.sinkhorn):
            assert f"{opt.name}: {' '.join(opt.doc.split())}" in flat, opt.name


def test_options_object_is_the_table():
    fields = {f.name: f for f in dataclasses.fields(SinkhornOptions)}
    solver = [o for o in OPTIONS if o.group == "solver"]
    assert list(fields)[: len(solver)] == [o.name for o in solver]
    for o in solver:
        want = dataclasses.MISSING if o.default is REQUIRED else o.default
        assert _same(fields[o.name].default, want), o.name
    assert SOLVER_DEFAULTS == {o.name: o.default for o in solver if o.name != "eps"}
    assert COST_DEFAULTS == {o.name: o.default for o in OPTIONS if o.group == "cost"}


def test_samples_loss_shares_the_table_names_it_takes():
    # GeomLoss's conventions: its scaling defaults to 0.5, its cost is None (GeomLoss's
    # formula argument) and its backend names include "tensorized"/"online"; every other
    # shared name has the table's default.
    params = option_parameters(fs.SamplesLoss.__init__)
    assert set(params) == {"diameter", "scaling", "backend", "precision", "check_finite",
                           "hvp_options", "cost"}  # fmt: skip
    for key in set(params) - {"scaling", "cost"}:
        assert _same(params[key].default, BY_NAME[key].default), key


@pytest.mark.parametrize("key", ["path", "hvp_options", "cost", "tol"])
def test_module_takes_every_option_of_its_function(key):
    # SinkhornDivergence(**options) equals sinkhorn_divergence(**options): every keyword of
    # the function is accepted (path was refused before).
    values = {"path": "auto", "hvp_options": {"tau": 1e-4}, "cost": "sqeuclidean", "tol": 1e-4}
    x = torch.rand(7, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = x + 0.3
    loss = fs.SinkhornDivergence(eps=0.5, **{key: values[key]})
    want = fs.sinkhorn_divergence(x, y, eps=0.5, **{key: values[key]})
    torch.testing.assert_close(loss(x, y), want, rtol=0, atol=0)


def test_module_refuses_an_unknown_option():
    with pytest.raises(TypeError, match="unexpected options.*'pth'"):
        fs.SinkhornDivergence(eps=0.5, pth="auto")


COMBINATIONS = [
    (dict(omega=1.5), "omega=1.5 is the factor of acceleration='overrelax'"),
    (dict(omega=1.5, acceleration="anderson"), "does nothing with acceleration='anderson'"),
    (dict(omega=1.5, acceleration="none"), "does nothing with acceleration='none'"),
    (dict(anderson_memory=3, acceleration="overrelax"), "anderson_memory=3 is read by Anderson"),
    (dict(check_every=5, tol=None), "check_every=5 spaces the convergence tests"),
    (dict(diameter=2.0, scaling=None), "scaling=None anneals nothing"),
    (dict(diameter=2.0, tol=None), "scaling='auto' with tol=None anneals nothing"),
]


ENTRIES = ["sinkhorn", "ot_cost", "sinkhorn_divergence", "solve", "SinkhornDivergence", "otdd"]


@pytest.mark.parametrize(
    "entry,kw,match",
    [
        (e, kw, m)
        for e in ENTRIES
        for kw, m in COMBINATIONS
        if not (e == "solve" and "diameter" in kw)  # solve has no diameter
    ],
)
def test_option_that_does_nothing_is_refused(entry, kw, match):
    x = torch.rand(6, 2, dtype=torch.float64)
    y = torch.rand(5, 2, dtype=torch.float64)
    calls = {
        "sinkhorn": lambda: fs.sinkhorn(x, y, eps=0.5, **kw),
        "ot_cost": lambda: fs.ot_cost(x, y, eps=0.5, **kw),
        "sinkhorn_divergence": lambda: fs.sinkhorn_divergence(x, y, eps=0.5, **kw),
        "solve": lambda: fs.solve(torch.cdist(x, y) ** 2, eps=0.5, **kw),
        "SinkhornDivergence": lambda: fs.SinkhornDivergence(eps=0.5, **kw),
        "otdd": lambda: otdd.otdd_distance(
            x, torch.tensor([0, 1, 0, 1, 0, 1]), y, torch.tensor([0, 1, 1, 0, 0]), eps=0.5, **kw
        ),
    }
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        calls[entry]()


def test_options_that_act_are_accepted():
    x = torch.rand(6, 2, dtype=torch.float64)
    y = torch.rand(5, 2, dtype=torch.float64)
    for kw in (
        dict(omega=1.5, acceleration="overrelax"),
        dict(anderson_memory=3, acceleration="anderson"),
        dict(check_every=5),
        dict(diameter=2.0, scaling=0.5),
        dict(diameter=2.0),
        dict(diameter=2.0, scaling=0.5, tol=None),
    ):
        assert torch.isfinite(fs.sinkhorn(x, y, eps=0.5, **kw).value).all(), kw


@pytest.mark.parametrize("kw", [dict(cost="euclidean"), dict(path="multiscale")])
@pytest.mark.parametrize("fn", [fs.ot_cost, fs.sinkhorn_divergence])
def test_hvp_options_without_second_derivatives_are_refused(fn, kw):
    x = torch.rand(6, 2, dtype=torch.float64)
    y = torch.rand(5, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="hvp_options sets the Schur solve"):
        fn(x, y, eps=0.5, hvp_options={"tau": 1e-4}, **kw)


@pytest.mark.parametrize("fn", [fs.hvp, fs.HessianOperator.__init__])
def test_hvp_signatures_match_the_schur_settings(fn):
    # hvp and HessianOperator spell the Schur-solve settings out (hvp_options' keys) and take
    # the solve options as **solver_options, validated by the table.
    params = inspect.signature(fn).parameters
    for f in dataclasses.fields(HVPOptions):
        assert _same(params[f.name].default, f.default), f.name
    assert params["solver_options"].kind is inspect.Parameter.VAR_KEYWORD
    assert params["eps"].default is inspect.Parameter.empty
    x = torch.rand(6, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="omega=1.5 is the factor"):
        fs.hvp(x, x + 0.1, torch.ones_like(x), eps=0.5, omega=1.5)
