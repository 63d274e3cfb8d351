"""The catalogue's activations as jax-traceable functions: :func:`activation_fn` (re-exported by
``sigprop.client.jax``, where users import it).

A module of its own so that ``extraction`` (which recognizes activations in a jaxpr by probing
them) and ``jax`` (which transforms them) both read it, and neither imports the other.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ...schemas.activations import ACTIVATION_NAMES, CATALOGUE, GELU_TANH_K, SELU_ALPHA, SELU_LAMBDA, canonical_name

__all__ = ["ACTIVATIONS", "activation_fn"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _softplus(x):
    # max(x, 0) + log1p(exp(-|x|)), the engine's formula; jnp.logaddexp computes exactly that and
    # has the right derivative sigmoid(x) everywhere (jnp.maximum's is 1/2 at 0, jnp.abs's 0)
    return jnp.logaddexp(x, 0.0)


def _elu(x, alpha=1.0, scale=1.0):
    # expm1 only ever sees x <= 0, so neither branch (nor its gradient) overflows; the inner
    # where (not jnp.minimum, whose gradient at 0 is 1/2) gives phi'(0) = scale * alpha
    return scale * jnp.where(x > 0, x, alpha * jnp.expm1(jnp.where(x > 0, 0.0, x)))


def _gelu_tanh(x):
    return x * jax.nn.sigmoid(2.0 * _SQRT_2_OVER_PI * x * (1.0 + GELU_TANH_K * x * x))


def _bentid(x):
    # (sqrt(x^2 + 1) - 1) / 2 + x, without cancellation near 0 (as the engine writes it)
    return 0.5 * (x * x) / (jnp.hypot(x, 1.0) + 1.0) + x


def _soft_threshold(x, tau):
    return jnp.where(x > tau, x - tau, jnp.where(x < -tau, x + tau, 0.0))


def _crelu(x, tau, m):
    return jnp.where(x > tau, jnp.where(x - tau < m, x - tau, m), 0.0)


def _cst(x, tau, m):
    return jnp.where(jnp.abs(x) > tau, jnp.sign(x) * jnp.where(jnp.abs(x) - tau < m, jnp.abs(x) - tau, m), 0.0)


# phi(x, **params) of each catalogue activation (sigprop.schemas.activations has the names, the
# parameters and their defaults). The one-sided derivatives at the kinks follow the engine (and
# PyTorch): jnp.where with a strict inequality, never jnp.maximum / jnp.clip (whose gradient at a
# tie is 1/2).
_PHI: dict[str, Callable[..., jax.Array]] = {
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "softplus": _softplus,
    "erf": jax.scipy.special.erf,
    "atan": jnp.arctan,
    "asinh": jnp.arcsinh,
    "softsign": lambda x: x / (1.0 + jnp.abs(x)),
    "bentid": _bentid,
    "swish": lambda x: x * jax.nn.sigmoid(x),
    "gelu": lambda x: x * jax.scipy.special.ndtr(x),
    "gelu_tanh": _gelu_tanh,
    "elu": lambda x, alpha: _elu(x, alpha),
    "selu": lambda x: _elu(x, SELU_ALPHA, SELU_LAMBDA),
    "relu": lambda x: jnp.where(x > 0, x, 0.0),
    "leaky_relu": lambda x, negative_slope: jnp.where(x > 0, x, negative_slope * x),
    "relu_tau": lambda x, tau: jnp.where(x > tau, x - tau, 0.0),
    "soft_threshold": _soft_threshold,
    "crelu": _crelu,
    "cst": _cst,
}

#: every activation name :func:`transformed_activation` accepts (the catalogue's, aliases included)
ACTIVATIONS: tuple[str, ...] = ACTIVATION_NAMES


def _canonical(name: str) -> str:
    """The catalogue's name for ``name``; ValueError for a name it does not know."""
    key = canonical_name(name)
    if key is None:
        raise ValueError(f"unknown activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return key


def _as_float_array(x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    return x


def activation_fn(name: str, **params: float) -> Callable[[jax.Array], jax.Array]:
    """The untransformed ``phi`` called ``name`` (PyTorch naming, as the engine), jax-traceable.

    ``params``: the ones the catalogue lists for the activation (``negative_slope`` of
    ``leaky_relu``, ``alpha`` of ``elu``, ``tau`` and ``m`` of the sparsifying ones), with its
    defaults. A parameter given as None takes its default; one the activation does not take is an
    error.
    """
    key = _canonical(name)
    defaults, phi = CATALOGUE[key].defaults, _PHI[key]
    unknown = sorted(k for k, v in params.items() if v is not None and k not in defaults)
    if unknown:
        raise ValueError(f"activation {name!r} takes no parameter(s) {', '.join(unknown)}")
    p = {k: float(params[k]) if params.get(k) is not None else v for k, v in defaults.items()}

    def fn(x):
        return phi(_as_float_array(x), **p)

    fn.__name__ = key
    return fn
