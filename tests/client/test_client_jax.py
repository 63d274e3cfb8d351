"""The JAX adapter (``sigprop.client.jax``) against a live ``sigprop serve``.

End to end (TAT paper, Appendix E.1): solve a deep plain ``jax.numpy`` MLP on the service,
re-initialize its params with :func:`apply_to_params`, run it, and check that the finite-width
network does what the answer predicts -- q stays near 1 in every layer, and the cosine similarity
of two inputs at the output follows the answer's global C map, for TReLU (``leaky_relu``, eta 0.9,
depth 50) and smooth TAT (``softplus``, tau 0.3, depth 20). Then the pieces one by one: the
transformed activation against the engine's numpy definitions for every activation kind, the SUO
/ Orthogonal Delta initializers against their definition and the dks reference, and what
:func:`apply_to_params` reports.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import types
from pathlib import Path

import httpx
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from sigprop.client import jax as sjax  # noqa: E402
from sigprop.engine.maps.activations import ACTIVATION_NAMES, get_activation, transformed  # noqa: E402
from sigprop.schemas import LayerInit, Solution  # noqa: E402

from ..service_fixtures import running_service  # noqa: E402

jax.config.update("jax_enable_x64", False)

D_IN = 128  # input features: the first layer is 128 -> 256 (fan_in < fan_out, gain sqrt(2))
WIDTH = 256
N_PAIRS = 128  # input pairs per network


# -- the service and the answers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("client-jax")) as svc:
        yield svc


def mlp_graph(depth: int, d_in: int = D_IN, width: int = WIDTH) -> dict:
    """The contract's graph of :func:`mlp_forward`: input -> depth x (dense -> activation) -> output,
    dense layers named ``fc_i`` (the params tree calls them ``Dense_i``)."""
    nodes = [{"id": "x", "op": "input", "shape": [d_in]}]
    prev = "x"
    for i in range(depth):
        nodes.append({"id": f"fc_{i}", "op": "dense", "inputs": [prev], "units": width})
        nodes.append({"id": f"act_{i}", "op": "activation", "inputs": [f"fc_{i}"]})
        prev = f"act_{i}"
    nodes.append({"id": "out", "op": "output", "inputs": [prev]})
    return {"schema": "sigprop.graph/v1", "nodes": nodes}


def solve(service, body: dict) -> Solution:
    r = httpx.post(service.base_url + "/v1/solve", json=body, timeout=60.0)
    assert r.status_code == 200, r.text[:1000]
    return Solution.model_validate_json(r.text)


@pytest.fixture(scope="module")
def trelu(service) -> Solution:
    return solve(
        service, {"graph": mlp_graph(50), "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.9}}
    )


@pytest.fixture(scope="module")
def tat_softplus(service) -> Solution:
    return solve(service, {"graph": mlp_graph(20), "method": "tat", "activation": "softplus", "targets": {"tau": 0.3}})


# -- the network ----------------------------------------------------------------------------------


def blank_params(depth: int, d_in: int = D_IN, width: int = WIDTH) -> dict:
    """A Flax-style params tree of the MLP, every leaf zero (apply_to_params fills it)."""
    params, fan_in = {}, d_in
    for i in range(depth):
        params[f"Dense_{i}"] = {"kernel": jnp.zeros((fan_in, width)), "bias": jnp.zeros((width,))}
        fan_in = width
    return params


def mlp_forward(params: dict, x, act, depth: int):
    """A plain jax.numpy MLP; returns the pre-activations and activations of every layer,
    stacked: two [depth, batch, width] arrays."""
    pre, post = [], []
    for i in range(depth):
        p = params[f"Dense_{i}"]
        h = x @ p["kernel"] + p["bias"]
        x = act(h)
        pre.append(h)
        post.append(x)
    return jnp.stack(pre), jnp.stack(post)


def input_pairs(key, n: int, d: int, c0: float):
    """n pairs (x1, x2) with ||x1||^2 = ||x2||^2 = d and x1 . x2 = c0 d (exactly, up to rounding)."""
    g = jax.random.normal(key, (n, 2, d))
    u = g[:, 0] / jnp.linalg.norm(g[:, 0], axis=-1, keepdims=True)
    v = g[:, 1] - jnp.sum(g[:, 1] * u, axis=-1, keepdims=True) * u
    v = v / jnp.linalg.norm(v, axis=-1, keepdims=True)
    x1 = math.sqrt(d) * u
    x2 = math.sqrt(d) * (c0 * u + math.sqrt(1.0 - c0 * c0) * v)
    return x1, x2


def empirical_maps(solution: Solution, depth: int, n_nets: int, c0s=(0.0, 0.5), seed: int = 0) -> dict:
    """Per-network, per-layer mean q (pre- and post-activation, averaged over the inputs) and the
    output cosine similarity of N_PAIRS input pairs per c0, for n_nets networks initialized by
    apply_to_params (TAT paper, Appendix E.1)."""
    mapping = {layer.id: f"Dense_{int(layer.id.split('_')[1])}" for layer in solution.layers}
    act = sjax.transformed_activation(solution)
    fwd = jax.jit(lambda p, x: mlp_forward(p, x, act, depth))
    blank = blank_params(depth)
    q_pre, q_post, q0_pre, cos = [], [], [], {c0: [] for c0 in c0s}
    key = jax.random.PRNGKey(seed)
    for _net in range(n_nets):
        key, kinit, kdata = jax.random.split(key, 3)
        params, report = sjax.apply_to_params(blank, solution, mapping, kinit)
        assert report.ok, str(report)
        assert len(report.changed) == 2 * depth
        qp, qa = [], []
        for j, c0 in enumerate(c0s):
            x1, x2 = input_pairs(jax.random.fold_in(kdata, j), N_PAIRS, D_IN, c0)
            pre, post = fwd(params, jnp.concatenate([x1, x2]))
            qp.append(np.asarray(jnp.mean(pre * pre, axis=(1, 2))))
            qa.append(np.asarray(jnp.mean(post * post, axis=(1, 2))))
            q0_pre.append(np.asarray(jnp.mean(pre[0] * pre[0], axis=-1)))  # per input, first layer
            y1, y2 = post[-1, :N_PAIRS], post[-1, N_PAIRS:]
            c = jnp.sum(y1 * y2, -1) / (jnp.linalg.norm(y1, axis=-1) * jnp.linalg.norm(y2, axis=-1))
            cos[c0].append(np.asarray(c))
        q_pre.append(np.mean(qp, axis=0))
        q_post.append(np.mean(qa, axis=0))
    return {
        "q_pre": np.asarray(q_pre),
        "q_post": np.asarray(q_post),
        "q0_pre": np.concatenate(q0_pre),
        "cos": {c0: float(np.mean(v)) for c0, v in cos.items()},
        "cos_std": {c0: float(np.std(np.mean(v, axis=1))) for c0, v in cos.items()},
    }


def predicted_c(solution: Solution, c0: float) -> float:
    cm = solution.c_map
    return float(np.interp(c0, cm.c, cm.global_))


def _check_appendix_e1(solution: Solution, depth: int, n_nets: int) -> dict:
    """q near 1 and the output cosine similarity on the answer's global C map.

    q: at finite width each network's q performs a multiplicative random walk around the Q map's
    fixed point (for TReLU q is a martingale with mean exactly 1; its spread across networks
    grows with depth, ~0.4 at layer 50 of a width-256 TReLU net), so the theory predicts the
    mean over networks. Checked: the first layer keeps every input's q exactly (the scale-
    corrected 128 -> 256 SUO layer); the average over layers of the mean q is within 10% of 1;
    and every layer's mean q is within 10% of 1, or -- where the network-to-network spread makes
    10% finer than the sampling error of n_nets networks -- within 4 standard errors.
    """
    emp = empirical_maps(solution, depth, n_nets)
    summary = {"max|q0_pre-1| (per input)": float(np.max(np.abs(emp["q0_pre"] - 1.0)))}
    for which in ("q_pre", "q_post"):
        q = emp[which]
        mean, sem = q.mean(axis=0), q.std(axis=0, ddof=1) / math.sqrt(n_nets)
        summary[f"mean {which} over layers"] = float(mean.mean())
        summary[f"max|{which}-1| per layer"] = float(np.max(np.abs(mean - 1.0)))
        summary[f"{which} std over nets, last layer"] = float(q[:, -1].std(ddof=1))
        assert abs(mean.mean() - 1.0) < 0.10, mean
        bound = np.maximum(0.10, 4.0 * sem)
        assert np.all(np.abs(mean - 1.0) < bound), (which, mean, sem)
    for c0 in emp["cos"]:
        summary[f"c({c0}) empirical"] = emp["cos"][c0]
        summary[f"c({c0}) answer"] = predicted_c(solution, c0)
        summary[f"c({c0}) std over nets"] = emp["cos_std"][c0]
    print(
        f"\n{solution.activation} depth {depth}, {n_nets} nets x {N_PAIRS} pairs: "
        + ", ".join(f"{k} {v:.4f}" for k, v in summary.items())
    )
    assert summary["max|q0_pre-1| (per input)"] < 1e-4
    for c0 in emp["cos"]:
        assert abs(emp["cos"][c0] - predicted_c(solution, c0)) < 0.05, summary
    return summary


# -m slow: 39 s loaded; the Flax MLP diagnose tests and the torch depth-50 MLP cover it by default
@pytest.mark.slow
def test_trelu_mlp_depth_50_matches_the_answer(trelu):
    """TReLU, eta = 0.9: the global C map at 0 is eta; the empirical network follows it (E.1)."""
    assert trelu.negative_slope is not None and trelu.output_scale is not None
    assert [layer.id for layer in trelu.layers] == [f"fc_{i}" for i in range(50)]
    assert trelu.layers[0].gain == pytest.approx(math.sqrt(WIDTH / D_IN))
    assert predicted_c(trelu, 0.0) == pytest.approx(0.9, abs=1e-9)
    summary = _check_appendix_e1(trelu, 50, n_nets=48)
    assert abs(summary["c(0.0) empirical"] - 0.9) < 0.05


def test_smooth_tat_softplus_depth_20_matches_the_answer(tat_softplus):
    sol = tat_softplus
    assert None not in (sol.input_scale, sol.input_shift, sol.output_scale, sol.output_shift)
    summary = _check_appendix_e1(sol, 20, n_nets=12)
    # smooth TAT keeps q much tighter: every layer within 10%, no allowance needed
    assert summary["max|q_post-1| per layer"] < 0.10 and summary["max|q_pre-1| per layer"] < 0.10


# -- the transformed activation -------------------------------------------------------------------

_PARAMS = {"negative_slope": 0.23, "tau": 0.4, "m": 1.7}
_TRANSFORMS = [
    {},
    {"input_scale": 0.71, "input_shift": 0.3, "output_scale": 1.37, "output_shift": -0.21},
    {"input_scale": 2.5, "input_shift": -0.8, "output_scale": 0.6, "output_shift": 0.45},
]


def _fake_solution(name: str, **fields) -> Solution:
    return Solution(key="0" * 64, engine_version="test", method="tat", activation=name, targets={}, **fields)


def _engine_phi(sol: Solution):
    spec_params = dict(get_activation(sol.activation).params)
    p = {k: getattr(sol, k) for k in spec_params if getattr(sol, k, None) is not None}
    tr = {
        k: getattr(sol, k)
        for k in ("input_scale", "input_shift", "output_scale", "output_shift")
        if getattr(sol, k) is not None
    }
    return transformed(get_activation(sol.activation, **p), **tr)


def _check_against_engine(sol: Solution) -> tuple[float, float]:
    """phi_hat (jitted, float32) vs the engine's float64 values at the same float32 points, and
    jax.grad(phi_hat) vs the engine's exact phi_hat' (kinks included: one-sided conventions)."""
    ref = _engine_phi(sol)
    x = np.concatenate([np.linspace(-6.0, 6.0, 4001), np.asarray(ref.kinks)]).astype(np.float32)
    phi = jax.jit(sjax.transformed_activation(sol))
    got = np.asarray(phi(jnp.asarray(x)))
    assert got.dtype == np.float32
    want = ref.fn(x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=sol.activation)
    # phi_hat' on the same points, except within float32 rounding of a kink (where float32 and
    # float64 may put the point on different sides; the conventions at the kinks themselves are
    # checked with exactly representable parameters in test_one_sided_derivatives_at_kinks)
    away = np.all(np.abs(x[:, None] - np.asarray(ref.kinks, np.float64)[None, :]) > 1e-5, axis=1)
    dphi = jax.jit(jax.vmap(jax.grad(sjax.transformed_activation(sol))))
    dgot = np.asarray(dphi(jnp.asarray(x[away])))
    dwant = ref.d1(x[away].astype(np.float64))
    np.testing.assert_allclose(dgot, dwant, rtol=1e-5, atol=1e-5, err_msg=sol.activation)
    return float(np.max(np.abs(got - want))), float(np.max(np.abs(dgot - dwant)))


def test_activation_names_match_the_engine():
    assert set(sjax.ACTIVATIONS) == set(ACTIVATION_NAMES)


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_transformed_activation_matches_engine(name):
    takes = dict(get_activation(name).params)
    errs = []
    for tr in _TRANSFORMS:
        sol = _fake_solution(name, **{k: v for k, v in _PARAMS.items() if k in takes}, **tr)
        errs.append(_check_against_engine(sol))
    print(f"{name}: max |phi err| {max(e[0] for e in errs):.2e}, max |phi' err| {max(e[1] for e in errs):.2e}")


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_one_sided_derivatives_at_kinks(name):
    """jax.grad at the kinks takes the engine's (PyTorch's) one-sided value: relu'(0) = 0,
    leaky_relu'(0) = negative_slope, elu'(0) = alpha, relu_tau'(tau) = 0, ... Parameters are
    exactly representable in float32 so the kinks are exact points."""
    takes = dict(get_activation(name).params)
    params = {k: v for k, v in {"negative_slope": 0.25, "tau": 0.5, "m": 1.5}.items() if k in takes}
    for tr in ({}, {"input_scale": 2.0, "input_shift": -0.5, "output_scale": 1.5, "output_shift": 0.25}):
        sol = _fake_solution(name, **params, **tr)
        ref = _engine_phi(sol)
        x = np.asarray(sorted(set(ref.kinks) | {0.0}), np.float32)
        assert np.array_equal(x.astype(np.float64), np.asarray(sorted(set(ref.kinks) | {0.0})))
        got = np.asarray(jax.vmap(jax.grad(sjax.transformed_activation(sol)))(jnp.asarray(x)))
        np.testing.assert_allclose(got, ref.d1(x.astype(np.float64)), rtol=1e-6, atol=1e-7, err_msg=f"{name} {tr}")
        np.testing.assert_allclose(
            np.asarray(sjax.transformed_activation(sol)(x)), ref.fn(x.astype(np.float64)), rtol=1e-6, atol=1e-7
        )


def test_transformed_activation_of_live_answers(trelu, tat_softplus, service):
    crelu = solve(
        service,
        {
            "graph": {"template": "mlp", "depth": 10, "width": 64},
            "method": "sparse_eoc",
            "activation": "crelu",
            "targets": {"sparsity": 0.7, "v_slope": 0.5},
        },
    )
    assert crelu.tau is not None and crelu.m is not None
    for sol in (trelu, tat_softplus, crelu):
        _check_against_engine(sol)
    # the dks convention, spelled out for TReLU: output_scale * leaky_relu(x)
    phi = sjax.transformed_activation(trelu)
    s, a = trelu.negative_slope, trelu.output_scale
    x = jnp.asarray([-2.0, -0.5, 0.0, 0.5, 2.0])
    np.testing.assert_allclose(np.asarray(phi(x)), a * np.where(x > 0, x, s * np.asarray(x)), rtol=1e-6)


def test_transformed_activation_is_traceable_and_name_override():
    sol = _fake_solution("softplus", input_scale=0.5, input_shift=0.1, output_scale=2.0, output_shift=-0.7)
    phi = sjax.transformed_activation(sol)
    x = jnp.linspace(-3.0, 3.0, 7)
    np.testing.assert_allclose(np.asarray(jax.jit(phi)(x)), np.asarray(phi(x)), rtol=1e-6)
    # second derivative: the engine's exact phi_hat''
    d2 = jax.vmap(jax.grad(jax.grad(phi)))(x)
    np.testing.assert_allclose(np.asarray(d2), _engine_phi(sol).d2(np.asarray(x, np.float64)), rtol=1e-5, atol=1e-6)
    # name= uses another activation with the answer's transformation; dicts and JSON are accepted
    tanh_hat = sjax.transformed_activation(sol.model_dump(by_alias=True), name="tanh")
    np.testing.assert_allclose(np.asarray(tanh_hat(x)), 2.0 * (np.tanh(0.5 * np.asarray(x) + 0.1) - 0.7), rtol=1e-6)
    silu = sjax.transformed_activation(sol.to_json(), name="silu")
    np.testing.assert_allclose(np.asarray(silu(x)), np.asarray(sjax.transformed_activation(sol, name="swish")(x)))
    assert sjax.transformed_activation(sol)(jnp.asarray(1.0, jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown activation"):
        sjax.transformed_activation(sol, name="nope")


# -- initializers ---------------------------------------------------------------------------------


def _orthogonality_error(kernel, gain: float) -> float:
    """With W = kernel^T (out x in): |W W^T - gain^2 I| if in >= out, |W^T W - gain^2 I| otherwise."""
    w = np.asarray(kernel, np.float64).T
    n_out, n_in = w.shape
    g = w @ w.T if n_in >= n_out else w.T @ w
    return float(np.max(np.abs(g - gain * gain * np.eye(g.shape[0]))))


@pytest.mark.parametrize("shape", [(256, 64), (64, 256), (128, 128), (300, 7)])
@pytest.mark.parametrize("gain", [1.0, 1.7])
def test_suo_dense_kernel_is_scaled_orthogonal(shape, gain):
    init = sjax.scaled_uniform_orthogonal(gain)
    k = init(jax.random.PRNGKey(1), shape)
    assert k.shape == shape and k.dtype == jnp.float32
    assert _orthogonality_error(k, gain) < 1e-5 * gain * gain
    # jittable with a static shape, and the same draw
    kj = jax.jit(init, static_argnums=1)(jax.random.PRNGKey(1), shape)
    np.testing.assert_allclose(np.asarray(kj), np.asarray(k), atol=1e-6)
    assert init(jax.random.PRNGKey(1), shape, jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("shape", [(3, 3, 32, 64), (5, 5, 64, 16), (3, 1, 8, 8), (3, 16, 16)])
def test_orthogonal_delta_conv_kernel(shape):
    gain = 1.3
    k = np.asarray(sjax.scaled_uniform_orthogonal(gain, delta=True)(jax.random.PRNGKey(2), shape))
    centre = tuple((s - 1) // 2 for s in shape[:-2])
    off = k.copy()
    off[centre] = 0.0
    assert np.count_nonzero(off) == 0  # exactly zero off-centre
    assert _orthogonality_error(k[centre], gain) < 1e-5 * gain * gain
    # delta=False: the whole kernel, flattened to [prod(spatial) * in, out], is one SUO matrix
    full = np.asarray(sjax.scaled_uniform_orthogonal(gain, delta=False)(jax.random.PRNGKey(2), shape))
    assert np.count_nonzero(full) == full.size
    assert _orthogonality_error(full.reshape(-1, shape[-1]), gain) < 1e-5 * gain * gain
    with pytest.raises(ValueError, match="odd"):
        sjax.scaled_uniform_orthogonal(gain)(jax.random.PRNGKey(0), (2, 2, 4, 4))


def _dks_sampling_module():
    """dks.jax.parameter_sampling_functions, loaded from its file (it imports the long-removed
    ``jax.config`` module, which a shim provides while it loads)."""
    spec = importlib.util.find_spec("dks")
    if spec is None or not spec.origin:
        pytest.skip("dks is not installed")
    path = Path(spec.origin).parent / "jax" / "parameter_sampling_functions.py"
    shim = types.ModuleType("jax.config")
    shim.config = jax.config
    saved = sys.modules.get("jax.config")
    sys.modules["jax.config"] = saved or shim
    try:
        s = importlib.util.spec_from_file_location("_dks_parameter_sampling_functions", path)
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
    finally:
        if saved is None:
            sys.modules.pop("jax.config", None)
    return mod


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (32, 32), (3, 3, 16, 32), (3, 3, 32, 16), (1, 5, 8, 8)])
@pytest.mark.parametrize("delta", [True, False])
def test_scale_corrected_suo_equals_dks_reference(shape, delta):
    dks = _dks_sampling_module()
    key = jax.random.PRNGKey(7)
    want = dks.scaled_uniform_orthogonal(key, shape, scale=1.3, delta=delta)
    got = sjax.scaled_uniform_orthogonal(1.3, delta, scale_corrected=True)(key, shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_initializer_for_each_distribution_and_gaussian():
    key = jax.random.PRNGKey(3)
    suo = LayerInit(
        id="d",
        node=1,
        op="dense",
        fan_in=64,
        fan_out=256,
        distribution="scaled_uniform_orthogonal",
        gain=2.0,
        weight_variance=1 / 64,
        bias="zeros",
    )
    k = sjax.initializer_for(suo)(key, (64, 256))
    assert _orthogonality_error(k, 2.0) < 1e-4
    delta = LayerInit(
        id="c",
        node=2,
        op="conv",
        fan_in=16,
        fan_out=16,
        kernel=[3, 3],
        distribution="orthogonal_delta",
        gain=1.0,
        weight_variance=1 / 16,
        bias="zeros",
    )
    k = np.asarray(sjax.initializer_for(delta.model_dump())(key, (3, 3, 16, 16)))
    assert np.count_nonzero(k[0]) == 0 and _orthogonality_error(k[1, 1], 1.0) < 1e-5
    gauss = LayerInit(
        id="g",
        node=3,
        op="dense",
        fan_in=400,
        fan_out=300,
        distribution="gaussian",
        gain=0.05,
        weight_variance=0.0025,
        bias="gaussian",
        bias_variance=0.04,
    )
    k = np.asarray(sjax.initializer_for(gauss)(key, (400, 300)))
    assert abs(k.std() - 0.05) < 0.05 * 0.02 and abs(k.mean()) < 1e-3
    b = np.asarray(sjax.bias_initializer_for(gauss)(key, (100_000,)))
    assert abs(b.std() - 0.2) < 0.2 * 0.02
    assert np.count_nonzero(np.asarray(sjax.bias_initializer_for(suo)(key, (10,)))) == 0
    g = np.asarray(sjax.gaussian(3.0)(key, (200_000,), jnp.float32))
    assert abs(g.std() - 3.0) < 3.0 * 0.01


# -- apply_to_params ------------------------------------------------------------------------------


def test_apply_to_params_reports_missing_paths_and_uncovered_kernels(trelu):
    params = blank_params(50)
    params["Extra_0"] = {"kernel": jnp.ones((WIDTH, 10)), "bias": jnp.ones((10,))}
    mapping = {f"fc_{i}": f"Dense_{i}" for i in range(48)}
    mapping["fc_48"] = "Dense_99"  # not in the tree
    mapping["nonexistent_layer"] = "Dense_49"  # not a layer of the answer
    before = {k: {n: np.asarray(v) for n, v in d.items()} for k, d in params.items()}
    new, report = sjax.apply_to_params(params, trelu, mapping, jax.random.PRNGKey(0))
    print("\n" + "\n".join(line for line in str(report).splitlines() if "<-" not in line))
    assert not report.ok
    assert report.not_found == [("fc_48", ("Dense_99",), "no such path in the params tree")]
    assert report.unknown_ids == ["nonexistent_layer"]
    assert report.unmapped_layers == ["fc_49"]
    assert set(report.uncovered_kernels) == {("Dense_48", "kernel"), ("Dense_49", "kernel"), ("Extra_0", "kernel")}
    assert len(report.changed) == 2 * 48
    assert {c.path for c in report.changed} == {(f"Dense_{i}", n) for i in range(48) for n in ("kernel", "bias")}
    # the input tree is untouched; the output shares what was not re-initialized
    for k, d in params.items():
        for n, v in d.items():
            np.testing.assert_array_equal(np.asarray(v), before[k][n])
    assert np.count_nonzero(np.asarray(params["Dense_0"]["kernel"])) == 0
    assert new["Extra_0"] is params["Extra_0"] and new["Dense_49"] is params["Dense_49"]
    assert _orthogonality_error(new["Dense_0"]["kernel"], math.sqrt(2.0)) < 1e-5 * 2
    assert _orthogonality_error(new["Dense_1"]["kernel"], 1.0) < 1e-5
    assert np.count_nonzero(np.asarray(new["Dense_1"]["bias"])) == 0


def test_apply_to_params_paths_shapes_and_determinism(trelu):
    sol = trelu.model_copy(
        update={
            "layers": [
                trelu.layers[0],
                trelu.layers[1].model_copy(update={"id": "enc", "bias": "gaussian", "bias_variance": 0.01}),
                trelu.layers[2].model_copy(update={"id": "haiku"}),
                trelu.layers[3].model_copy(update={"id": "bad_shape"}),
            ]
        }
    )
    variables = {
        "params": {
            "Dense_0": {"kernel": jax.ShapeDtypeStruct((D_IN, WIDTH), jnp.bfloat16), "bias": jnp.zeros((WIDTH,))},
            "Encoder_0": {"Dense_1": {"kernel": jnp.zeros((WIDTH, WIDTH)), "bias": jnp.zeros((WIDTH,))}},
            "mlp/~/linear_2": {"w": jnp.zeros((WIDTH, WIDTH)), "b": jnp.zeros((WIDTH,))},
            "Dense_3": {"kernel": jnp.zeros((WIDTH, 128))},
        }
    }
    mapping = {
        "fc_0": "Dense_0",
        "enc": ("Encoder_0", "Dense_1"),
        "haiku": "mlp/~/linear_2",
        "bad_shape": "params/Dense_3/kernel",
    }
    new, report = sjax.apply_to_params(variables, sol, mapping, jax.random.PRNGKey(5))
    print(report)
    p = new["params"]
    assert p["Dense_0"]["kernel"].dtype == jnp.bfloat16 and p["Dense_0"]["kernel"].shape == (D_IN, WIDTH)
    assert _orthogonality_error(p["Encoder_0"]["Dense_1"]["kernel"], 1.0) < 1e-5
    assert abs(float(np.std(np.asarray(p["Encoder_0"]["Dense_1"]["bias"]))) - 0.1) < 0.03
    assert _orthogonality_error(p["mlp/~/linear_2"]["w"], 1.0) < 1e-5
    assert [m[0] for m in report.shape_mismatches] == ["bad_shape"]
    assert report.shape_mismatches[0][1] == ("params", "Dense_3", "kernel")
    assert p["Dense_3"] is variables["params"]["Dense_3"]
    assert report.uncovered_kernels == [("params", "Dense_3", "kernel")]
    assert not report.not_found and not report.unknown_ids
    # a pure function of the key
    again, _ = sjax.apply_to_params(variables, sol, mapping, jax.random.PRNGKey(5))
    np.testing.assert_array_equal(
        np.asarray(again["params"]["mlp/~/linear_2"]["w"]), np.asarray(p["mlp/~/linear_2"]["w"])
    )
    other, _ = sjax.apply_to_params(variables, sol, mapping, jax.random.PRNGKey(6))
    assert not np.array_equal(np.asarray(other["params"]["mlp/~/linear_2"]["w"]), np.asarray(p["mlp/~/linear_2"]["w"]))
    # traceable: the same tree under jax.jit (shapes and the mapping are static, the key is traced)
    jitted = jax.jit(lambda k: sjax.apply_to_params(variables, sol, mapping, k)[0])(jax.random.PRNGKey(5))
    np.testing.assert_allclose(
        np.asarray(jitted["params"]["mlp/~/linear_2"]["w"]), np.asarray(p["mlp/~/linear_2"]["w"]), atol=1e-6
    )


def test_import_without_jax_names_the_extra():
    code = (
        "import sys\n"
        "sys.modules['jax'] = None\n"
        "try:\n"
        "    import sigprop.client.jax\n"
        "except ImportError as e:\n"
        "    print('IMPORTERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "IMPORTERROR" in out.stdout and "pip install 'sigprop[jax]'" in out.stdout, out.stdout
