"""Scalar activation functions with exact analytic first and second derivatives.

Every activation is a plain numpy function of an array, vectorized elementwise, together with its
derivatives ``phi'`` and ``phi''`` written out in closed form (no autodiff, no finite differences).
The formulas are arranged so that nothing overflows, divides by zero or produces NaN for inputs
up to ``|x| = 1e3`` and well beyond: exponentials only ever see ``-|x|``-type arguments (or are
expressed through :func:`scipy.special.expit` / :func:`scipy.special.ndtr`), Gaussian densities
are cut to exactly 0 before they would underflow, and ``sqrt(1 + x^2)`` is taken with ``hypot``.

Names, parameters and their defaults, aliases, constants and families come from the activation
catalogue, ``sigprop.schemas.activations``; this module holds the closed forms only. Names follow
PyTorch (the wire contract): ``gelu`` is the exact erf form ``x * Phi(x)``, ``gelu_tanh`` the tanh
approximation, ``swish`` is ``x * sigmoid(x)`` (alias ``silu``).

The sparsifying activations follow Price et al., "Deep neural network initialization with
sparsity inducing activations", equations (7)-(10):

- ``relu_tau``:        ``x - tau`` for ``x > tau``, else 0                              (7)
- ``soft_threshold``:  ``x - sign(x) tau`` for ``|x| > tau``, else 0                    (8)
- ``crelu``:           0 for ``x < tau``, ``x - tau`` on ``(tau, tau + m)``, ``m`` above  (9)
- ``cst``:             0 for ``|x| < tau``, ``x - sign(x) tau`` on ``tau < |x| < tau + m``,
                       ``sign(x) m`` above                                              (10)

Conventions for the non-smooth points:

- ``kinks`` lists every ``x`` where ``phi``, ``phi'`` or ``phi''`` fails to be smooth, so that
  quadrature can split its integration range there.
- For piecewise-linear activations ``d2`` is identically 0: the Dirac masses of ``phi''`` at the
  kinks are not represented. ``smooth`` is False for them.
- At a kink the derivative takes the one-sided value PyTorch's autograd uses (e.g. ``relu'(0) = 0``,
  ``leaky_relu'(0) = negative_slope``, ``elu'(0) = alpha``).
- ``smooth`` means "usable by the smooth-activation methods (TAT with tau, DKS)": ``phi''`` is
  bounded away from the kinks. ``elu``, ``selu`` and ``softsign`` are smooth in that sense although
  ``phi''`` jumps at 0; for ``selu`` (and ``elu`` with ``alpha != 1``) even ``phi'`` jumps at 0,
  which ``d1_continuous`` records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
from scipy.special import erf as _sp_erf
from scipy.special import ndtr as _ndtr

from ...errors import SigpropError
from ...schemas.activations import (
    ACTIVATION_ALIASES,
    ACTIVATION_NAMES,
    GELU_TANH_K,
    PIECEWISE_LINEAR_ACTIVATIONS,
    SELU_ALPHA,
    SELU_LAMBDA,
    SMOOTH_ACTIVATIONS,
    activation_info,
)
from .activation_jets import JETS
from .stable_math import SQRT_2_OVER_PI as _SQRT_2_OVER_PI
from .stable_math import TWO_OVER_SQRT_PI as _TWO_OVER_SQRT_PI
from .stable_math import arr as _arr
from .stable_math import exp_neg as _exp_neg
from .stable_math import normal_pdf as _normal_pdf
from .stable_math import sig_pair as _sig_pair

# fmt: off
__all__ = ["Activation", "ACTIVATION_NAMES", "ACTIVATION_ALIASES", "SMOOTH_ACTIVATIONS", "PIECEWISE_LINEAR_ACTIVATIONS",
           "SELU_LAMBDA", "SELU_ALPHA", "get_activation", "transformed"]
# fmt: on

ArrayFn = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Activation:
    """A scalar activation ``phi`` with its exact first and second derivatives."""

    name: str
    fn: ArrayFn
    d1: ArrayFn  # phi'
    d2: ArrayFn  # phi''
    kinks: tuple[float, ...]  # where phi, phi' or phi'' is not smooth (integration breakpoints)
    smooth: bool  # phi'' is bounded (TAT-smooth / DKS usable); False for the piecewise-linear ones
    positively_homogeneous: bool  # phi(a x) = a phi(x) for a >= 0
    description: str
    # parameters the activation was built with, e.g. (("negative_slope", 0.01),); hashable
    params: tuple[tuple[str, float], ...] = ()
    # False where phi' itself jumps (selu, elu with alpha != 1, the piecewise-linear ones)
    d1_continuous: bool = True
    # (phi, phi', phi'') in one pass that shares the work (``activation_jets``); None: three calls
    jet: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None

    def __call__(self, x) -> np.ndarray:
        return self.fn(x)

    @property
    def piecewise_linear(self) -> bool:
        return not self.smooth


def _sech2(x: np.ndarray) -> np.ndarray:
    """sech(x)^2 = 4 e^{-2|x|} / (1 + e^{-2|x|})^2, relatively accurate in the tails."""
    e = _exp_neg(2.0 * np.abs(x))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


# --------------------------------------------------------------------------- smooth activations


def _tanh():
    def fn(x):
        return np.tanh(_arr(x))

    def d1(x):
        return _sech2(_arr(x))

    def d2(x):
        x = _arr(x)
        return -2.0 * np.tanh(x) * _sech2(x)

    return fn, d1, d2


def _sigmoid():
    def fn(x):
        return _sig_pair(_arr(x))[0]

    def d1(x):
        s, t = _sig_pair(_arr(x))
        return s * t

    def d2(x):
        x = _arr(x)
        s, t = _sig_pair(x)
        # s (1 - s) (1 - 2 s), with 1 - 2 s = -tanh(x / 2)
        return -(s * t) * np.tanh(0.5 * x)

    return fn, d1, d2


def _softplus():
    def fn(x):
        x = _arr(x)
        return np.maximum(x, 0.0) + np.log1p(_exp_neg(np.abs(x)))

    def d1(x):
        return _sig_pair(_arr(x))[0]

    def d2(x):
        s, t = _sig_pair(_arr(x))
        return s * t

    return fn, d1, d2


def _erf():
    def fn(x):
        return _sp_erf(_arr(x))

    def d1(x):
        x = _arr(x)
        return _TWO_OVER_SQRT_PI * _exp_neg(x * x)

    def d2(x):
        x = _arr(x)
        return -2.0 * x * _TWO_OVER_SQRT_PI * _exp_neg(x * x)

    return fn, d1, d2


def _atan():
    def fn(x):
        return np.arctan(_arr(x))

    def d1(x):
        x = _arr(x)
        return 1.0 / (1.0 + x * x)

    def d2(x):
        x = _arr(x)
        r = 1.0 / (1.0 + x * x)
        return -2.0 * x * r * r

    return fn, d1, d2


def _asinh():
    def fn(x):
        return np.arcsinh(_arr(x))

    def d1(x):
        return 1.0 / np.hypot(_arr(x), 1.0)

    def d2(x):
        x = _arr(x)
        r = 1.0 / np.hypot(x, 1.0)
        return -x * r * r * r

    return fn, d1, d2


def _softsign():
    def fn(x):
        x = _arr(x)
        return x / (1.0 + np.abs(x))

    def d1(x):
        r = 1.0 / (1.0 + np.abs(_arr(x)))
        return r * r

    def d2(x):
        x = _arr(x)
        r = 1.0 / (1.0 + np.abs(x))
        return -2.0 * np.sign(x) * r * r * r

    return fn, d1, d2


def _bentid():
    def fn(x):
        x = _arr(x)
        # (sqrt(x^2 + 1) - 1) / 2 written without cancellation near 0
        return 0.5 * (x * x) / (np.hypot(x, 1.0) + 1.0) + x

    def d1(x):
        x = _arr(x)
        return 0.5 * x / np.hypot(x, 1.0) + 1.0

    def d2(x):
        r = 1.0 / np.hypot(_arr(x), 1.0)
        return 0.5 * r * r * r

    return fn, d1, d2


def _swish():
    def fn(x):
        x = _arr(x)
        return x * _sig_pair(x)[0]

    def d1(x):
        x = _arr(x)
        s, t = _sig_pair(x)
        return s * (1.0 + x * t)

    def d2(x):
        x = _arr(x)
        s, t = _sig_pair(x)
        # s (1 - s) (2 + x (1 - 2 s)), with 1 - 2 s = -tanh(x / 2)
        return (s * t) * (2.0 - x * np.tanh(0.5 * x))

    return fn, d1, d2


def _gelu():
    def fn(x):
        x = _arr(x)
        return x * _ndtr(x)

    def d1(x):
        x = _arr(x)
        return _ndtr(x) + x * _normal_pdf(x)

    def d2(x):
        x = _arr(x)
        return _normal_pdf(x) * (2.0 - x * x)

    return fn, d1, d2


def _gelu_tanh():
    # 0.5 x (1 + tanh(u)) = x * sigmoid(2 u), u = sqrt(2/pi) (x + k x^3)
    c, k = _SQRT_2_OVER_PI, GELU_TANH_K

    def parts(x):
        x2 = x * x
        two_u = 2.0 * c * x * (1.0 + k * x2)
        du = c * (1.0 + 3.0 * k * x2)  # u'
        ddu = 6.0 * c * k * x  # u''
        s, t = _sig_pair(two_u)
        return s, t, du, ddu, two_u

    def fn(x):
        x = _arr(x)
        c2u = 2.0 * c * x * (1.0 + k * x * x)
        return x * _sig_pair(c2u)[0]

    def d1(x):
        x = _arr(x)
        s, t, du, _, _ = parts(x)
        return s + 2.0 * x * (s * t) * du

    def d2(x):
        x = _arr(x)
        s, t, du, ddu, two_u = parts(x)
        # (s t)' = 2 u' s t (1 - 2 s), 1 - 2 s = -tanh(u)
        one_minus_2s = -np.tanh(0.5 * two_u)
        return 2.0 * (s * t) * (2.0 * du + x * (2.0 * one_minus_2s * du * du + ddu))

    return fn, d1, d2


def _elu_family(alpha: float, scale: float):
    a, lam = float(alpha), float(scale)

    def fn(x):
        x = _arr(x)
        return lam * np.where(x > 0, x, a * np.expm1(np.minimum(x, 0.0)))

    def d1(x):
        x = _arr(x)
        return lam * np.where(x > 0, 1.0, a * _exp_neg(np.maximum(-x, 0.0)))

    def d2(x):
        x = _arr(x)
        return lam * np.where(x > 0, 0.0, a * _exp_neg(np.maximum(-x, 0.0)))

    return fn, d1, d2


# --------------------------------------------------------------------------- piecewise linear


def _zeros_like(x):
    return np.zeros_like(_arr(x))


def _relu():
    def fn(x):
        return np.maximum(_arr(x), 0.0)

    def d1(x):
        return (_arr(x) > 0).astype(np.float64)

    return fn, d1, _zeros_like


def _leaky_relu(negative_slope: float):
    s = float(negative_slope)

    def fn(x):
        x = _arr(x)
        return np.where(x > 0, x, s * x)

    def d1(x):
        return np.where(_arr(x) > 0, 1.0, s)

    return fn, d1, _zeros_like


def _relu_tau(tau: float):
    t = float(tau)

    def fn(x):
        return np.maximum(_arr(x) - t, 0.0)

    def d1(x):
        return (_arr(x) > t).astype(np.float64)

    return fn, d1, _zeros_like


def _soft_threshold(tau: float):
    t = float(tau)

    def fn(x):
        x = _arr(x)
        return np.sign(x) * np.maximum(np.abs(x) - t, 0.0)

    def d1(x):
        return (np.abs(_arr(x)) > t).astype(np.float64)

    return fn, d1, _zeros_like


def _crelu(tau: float, m: float):
    t, mm = float(tau), float(m)

    def fn(x):
        return np.clip(_arr(x) - t, 0.0, mm)

    def d1(x):
        x = _arr(x)
        return ((x > t) & (x < t + mm)).astype(np.float64)

    return fn, d1, _zeros_like


def _cst(tau: float, m: float):
    t, mm = float(tau), float(m)

    def fn(x):
        x = _arr(x)
        return np.sign(x) * np.clip(np.abs(x) - t, 0.0, mm)

    def d1(x):
        a = np.abs(_arr(x))
        return ((a > t) & (a < t + mm)).astype(np.float64)

    return fn, d1, _zeros_like


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class _Spec:
    """The closed forms of one catalogue activation; its name, parameters, defaults, description
    and families are the catalogue's (``sigprop.schemas.activations``)."""

    factory: Callable[..., tuple[ArrayFn, ArrayFn, ArrayFn]]
    kinks: Callable[..., tuple[float, ...]]
    d1_continuous: Callable[..., bool] = lambda **_: True


def _no_kinks(**_):
    return ()


def _zero_kink(**_):
    return (0.0,)


def _jumps(**_):
    return False


_SPECS: dict[str, _Spec] = {
    "tanh": _Spec(_tanh, _no_kinks),
    "sigmoid": _Spec(_sigmoid, _no_kinks),
    "softplus": _Spec(_softplus, _no_kinks),
    "erf": _Spec(_erf, _no_kinks),
    "atan": _Spec(_atan, _no_kinks),
    "asinh": _Spec(_asinh, _no_kinks),
    "softsign": _Spec(_softsign, _zero_kink),
    "bentid": _Spec(_bentid, _no_kinks),
    "swish": _Spec(_swish, _no_kinks),
    "gelu": _Spec(_gelu, _no_kinks),
    "gelu_tanh": _Spec(_gelu_tanh, _no_kinks),
    "elu": _Spec(
        lambda alpha: _elu_family(alpha, 1.0), _zero_kink, d1_continuous=lambda alpha, **_: float(alpha) == 1.0
    ),
    "selu": _Spec(lambda: _elu_family(SELU_ALPHA, SELU_LAMBDA), _zero_kink, _jumps),
    "relu": _Spec(_relu, _zero_kink, _jumps),
    "leaky_relu": _Spec(
        _leaky_relu, _zero_kink, d1_continuous=lambda negative_slope, **_: float(negative_slope) == 1.0
    ),
    "relu_tau": _Spec(_relu_tau, lambda tau: (float(tau),), _jumps),
    "soft_threshold": _Spec(
        _soft_threshold, lambda tau: (-float(tau), float(tau)), d1_continuous=lambda tau, **_: float(tau) == 0.0
    ),
    "crelu": _Spec(_crelu, lambda tau, m: (float(tau), float(tau) + float(m)), _jumps),
    "cst": _Spec(_cst, lambda tau, m: (-float(tau) - float(m), -float(tau), float(tau), float(tau) + float(m)), _jumps),
}


def _finite_param(name: str, key: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise SigpropError(
            "invalid_request",
            f"activation parameter {key!r} of {name!r} must be a number, got {value!r}",
            f"give {key} as a finite number",
        ) from None
    if not math.isfinite(v):
        raise SigpropError(
            "invalid_request",
            f"activation parameter {key!r} of {name!r} must be finite, got {value!r}",
            f"give {key} as a finite number",
        )
    return v


def _check_params(name: str, defaults: Mapping[str, float], params: dict) -> dict:
    unknown = sorted(k for k, v in params.items() if k not in defaults and v is not None)
    if unknown:
        allowed = ", ".join(defaults) or "none"
        raise SigpropError(
            "invalid_request",
            f"activation {name!r} takes no parameter(s) {', '.join(unknown)}",
            f"parameters of {name!r}: {allowed}",
        )
    out = dict(defaults)
    for k, v in params.items():
        if v is not None:
            out[k] = _finite_param(name, k, v)
    if "tau" in out and out["tau"] < 0:
        raise SigpropError(
            "invalid_request",
            f"threshold tau of {name!r} must be >= 0, got {out['tau']!r}",
            "tau is the sparsifying threshold; tau = 0 gives no sparsification",
        )
    if "m" in out and out["m"] <= 0:
        raise SigpropError(
            "invalid_request",
            f"clip level m of {name!r} must be > 0, got {out['m']!r}",
            "m is the magnitude at which the activation is clipped",
        )
    return out


def get_activation(name: str, **params) -> Activation:
    """The activation called ``name`` (PyTorch naming), built with ``params``.

    The parameters each activation takes, and their defaults, are the catalogue's
    (``sigprop.schemas.activations.CATALOGUE[name].defaults``: ``negative_slope`` of
    ``leaky_relu``, ``alpha`` of ``elu``, ``tau`` and ``m`` of the sparsifying ones). A parameter
    given as ``None`` takes its default.

    Raises :class:`SigpropError` ``unsupported_activation`` for an unknown name and
    ``invalid_request`` for an unknown or invalid parameter.
    """
    info = activation_info(name)
    spec = _SPECS[info.name]
    p = _check_params(info.name, info.defaults, params)
    fn, d1, d2 = spec.factory(**p)
    kinks = tuple(sorted(set(float(k) for k in spec.kinks(**p))))
    return Activation(
        name=info.name,
        fn=fn,
        d1=d1,
        d2=d2,
        kinks=kinks,
        smooth=info.smooth,
        positively_homogeneous=info.positively_homogeneous,
        description=info.description,
        params=tuple(sorted(p.items())),
        d1_continuous=bool(spec.d1_continuous(**p)),
        jet=JETS.get(info.name) if not p else None,
    )


def transformed(
    act: Activation,
    input_scale: float = 1.0,
    input_shift: float = 0.0,
    output_scale: float = 1.0,
    output_shift: float = 0.0,
) -> Activation:
    """``phi_hat(x) = output_scale * (phi(input_scale * x + input_shift) + output_shift)``.

    The dks / contract convention. Derivatives by the chain rule; kinks are mapped to
    ``(k - input_shift) / input_scale`` (sorted); with ``input_scale == 0`` phi_hat is constant and
    has no kinks.
    """
    a = _finite_param(act.name, "input_scale", input_scale)
    b = _finite_param(act.name, "input_shift", input_shift)
    c = _finite_param(act.name, "output_scale", output_scale)
    d = _finite_param(act.name, "output_shift", output_shift)
    phi, dphi, ddphi = act.fn, act.d1, act.d2

    def fn(x):
        return c * (phi(a * _arr(x) + b) + d)

    def d1(x):
        return (c * a) * dphi(a * _arr(x) + b)

    def d2(x):
        return (c * a * a) * ddphi(a * _arr(x) + b)

    kinks = () if a == 0.0 else tuple(sorted(set((k - b) / a for k in act.kinks)))
    return replace(
        act,
        fn=fn,
        d1=d1,
        d2=d2,
        kinks=kinks,
        positively_homogeneous=act.positively_homogeneous and b == 0.0 and d == 0.0,
        description=f"{c!r} * ({act.name}({a!r} * x + {b!r}) + {d!r}); {act.name}: {act.description}",
        d1_continuous=act.d1_continuous or a == 0.0,
        jet=None,
    )
