"""Several activation functions in one network, cross-checked against dks 0.1.2.

dks takes a list of names and solves each with the same local targets, which come from the
network's maximal function; so does sigprop for a graph whose activation nodes name their own
``fn``. The graphs here are the templates of tests/engine/test_reference_dks_parity.py (MLP-50 and the
modified ResNet-101 v2 with shortcut weight 0.6) with ``tanh`` and ``softplus`` alternating over
the activation nodes; dks's ``subnet_max_func`` for the same graph is the same, because the local
targets do not depend on which layer computes which function. Each function's parameters in the
answer's ``activations`` map agree with dks's to 1e-7 relative.

The adapters are checked on a torch model that mixes Tanh and Softplus: ``graph_from_module`` with
``keep_fn=True``, the engine's answer, ``apply`` (torch) and ``transformed_activations`` (jax) put
each function's parameters on the right modules and graph ids, and the transformed activations
agree with dks's at a few points to 1e-6.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from sigprop.engine.solve import solve
from sigprop.engine.templates.expand import expand_template
from sigprop.errors import SigpropError
from sigprop.schemas.graph import Template
from sigprop.schemas.solve import SolveRequest

from ..dks_reference import mlp_subnet_max_func
from .test_reference_dks_parity import ARCHS, POINTS, arch_id, assert_params_agree, dks_params, dks_phi_hat, graph_of

FNS = ("tanh", "softplus")
TARGETS = {"dks": ("zeta", 1.5, (("c_slope_1_target", 1.5),), ()), "tat": ("tau", 0.3, (), (("c_curve_target", 0.3),))}
KEYS = ("input_scale", "input_shift", "output_scale", "output_shift")


def mixed_graph(template: dict, fns=FNS) -> dict:
    g = expand_template(Template.model_validate(template)).model_dump(exclude_none=True, by_alias=True)
    acts = [nd for nd in g["nodes"] if nd["op"] == "activation"]
    for i, nd in enumerate(acts):
        nd["fn"] = fns[i % len(fns)]
    return g


def solve_mixed(graph: dict, method: str, activation: str = "tanh", targets: dict | None = None):
    if targets is None:
        name, value, _, _ = TARGETS[method]
        targets = {name: value}
    return solve(
        SolveRequest.model_validate({"graph": graph, "method": method, "activation": activation, "targets": targets})
    )


CASES = [(method, arch) for method in ("dks", "tat") for arch in ARCHS]


@pytest.mark.parametrize("method,arch", CASES, ids=[f"{m}-{arch_id(a)}" for m, a in CASES])
def test_mixed_functions_match_dks(method, arch):
    sol = solve_mixed(mixed_graph(graph_of(arch)), method)
    _, _, dks_kw, tat_kw = TARGETS[method]
    ref = dks_params(FNS, arch, dks_kw, tat_kw)
    assert set(sol.activations) == set(FNS)
    for fn in FNS:
        assert_params_agree(sol.activations[fn].transform(), {k: ref[fn][k] for k in KEYS})
    # the top level keeps its single-function meaning: the request's activation's parameters
    assert {k: getattr(sol, k) for k in KEYS} == sol.activations["tanh"].transform()
    # every function meets the same local targets, so the network meets the global one
    assert (sol.c_slope_1 if method == "dks" else sol.c_curv_1) == pytest.approx(TARGETS[method][1], rel=1e-9)
    a, b = (sol.activations[fn] for fn in FNS)
    assert a.local_c_slope_1 == pytest.approx(b.local_c_slope_1, rel=1e-9)


def test_single_function_answers_have_no_activations_map():
    sol = solve_mixed(graph_of(ARCHS[0]), "dks")
    assert sol.activations is None and '"activations":{' not in sol.to_json()


def test_request_activation_absent_from_the_graph_leaves_the_top_level_empty():
    sol = solve_mixed(mixed_graph(graph_of(ARCHS[0])), "dks", activation="gelu")
    assert sol.input_scale is None and set(sol.activations) == set(FNS)


def test_tat_leaky_relu_must_be_the_only_function():
    with pytest.raises(SigpropError) as info:
        solve_mixed(mixed_graph(graph_of(ARCHS[0]), ("leaky_relu", "tanh")), "tat", "leaky_relu", {"eta": 0.9})
    assert info.value.code == "unsupported_activation" and "only activation function" in info.value.message


def test_dks_mixes_rectifiers_and_smooth_functions():
    sol = solve_mixed(mixed_graph(graph_of(ARCHS[0]), ("leaky_relu", "softplus")), "dks", "softplus")
    assert sol.activations["leaky_relu"].negative_slope is not None and sol.negative_slope is None
    assert sol.c_slope_1 == pytest.approx(1.5, rel=1e-9) and sol.c_curv_1 is None


# ---------------------------------------------------------------- the adapters


def _torch_model(depth: int):
    torch = pytest.importorskip("torch")
    nn = torch.nn
    layers, width = [], 16
    for i in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh() if i % 2 == 0 else nn.Softplus()]
    return nn.Sequential(*layers, nn.Linear(width, 4)), torch.randn(8, width)


def test_graph_from_module_warns_when_the_model_mixes_functions():
    from sigprop.client.torch import graph_from_module

    model, x = _torch_model(4)
    with pytest.warns(UserWarning, match="several activation functions"):
        graph_from_module(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph = graph_from_module(model, x, keep_fn=True)
    assert [nd["fn"] for nd in graph["nodes"] if nd["op"] == "activation"] == ["tanh", "softplus"] * 2


@pytest.mark.parametrize("method", ["dks", "tat"])
def test_adapters_put_each_functions_parameters_on_its_modules(method):
    torch = pytest.importorskip("torch")
    jax_client = pytest.importorskip("sigprop.client.jax")
    from sigprop.client.torch import apply, graph_from_module

    depth = 6
    model, x = _torch_model(depth)
    graph = graph_from_module(model, x, keep_fn=True)
    sol = solve_mixed(graph, method)
    _, _, dks_kw, tat_kw = TARGETS[method]
    # dks's subnet_max_func for this graph: an MLP with ``depth`` nonlinear layers
    ref = dks_params(FNS, ("mlp", depth), dks_kw, tat_kw)
    report = apply(model, sol, graph=graph, example_input=x)
    by_id = {c.id: c.module for c in report.activations}
    fn_of = {nd["id"]: nd["fn"] for nd in graph["nodes"] if nd["op"] == "activation"}
    jax_fns = jax_client.transformed_activations(sol, graph)
    assert set(by_id) == set(fn_of) == set(jax_fns)
    for gid, fn in fn_of.items():
        expect = dks_phi_hat(fn, ref[fn])(POINTS)
        module = report.model.get_submodule(by_id[gid])
        with torch.no_grad():
            got = module(torch.tensor(POINTS, dtype=torch.float64)).numpy()
        np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-6)
        got_jax = np.asarray(jax_fns[gid](POINTS.astype(np.float32)), dtype=np.float64)
        np.testing.assert_allclose(got_jax, expect, rtol=1e-6, atol=1e-6)


def test_dks_subnet_max_func_is_the_same_for_the_torch_mlp():
    # the adapters' reference uses dks's MLP subnet_max_func: check it matches sigprop's program
    from sigprop.client.torch import graph_from_module

    model, x = _torch_model(6)
    sol = solve_mixed(graph_from_module(model, x, keep_fn=True), "dks")
    slope = sol.activations["tanh"].local_c_slope_1
    assert mlp_subnet_max_func(6)(1.0, lambda y: slope * y) == pytest.approx(1.5, rel=1e-9)


def test_eoc_solves_each_function_and_initializes_each_layer_with_the_function_it_reads():
    fns = ("tanh", "erf")  # softplus has no Edge of Chaos at q* = 1 (it would need sigma_b^2 < 0)
    graph = mixed_graph(graph_of(ARCHS[0]), fns)
    sol = solve_mixed(graph, "eoc", "tanh", {"q_star": 1.0})
    single = {fn: solve_mixed(graph_of(ARCHS[0]), "eoc", fn, {"q_star": 1.0}) for fn in fns}
    for fn in fns:
        assert sol.activations[fn].sigma_w2 == single[fn].sigma_w2
        assert sol.activations[fn].sigma_b2 == single[fn].sigma_b2
    assert sol.sigma_w2 == single["tanh"].sigma_w2  # the top level: the request's activation
    by_id = {nd["id"]: nd for nd in graph["nodes"]}
    checked = 0
    for layer in sol.layers:
        src = by_id[by_id[layer.id]["inputs"][0]]
        if src["op"] == "activation":
            assert layer.weight_variance == pytest.approx(single[src["fn"]].sigma_w2 / layer.fan_in, rel=1e-12)
            checked += 1
    assert checked == 50  # every layer but the first reads an activation
