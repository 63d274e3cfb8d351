"""Activation registry: values, exact derivatives, kinks, numerical stability, transforms."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from sigprop.engine.maps.activations import (
    ACTIVATION_NAMES,
    PIECEWISE_LINEAR_ACTIVATIONS,
    SELU_ALPHA,
    SELU_LAMBDA,
    SMOOTH_ACTIVATIONS,
    Activation,
    get_activation,
    transformed,
)
from sigprop.errors import SigpropError

# Parameter sets that exercise each parameterised activation away from its defaults too
# (m < tau included: the paper's own configurations, e.g. s = 0.85, have m < tau).
PARAM_CASES = [(n, {}) for n in ACTIVATION_NAMES] + [
    ("leaky_relu", {"negative_slope": 0.2}),
    ("leaky_relu", {"negative_slope": -0.5}),
    ("elu", {"alpha": 0.7}),
    ("relu_tau", {"tau": 0.35}),
    ("soft_threshold", {"tau": 0.6}),
    ("crelu", {"tau": 0.25, "m": 1.22}),
    ("crelu", {"tau": 1.5, "m": 0.4}),
    ("cst", {"tau": 0.67, "m": 0.97}),
    ("cst", {"tau": 1.2, "m": 0.3}),
]


def _case_id(case):
    name, params = case
    return name + "".join(f"-{k}={v}" for k, v in params.items())


GRID = np.concatenate([np.linspace(-6.0, 6.0, 481), [-15.0, -9.5, 9.5, 15.0]])


def _away_from_kinks(x, kinks, margin=1e-3):
    keep = np.ones(x.shape, dtype=bool)
    for k in kinks:
        keep &= np.abs(x - k) > margin
    return x[keep]


def _check_derivatives(act: Activation, x: np.ndarray):
    x = _away_from_kinks(x, act.kinks)
    assert x.size > 100
    h1, h2 = 1e-5, 1e-4
    fd1 = (act.fn(x + h1) - act.fn(x - h1)) / (2 * h1)
    np.testing.assert_allclose(act.d1(x), fd1, rtol=1e-5, atol=1e-8, err_msg=f"{act.name} d1")
    # phi'' against the difference of phi' (tight) and the second difference of phi (looser)
    fd2 = (act.d1(x + h2) - act.d1(x - h2)) / (2 * h2)
    np.testing.assert_allclose(act.d2(x), fd2, rtol=1e-5, atol=1e-8, err_msg=f"{act.name} d2")
    fd2b = (act.fn(x + h2) - 2 * act.fn(x) + act.fn(x - h2)) / (h2 * h2)
    np.testing.assert_allclose(act.d2(x), fd2b, rtol=1e-4, atol=2e-5, err_msg=f"{act.name} d2b")


@pytest.mark.parametrize("case", PARAM_CASES, ids=_case_id)
def test_derivatives_match_finite_differences(case):
    name, params = case
    _check_derivatives(get_activation(name, **params), GRID)


# --------------------------------------------------------------------------- reference values

_SQ2 = math.sqrt(2.0)


def _ref(name, x):
    e = math.exp
    return {
        "tanh": lambda: math.tanh(x),
        "sigmoid": lambda: 1.0 / (1.0 + e(-x)),
        "softplus": lambda: math.log1p(e(x)),
        "erf": lambda: math.erf(x),
        "atan": lambda: math.atan(x),
        "asinh": lambda: math.asinh(x),
        "softsign": lambda: x / (1.0 + abs(x)),
        "bentid": lambda: (math.sqrt(x * x + 1.0) - 1.0) / 2.0 + x,
        "swish": lambda: x / (1.0 + e(-x)),
        "silu": lambda: x / (1.0 + e(-x)),
        "gelu": lambda: 0.5 * x * (1.0 + math.erf(x / _SQ2)),
        "gelu_tanh": lambda: 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
        "elu": lambda: x if x > 0 else e(x) - 1.0,
        "selu": lambda: SELU_LAMBDA * (x if x > 0 else SELU_ALPHA * (e(x) - 1.0)),
        "relu": lambda: max(x, 0.0),
        "leaky_relu": lambda: x if x > 0 else 0.01 * x,
        # defaults tau = 1, m = 1
        "relu_tau": lambda: x - 1.0 if x > 1.0 else 0.0,
        "soft_threshold": lambda: math.copysign(abs(x) - 1.0, x) if abs(x) > 1.0 else 0.0,
        "crelu": lambda: 0.0 if x < 1.0 else min(x - 1.0, 1.0),
        "cst": lambda: 0.0 if abs(x) < 1.0 else math.copysign(min(abs(x) - 1.0, 1.0), x),
    }[name]()


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_values_match_reference_formulas(name):
    act = get_activation(name)
    pts = [-3.7, -2.0, -1.0, -0.4, 0.0, 0.3, 1.0, 1.6, 2.5, 4.2]
    got = act.fn(np.array(pts))
    want = np.array([_ref(name, p) for p in pts])
    np.testing.assert_allclose(got, want, rtol=2e-15, atol=5e-16)


def test_spot_values():
    assert get_activation("gelu").fn(1.0) == pytest.approx(0.8413447460685429, rel=1e-15)
    assert get_activation("gelu").fn(-1.0) == pytest.approx(-0.15865525393145707, rel=1e-14)
    assert get_activation("softplus").fn(0.0) == pytest.approx(math.log(2.0), rel=1e-15)
    assert get_activation("selu").fn(-1.0) == pytest.approx(-1.1113307378125628, rel=1e-15)
    assert get_activation("selu").fn(1.0) == pytest.approx(SELU_LAMBDA, rel=1e-15)
    assert get_activation("gelu_tanh").fn(1.0) == pytest.approx(0.8411919906082768, rel=1e-14)
    assert get_activation("sigmoid").fn(0.0) == 0.5
    assert get_activation("bentid").fn(0.0) == 0.0
    # exact derivative values
    gelu = get_activation("gelu")
    assert gelu.d1(0.0) == 0.5
    assert gelu.d2(0.0) == pytest.approx(2.0 / math.sqrt(2.0 * math.pi), rel=1e-15)
    assert get_activation("sigmoid").d1(0.0) == 0.25
    assert get_activation("tanh").d1(0.0) == 1.0
    assert get_activation("erf").d1(0.0) == pytest.approx(2.0 / math.sqrt(math.pi), rel=1e-15)
    assert get_activation("swish").d1(0.0) == 0.5
    assert get_activation("swish").d2(0.0) == 0.5
    assert get_activation("bentid").d2(0.0) == 0.5
    assert get_activation("gelu_tanh").d2(0.0) == pytest.approx(math.sqrt(2 / math.pi), 1e-15)
    assert get_activation("elu").d2(-1.0) == pytest.approx(math.exp(-1.0), rel=1e-15)
    # one-sided values at the kinks follow PyTorch autograd
    assert get_activation("relu").d1(0.0) == 0.0
    assert get_activation("leaky_relu").d1(0.0) == 0.01
    assert get_activation("selu").d1(0.0) == pytest.approx(SELU_LAMBDA * SELU_ALPHA, rel=1e-15)
    assert get_activation("selu").d1(1e-12) == pytest.approx(SELU_LAMBDA, rel=1e-15)


def test_sparsifying_definitions_paper_eqs_7_to_10():
    x = np.array([-3.0, -1.9, -1.2, -0.5, 0.0, 0.5, 1.2, 1.9, 3.0])
    tau, m = 0.7, 1.0
    np.testing.assert_array_equal(get_activation("relu_tau", tau=tau).fn(x), np.where(x > tau, x - tau, 0.0))
    np.testing.assert_array_equal(
        get_activation("soft_threshold", tau=tau).fn(x), np.where(np.abs(x) > tau, x - np.sign(x) * tau, 0.0)
    )
    np.testing.assert_array_equal(
        get_activation("crelu", tau=tau, m=m).fn(x), np.where(x < tau, 0.0, np.where(x < tau + m, x - tau, m))
    )
    np.testing.assert_array_equal(
        get_activation("cst", tau=tau, m=m).fn(x),
        np.where(np.abs(x) < tau, 0.0, np.where(np.abs(x) < tau + m, x - np.sign(x) * tau, np.sign(x) * m)),
    )
    np.testing.assert_array_equal(get_activation("cst", tau=tau, m=m).d1(x), [0, 0, 1, 0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(get_activation("crelu", tau=tau, m=m).d1(x), [0, 0, 0, 0, 0, 0, 1, 0, 0])


def test_tails_keep_relative_accuracy():
    x = np.array([-40.0, -30.0])
    np.testing.assert_allclose(get_activation("sigmoid").fn(x), np.exp(x) / (1 + np.exp(x)), rtol=1e-14)
    np.testing.assert_allclose(get_activation("softplus").fn(x), np.log1p(np.exp(x)), rtol=1e-14)
    np.testing.assert_allclose(get_activation("tanh").d1(-x), 4 * np.exp(2 * x) / (1 + np.exp(2 * x)) ** 2, rtol=1e-13)
    np.testing.assert_allclose(get_activation("swish").fn(x), x * np.exp(x) / (1 + np.exp(x)), rtol=1e-14)
    assert get_activation("gelu").fn(-30.0) < 0.0  # not flushed to zero by 1 + erf cancellation
    assert get_activation("bentid").fn(1e-9) == pytest.approx(1e-9 + 2.5e-19, rel=1e-15)


# --------------------------------------------------------------------------- stability

EXTREME = np.array([-1e3, -700.0, -500.0, -100.0, -37.0, -1.0, 0.0, 1.0, 37.0, 100.0, 500.0, 700.0, 1e3])
TINY = np.array([-1e-300, -5e-324, 5e-324, 1e-300])


@pytest.mark.parametrize("case", PARAM_CASES, ids=_case_id)
def test_no_warnings_and_finite_at_large_inputs(case):
    name, params = case
    act = get_activation(name, **params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # large inputs: not even an underflow (tails are cut to exact zeros before exp underflows)
        with np.errstate(all="raise"):
            for f in (act.fn, act.d1, act.d2):
                y = f(EXTREME)
                assert y.shape == EXTREME.shape
                assert y.dtype == np.float64
                assert np.all(np.isfinite(y)), (name, f, y)
                for v in (-1e3, 1e3):  # scalars too
                    assert np.isfinite(f(v))
        # denormal-size inputs: x * x underflows harmlessly, nothing else may go wrong
        with np.errstate(over="raise", divide="raise", invalid="raise", under="ignore"):
            for f in (act.fn, act.d1, act.d2):
                assert np.all(np.isfinite(f(TINY)))


def test_asymptotics_at_large_inputs():
    big = 1e3
    assert get_activation("sigmoid").fn(big) == 1.0 and get_activation("sigmoid").fn(-big) == 0.0
    assert get_activation("softplus").fn(big) == big and get_activation("softplus").fn(-big) == 0
    assert get_activation("tanh").d1(big) == 0.0 and get_activation("tanh").d2(-big) == 0.0
    for name in ("swish", "gelu", "gelu_tanh"):
        act = get_activation(name)
        assert act.fn(big) == big and act.fn(-big) == 0.0
        assert act.d1(big) == 1.0 and act.d1(-big) == 0.0
        assert act.d2(big) == 0.0 and act.d2(-big) == 0.0
    assert get_activation("elu").fn(-big) == -1.0
    assert get_activation("selu").fn(-big) == pytest.approx(-SELU_LAMBDA * SELU_ALPHA, rel=1e-15)
    assert get_activation("erf").d1(big) == 0.0
    assert get_activation("atan").fn(big) == pytest.approx(math.pi / 2 - 1e-3, rel=1e-9)


# --------------------------------------------------------------------------- kinks and flags


@pytest.mark.parametrize("case", [c for c in PARAM_CASES if c[0] in PIECEWISE_LINEAR_ACTIVATIONS], ids=_case_id)
def test_piecewise_linear_kinks_are_exactly_the_breakpoints(case):
    name, params = case
    act = get_activation(name, **params)
    assert not act.smooth
    x = np.linspace(-5.0, 5.0, 100001)
    np.testing.assert_array_equal(act.d2(x), 0.0)
    d1 = act.d1(x)
    jumps = np.nonzero(np.diff(d1))[0]
    assert len(jumps) == len(act.kinks)  # every breakpoint listed, none invented
    for j, k in zip(jumps, act.kinks, strict=False):
        assert x[j] <= k <= x[j + 1]
    # between kinks phi is linear with slope d1 (the Dirac parts of phi'' are not represented)
    xs = _away_from_kinks(x[::97], act.kinks, margin=1e-3)
    np.testing.assert_allclose(act.fn(xs + 1e-4) - act.fn(xs), 1e-4 * act.d1(xs), atol=1e-15)


def test_expected_kinks():
    assert get_activation("relu").kinks == (0.0,)
    assert get_activation("leaky_relu").kinks == (0.0,)
    assert get_activation("relu_tau", tau=0.4).kinks == (0.4,)
    assert get_activation("soft_threshold", tau=0.4).kinks == (-0.4, 0.4)
    assert get_activation("crelu", tau=0.5, m=2.0).kinks == (0.5, 2.5)
    assert get_activation("cst", tau=0.5, m=2.0).kinks == (-2.5, -0.5, 0.5, 2.5)
    assert get_activation("soft_threshold", tau=0.0).kinks == (0.0,)
    for name in ("elu", "selu", "softsign"):
        act = get_activation(name)
        assert act.kinks == (0.0,) and act.smooth
        assert act.d2(-1e-12) != act.d2(1e-12)  # the second derivative really jumps there
    assert get_activation("selu").d1_continuous is False
    assert get_activation("elu").d1_continuous is True
    assert get_activation("elu", alpha=0.5).d1_continuous is False
    for name in ("tanh", "sigmoid", "softplus", "erf", "atan", "asinh", "bentid", "swish", "gelu", "gelu_tanh"):
        act = get_activation(name)
        assert act.kinks == () and act.smooth and act.d1_continuous


def test_engine_closed_forms_cover_exactly_the_catalogue():
    """The engine writes phi, phi', phi'' for every catalogue entry and takes its name, defaults,
    description and families from the catalogue (sigprop.schemas.activations)."""
    from sigprop.engine.maps.activations import _SPECS
    from sigprop.schemas import activations as catalogue

    assert list(_SPECS) == list(catalogue.CATALOGUE)
    assert ACTIVATION_NAMES == catalogue.ACTIVATION_NAMES
    assert (SELU_ALPHA, SELU_LAMBDA) == (catalogue.SELU_ALPHA, catalogue.SELU_LAMBDA)
    for name, info in catalogue.CATALOGUE.items():
        act = get_activation(name)
        assert dict(act.params) == dict(info.defaults), name
        assert (act.smooth, act.positively_homogeneous, act.description) == (
            info.smooth,
            info.positively_homogeneous,
            info.description,
        ), name
    for alias, name in catalogue.ACTIVATION_ALIASES.items():
        assert get_activation(alias).name == name == catalogue.activation_info(alias).name
    assert set(catalogue.SPARSE_ACTIVATIONS) == {"relu_tau", "soft_threshold", "crelu", "cst"}
    assert catalogue.POSITIVELY_HOMOGENEOUS_ACTIVATIONS == ("relu", "leaky_relu")


def test_registry_flags_and_names():
    smooth = {
        "tanh",
        "sigmoid",
        "softplus",
        "erf",
        "atan",
        "asinh",
        "softsign",
        "bentid",
        "swish",
        "silu",
        "gelu",
        "gelu_tanh",
        "elu",
        "selu",
    }
    rough = {"relu", "leaky_relu", "relu_tau", "soft_threshold", "crelu", "cst"}
    assert set(ACTIVATION_NAMES) == smooth | rough
    assert len(ACTIVATION_NAMES) == len(set(ACTIVATION_NAMES))
    assert set(SMOOTH_ACTIVATIONS) == smooth
    assert set(PIECEWISE_LINEAR_ACTIVATIONS) == rough
    for name in ACTIVATION_NAMES:
        act = get_activation(name)
        assert act.smooth == (name in smooth)
        assert act.positively_homogeneous == (name in {"relu", "leaky_relu"})
        assert act.description
        assert act.kinks == tuple(sorted(act.kinks))
        hash(act)  # frozen, hashable (params is a tuple)
    silu = get_activation("silu")
    assert silu.name == "swish"
    x = np.linspace(-4, 4, 17)
    np.testing.assert_array_equal(silu.fn(x), get_activation("swish").fn(x))
    assert get_activation("leaky_relu", negative_slope=0.3).params == (("negative_slope", 0.3),)
    assert get_activation("crelu").params == (("m", 1.0), ("tau", 1.0))


@pytest.mark.parametrize("name", ["relu", "leaky_relu"])
def test_positive_homogeneity(name):
    act = get_activation(name)
    x = np.linspace(-3, 3, 13)
    for a in (0.0, 0.5, 2.0, 8.0):
        np.testing.assert_array_equal(act.fn(a * x), a * act.fn(x))


def test_shapes_and_scalars():
    act = get_activation("gelu")
    x = np.arange(12.0).reshape(3, 4) - 6
    for f in (act.fn, act.d1, act.d2):
        assert f(x).shape == (3, 4)
        assert np.ndim(f(0.5)) == 0
        assert f([0.5, 1.0]).shape == (2,)
    assert get_activation("relu").d1(np.array([1, -1])).dtype == np.float64  # int input


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", ["foo", "GELU", "", "relu6", None, 3])
def test_unknown_name_raises_unsupported_activation(bad):
    with pytest.raises(SigpropError) as ei:
        get_activation(bad)
    err = ei.value
    assert err.code == "unsupported_activation"
    assert err.status == 422
    for name in ("tanh", "gelu", "leaky_relu", "cst"):
        assert name in err.hint


@pytest.mark.parametrize(
    "name, params",
    [
        ("tanh", {"tau": 1.0}),
        ("relu_tau", {"m": 1.0}),
        ("relu_tau", {"tau": -0.1}),
        ("crelu", {"m": 0.0}),
        ("cst", {"m": -1.0}),
        ("leaky_relu", {"negative_slope": float("nan")}),
        ("elu", {"alpha": float("inf")}),
        ("soft_threshold", {"tau": "abc"}),
    ],
)
def test_bad_parameters_raise_invalid_request(name, params):
    with pytest.raises(SigpropError) as ei:
        get_activation(name, **params)
    assert ei.value.code == "invalid_request"


def test_none_parameters_take_defaults():
    assert get_activation("leaky_relu", negative_slope=None).fn(-1.0) == -0.01
    assert get_activation("tanh", tau=None, m=None).name == "tanh"


# --------------------------------------------------------------------------- transformed

TRANSFORMS = [
    dict(input_scale=1.3, input_shift=0.4, output_scale=2.1, output_shift=-0.3),
    dict(input_scale=-0.8, input_shift=-0.25, output_scale=0.6, output_shift=1.5),
]


@pytest.mark.parametrize("tr", TRANSFORMS, ids=["pos", "neg"])
@pytest.mark.parametrize("case", PARAM_CASES[: len(ACTIVATION_NAMES)], ids=_case_id)
def test_transformed_derivatives_match_finite_differences(case, tr):
    name, params = case
    base = get_activation(name, **params)
    act = transformed(base, **tr)
    a, b, c, d = tr["input_scale"], tr["input_shift"], tr["output_scale"], tr["output_shift"]
    assert act.kinks == tuple(sorted((k - b) / a for k in base.kinks))
    x = np.linspace(-4.0, 4.0, 161)
    np.testing.assert_array_equal(act.fn(x), c * (base.fn(a * x + b) + d))
    _check_derivatives(act, x)


def test_transformed_kinks_flags_and_identity():
    st = get_activation("soft_threshold", tau=0.7)
    t = transformed(st, input_scale=-2.0, input_shift=0.3)
    assert t.kinks == pytest.approx((-0.2, 0.5), abs=1e-15)
    assert transformed(st, input_scale=0.0, input_shift=0.3).kinks == ()
    const = transformed(get_activation("tanh"), input_scale=0.0, input_shift=0.3, output_scale=2)
    np.testing.assert_array_equal(const.fn(np.array([-5.0, 0.0, 7.0])), 2 * np.tanh(0.3))
    np.testing.assert_array_equal(const.d1(np.array([-5.0, 7.0])), 0.0)
    relu = get_activation("relu")
    assert transformed(relu, input_scale=3.0, output_scale=0.5).positively_homogeneous
    assert not transformed(relu, input_shift=0.1).positively_homogeneous
    assert not transformed(relu, output_shift=0.1).positively_homogeneous
    x = np.linspace(-3, 3, 25)
    gelu = get_activation("gelu")
    ident = transformed(gelu)
    assert ident.kinks == gelu.kinks and ident.smooth and ident.name == "gelu"
    for f, g in zip((ident.fn, ident.d1, ident.d2), (gelu.fn, gelu.d1, gelu.d2), strict=False):
        np.testing.assert_array_equal(f(x), g(x))
    with pytest.raises(SigpropError) as ei:
        transformed(relu, input_scale=float("nan"))
    assert ei.value.code == "invalid_request"


def test_transformed_stable_at_large_inputs():
    act = transformed(get_activation("gelu_tanh"), 1.7, -0.3, 1.2, 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            for f in (act.fn, act.d1, act.d2):
                assert np.all(np.isfinite(f(EXTREME)))


# --------------------------------------------------------------------------- reference package

_DKS_NAMES = {
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "softplus": "softplus",
    "erf": "erf",
    "atan": "atan",
    "asinh": "asinh",
    "softsign": "softsign",
    "bentid": "bentid",
    "swish": "swish",
    "gelu": "gelu_exact",
    "gelu_tanh": "gelu",
    "elu": "elu",
    "selu": "selu",
    "relu": "relu",
    "leaky_relu": "leaky_relu",
}


@pytest.mark.parametrize("name", sorted(_DKS_NAMES))
def test_matches_dks_reference_with_autograd_derivatives(name):
    getter = pytest.importorskip("dks.base.activation_getter")
    autograd = pytest.importorskip("autograd")
    ref = getter.get_activation_function(_DKS_NAMES[name])
    ref1 = autograd.elementwise_grad(ref)
    ref2 = autograd.elementwise_grad(ref1)
    act = get_activation(name)
    x = _away_from_kinks(np.linspace(-5.0, 5.0, 101) + 0.013, act.kinks)
    with warnings.catch_warnings():
        # autograd notes that phi'' of a piecewise-linear function does not depend on x
        warnings.filterwarnings("ignore", "Output seems independent of input", UserWarning)
        want = ref(x), ref1(x), ref2(x)
    np.testing.assert_allclose(act.fn(x), want[0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(act.d1(x), want[1], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(act.d2(x), want[2], rtol=1e-11, atol=1e-14)
