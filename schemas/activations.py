"""The activation catalogue: every activation sigprop knows, written once and without numpy.

Names follow PyTorch (the wire contract): ``gelu`` is the exact erf form ``x * Phi(x)``,
``gelu_tanh`` the tanh approximation, ``swish`` is ``x * sigmoid(x)`` (alias ``silu``). Each entry
says what the activation is (its formula), the parameters it takes with their defaults, and the
families it belongs to. The sparsifying activations are Price et al., "Deep neural network
initialization with sparsity inducing activations", equations (7)-(10).

Every implementation reads its names, defaults, aliases and constants from here: the engine's
closed-form phi, phi', phi'' (``sigprop.engine.maps.activations``), the PyTorch and JAX adapters'
phi (``sigprop.client.torch``, ``sigprop.client.jax``) and the validation worker's models. Each
of them holds only its own formulas, keyed by these names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated

from pydantic import Field

from .errors import SigpropError
from .suggest import did_you_mean

__all__ = [
    "ActivationInfo",
    "ActivationName",
    "CATALOGUE",
    "ACTIVATION_ALIASES",
    "ACTIVATION_NAMES",
    "ACTIVATION_PARAMETERS",
    "SMOOTH_ACTIVATIONS",
    "PIECEWISE_LINEAR_ACTIVATIONS",
    "POSITIVELY_HOMOGENEOUS_ACTIVATIONS",
    "SPARSE_ACTIVATIONS",
    "UNCLIPPED_SPARSE_ACTIVATIONS",
    "CLIPPED_SPARSE_ACTIVATIONS",
    "SELU_LAMBDA",
    "SELU_ALPHA",
    "GELU_TANH_K",
    "canonical_name",
    "activation_info",
]

# Activation names on the wire (a request's ``activation``, a node's ``fn``): any PyTorch-style
# identifier. Unknown names pass the schema on purpose: the engine answers them with the
# contract's ``unsupported_activation``, whose hint lists the catalogue.
ActivationName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z][A-Za-z0-9_]*$")]

SELU_LAMBDA = 1.0507009873554804934193349852946
SELU_ALPHA = 1.6732632423543772848170429916717
# gelu_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + GELU_TANH_K x^3)))
GELU_TANH_K = 0.044715

# every parameter any activation takes, in the order the adapters' signatures list them
ACTIVATION_PARAMETERS: tuple[str, ...] = ("negative_slope", "alpha", "tau", "m")


@dataclass(frozen=True)
class ActivationInfo:
    """One activation of the catalogue: what it is and which families it belongs to."""

    name: str
    description: str
    defaults: Mapping[str, float]  # the parameters it takes, with their defaults (read-only)
    # phi'' is bounded (TAT with tau, DKS usable); False for the piecewise-linear ones
    smooth: bool
    positively_homogeneous: bool = False  # phi(a x) = a phi(x) for a >= 0
    sparsifying: bool = False  # exactly 0 on a band of inputs set by the threshold tau
    clipped: bool = False  # constant (+-m) beyond the band where it is linear
    two_sided: bool = False  # zero on |x| < tau (odd); otherwise zero on x < tau

    @property
    def piecewise_linear(self) -> bool:
        return not self.smooth


def _info(
    name: str, description: str, *, smooth: bool, defaults: Mapping[str, float] | None = None, **families: bool
) -> ActivationInfo:
    return ActivationInfo(name, description, MappingProxyType(dict(defaults or {})), smooth, **families)


_ENTRIES = (
    _info("tanh", "tanh(x)", smooth=True),
    _info("sigmoid", "1 / (1 + exp(-x))", smooth=True),
    _info("softplus", "log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))", smooth=True),
    _info("erf", "erf(x)", smooth=True),
    _info("atan", "arctan(x)", smooth=True),
    _info("asinh", "arcsinh(x)", smooth=True),
    _info("softsign", "x / (1 + |x|) (phi'' jumps at 0)", smooth=True),
    _info("bentid", "(sqrt(x^2 + 1) - 1) / 2 + x", smooth=True),
    _info("swish", "x * sigmoid(x) (SiLU)", smooth=True),
    _info("gelu", "x * Phi(x), Phi the standard normal CDF (exact GELU, torch.nn.GELU())", smooth=True),
    _info(
        "gelu_tanh", "0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (torch.nn.GELU(approximate='tanh'))", smooth=True
    ),
    _info("elu", "x for x > 0, alpha (exp(x) - 1) otherwise (phi'' jumps at 0)", smooth=True, defaults={"alpha": 1.0}),
    _info(
        "selu",
        "lambda (x for x > 0, alpha (exp(x) - 1) otherwise), lambda = 1.0507..., "
        "alpha = 1.6732... (phi' and phi'' jump at 0)",
        smooth=True,
    ),
    _info("relu", "max(x, 0)", smooth=False, positively_homogeneous=True),
    _info(
        "leaky_relu",
        "x for x > 0, negative_slope * x otherwise",
        smooth=False,
        defaults={"negative_slope": 0.01},
        positively_homogeneous=True,
    ),
    _info(
        "relu_tau",
        "shifted ReLU: x - tau for x > tau, 0 otherwise (Price et al. eq. 7)",
        smooth=False,
        defaults={"tau": 1.0},
        sparsifying=True,
    ),
    _info(
        "soft_threshold",
        "x - sign(x) tau for |x| > tau, 0 otherwise (Price et al. eq. 8)",
        smooth=False,
        defaults={"tau": 1.0},
        sparsifying=True,
        two_sided=True,
    ),
    _info(
        "crelu",
        "clipped shifted ReLU: 0 for x < tau, x - tau up to x = tau + m, m above (Price et al. eq. 9)",
        smooth=False,
        defaults={"tau": 1.0, "m": 1.0},
        sparsifying=True,
        clipped=True,
    ),
    _info(
        "cst",
        "clipped soft threshold: 0 for |x| < tau, x - sign(x) tau up to |x| = tau + m, sign(x) m above "
        "(Price et al. eq. 10)",
        smooth=False,
        defaults={"tau": 1.0, "m": 1.0},
        sparsifying=True,
        clipped=True,
        two_sided=True,
    ),
)

#: canonical name -> entry, in the catalogue's stable order
CATALOGUE: Mapping[str, ActivationInfo] = MappingProxyType({e.name: e for e in _ENTRIES})
#: other accepted spellings -> canonical name
ACTIVATION_ALIASES: Mapping[str, str] = MappingProxyType({"silu": "swish"})


def canonical_name(name: object) -> str | None:
    """The catalogue's name for ``name`` (aliases resolved), or None when it names no activation."""
    if not isinstance(name, str):
        return None
    key = ACTIVATION_ALIASES.get(name, name)
    return key if key in CATALOGUE else None


def _names(keep) -> tuple[str, ...]:
    """Accepted names, aliases included, whose entry passes ``keep``."""
    return tuple(n for n in ACTIVATION_NAMES if keep(CATALOGUE[canonical_name(n)]))


#: every accepted name, aliases included, in a stable order
ACTIVATION_NAMES: tuple[str, ...] = tuple(CATALOGUE) + tuple(ACTIVATION_ALIASES)
SMOOTH_ACTIVATIONS: tuple[str, ...] = _names(lambda e: e.smooth)
PIECEWISE_LINEAR_ACTIVATIONS: tuple[str, ...] = _names(lambda e: not e.smooth)
POSITIVELY_HOMOGENEOUS_ACTIVATIONS: tuple[str, ...] = _names(lambda e: e.positively_homogeneous)
UNCLIPPED_SPARSE_ACTIVATIONS: tuple[str, ...] = _names(lambda e: e.sparsifying and not e.clipped)
CLIPPED_SPARSE_ACTIVATIONS: tuple[str, ...] = _names(lambda e: e.sparsifying and e.clipped)
SPARSE_ACTIVATIONS: tuple[str, ...] = UNCLIPPED_SPARSE_ACTIVATIONS + CLIPPED_SPARSE_ACTIVATIONS


def activation_info(name: object) -> ActivationInfo:
    """The catalogue entry of ``name`` (an alias works too).

    Raises :class:`SigpropError` ``unsupported_activation``, listing every accepted name, when
    ``name`` is not in the catalogue.
    """
    key = canonical_name(name)
    if key is None:
        # Only suggested, never accepted: one spelling per function keeps keys, the answer's
        # ``activation`` and the per-function ``activations`` map independent of how it was typed.
        raise SigpropError(
            "unsupported_activation",
            f"unknown activation {name!r}{did_you_mean(name, ACTIVATION_NAMES)}",
            "activation names follow PyTorch's functional names in lower case (leaky_relu, not LeakyReLU); "
            "supported activations: " + ", ".join(ACTIVATION_NAMES),
        )
    return CATALOGUE[key]
