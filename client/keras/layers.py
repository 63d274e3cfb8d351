"""sigprop's own Keras objects, and which Keras functions compute which catalogue activation.

:class:`TransformedActivation` is the callable ``output_scale * (phi(input_scale * x + input_shift)
+ output_shift)`` with ``phi`` written in ``keras.ops`` exactly as the engine defines it, for every
activation of the catalogue (``sigprop.schemas.activations``); it is what ``apply`` puts in
``Activation`` layers and in the ``activation`` of ``Dense``/``Conv`` layers. :class:`WeightedSum`
is the contract's normalized sum ``sum_i w_i x_i`` as a layer, which replaces a plain ``Add``. Both
are registered Keras serializables, so an applied model saves and loads (``model.save``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import keras
from keras import ops

from ...schemas.activations import CATALOGUE, GELU_TANH_K, SELU_ALPHA, SELU_LAMBDA, activation_info, canonical_name
from ...schemas.solve import Solution
from ..solution import tailored, tailoring

__all__ = ["TransformedActivation", "WeightedSum", "activation_of", "phi"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _elu(x, alpha, scale=1.0):
    # expm1 only ever sees x <= 0, so neither branch overflows (as the JAX adapter writes it)
    return scale * ops.where(x > 0, x, alpha * ops.expm1(ops.where(x > 0, 0.0, x)))


def _bentid(x):
    return 0.5 * (x * x) / (ops.sqrt(x * x + 1.0) + 1.0) + x


def _soft_threshold(x, tau):
    return ops.where(x > tau, x - tau, ops.where(x < -tau, x + tau, 0.0))


def _crelu(x, tau, m):
    return ops.where(x > tau, ops.where(x - tau < m, x - tau, m), 0.0)


def _cst(x, tau, m):
    a = ops.abs(x)
    return ops.where(a > tau, ops.sign(x) * ops.where(a - tau < m, a - tau, m), 0.0)


# phi(x, **params) of each catalogue activation, in keras.ops (any backend); the one-sided
# derivatives at the kinks follow the engine: where() with a strict inequality
_PHI = {
    "tanh": ops.tanh,
    "sigmoid": ops.sigmoid,
    "softplus": lambda x: ops.logaddexp(x, 0.0),
    "erf": ops.erf,
    "atan": ops.arctan,
    "asinh": ops.arcsinh,
    "softsign": lambda x: x / (1.0 + ops.abs(x)),
    "bentid": _bentid,
    "swish": lambda x: x * ops.sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1.0 + ops.erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: x * ops.sigmoid(2.0 * _SQRT_2_OVER_PI * x * (1.0 + GELU_TANH_K * x * x)),
    "elu": _elu,
    "selu": lambda x: _elu(x, SELU_ALPHA, SELU_LAMBDA),
    "relu": lambda x: ops.where(x > 0, x, 0.0),
    "leaky_relu": lambda x, negative_slope: ops.where(x > 0, x, negative_slope * x),
    "relu_tau": lambda x, tau: ops.where(x > tau, x - tau, 0.0),
    "soft_threshold": _soft_threshold,
    "crelu": _crelu,
    "cst": _cst,
}


def phi(name: str, **params: float):
    """The untransformed catalogue activation ``name`` in ``keras.ops``, with its parameters
    (missing ones take the catalogue's defaults)."""
    key = activation_info(name).name
    p = {k: float(params[k]) if params.get(k) is not None else float(v) for k, v in CATALOGUE[key].defaults.items()}
    fn = _PHI[key]
    return lambda x: fn(x, **p)


@keras.saving.register_keras_serializable(package="sigprop")
class TransformedActivation:
    """``phi_hat(x) = output_scale * (phi(input_scale * x + input_shift) + output_shift)``, callable
    on any backend's tensors; ``params`` are ``phi``'s (``negative_slope``, ``alpha``, ``tau``, ``m``)."""

    def __init__(
        self,
        name: str,
        input_scale: float = 1.0,
        input_shift: float = 0.0,
        output_scale: float = 1.0,
        output_shift: float = 0.0,
        params: Mapping[str, float] | None = None,
    ):
        self.name = canonical_name(name)
        defaults = CATALOGUE[self.name].defaults
        given = dict(params or {})
        self.params = {k: float(given[k]) if given.get(k) is not None else float(v) for k, v in defaults.items()}
        self.input_scale, self.input_shift = float(input_scale), float(input_shift)
        self.output_scale, self.output_shift = float(output_scale), float(output_shift)
        self._phi = phi(self.name, **self.params)
        self.__name__ = f"transformed_{self.name}"  # Keras names activations by __name__

    @classmethod
    def from_solution(cls, solution: Solution, defaults: Mapping[str, float] | None = None) -> TransformedActivation:
        """The answer's transformed activation; parameters the answer omits come from ``defaults``
        (e.g. the slope of the model's own LeakyReLU), then the catalogue's."""
        name = canonical_name(solution.activation)
        known = CATALOGUE[name].defaults
        given = {"negative_slope": solution.negative_slope, "tau": solution.tau, "m": solution.m}
        params = {k: given.get(k) if given.get(k) is not None else (defaults or {}).get(k) for k in known}

        return cls(name, *tailoring(solution), params)

    def __call__(self, x):
        return tailored(self._phi, x, self.input_scale, self.input_shift, self.output_scale, self.output_shift)

    def get_config(self) -> dict:
        return {
            "name": self.name,
            "input_scale": self.input_scale,
            "input_shift": self.input_shift,
            "output_scale": self.output_scale,
            "output_shift": self.output_shift,
            "params": dict(self.params),
        }

    @classmethod
    def from_config(cls, config: dict) -> TransformedActivation:
        return cls(**config)

    def __repr__(self) -> str:
        p = ", ".join(f"{k}={v:.6g}" for k, v in self.params.items())
        return (
            f"TransformedActivation({self.name}{'(' + p + ')' if p else ''}, input_scale={self.input_scale:.6g}, "
            f"input_shift={self.input_shift:.6g}, output_scale={self.output_scale:.6g}, "
            f"output_shift={self.output_shift:.6g})"
        )


@keras.saving.register_keras_serializable(package="sigprop")
class WeightedSum(keras.layers.Layer):
    """``sum_i coefficients[i] * inputs[i]``: the contract's normalized sum (equal weights
    ``1/sqrt(n)`` when ``coefficients`` is None). Takes a list, as ``Add`` does, or the tensors as
    positional arguments, as ``x + y`` does."""

    def __init__(self, coefficients=None, **kwargs):
        super().__init__(**kwargs)
        self.coefficients = None if coefficients is None else [float(w) for w in coefficients]

    def _weights_for(self, n: int) -> list[float]:
        w = self.coefficients if self.coefficients is not None else [1.0 / math.sqrt(n)] * n
        if len(w) != n:
            raise ValueError(f"WeightedSum '{self.name}' has {len(w)} coefficients for {n} inputs")
        return w

    def call(self, inputs, *more):
        xs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs, *more]
        w = self._weights_for(len(xs))
        out = w[0] * xs[0]
        for wi, x in zip(w[1:], xs[1:], strict=True):
            out = out + wi * x
        return out

    def compute_output_shape(self, input_shape, *more):
        shapes = list(input_shape) if isinstance(input_shape, list) else [input_shape, *more]
        return shapes[0]

    def get_config(self) -> dict:
        return {**super().get_config(), "coefficients": self.coefficients}


def _known_functions() -> dict:
    """Keras's own activation functions (``keras.activations`` and ``keras.ops``) -> catalogue name."""
    out = {}
    pairs = {
        "relu": "relu",
        "leaky_relu": "leaky_relu",
        "tanh": "tanh",
        "sigmoid": "sigmoid",
        "softplus": "softplus",
        "softsign": "softsign",
        "silu": "swish",
        "swish": "swish",
        "gelu": "gelu",
        "elu": "elu",
        "selu": "selu",
    }
    for kname, name in pairs.items():
        for ns in (keras.activations, ops):
            fn = getattr(ns, kname, None)
            if fn is not None:
                out.setdefault(fn, name)
    return out


_KNOWN = _known_functions()
# keras.activations' own defaults where they differ from the catalogue's (LeakyReLU slope 0.2)
_KERAS_DEFAULTS = {"leaky_relu": {"negative_slope": 0.2}, "elu": {"alpha": 1.0}}


def activation_of(fn) -> tuple[str, dict] | None:
    """(catalogue name, parameters) of a Keras activation function, None for the identity
    (``linear``, ``None``); ValueError naming it when it is neither."""
    if fn is None or fn is keras.activations.linear:
        return None
    if isinstance(fn, TransformedActivation):
        return fn.name, dict(fn.params)
    name = _KNOWN.get(fn)
    if name is None:
        shown = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(f"activation '{shown}' is not one the sigprop catalogue knows")
    if fn is ops.gelu:
        return "gelu_tanh", {}  # keras.ops.gelu approximates by default; keras.activations.gelu does not
    return name, dict(_KERAS_DEFAULTS.get(name, {}))
