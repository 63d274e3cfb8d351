"""sigprop's own torch modules, and which torch modules and functions compute which catalogue
activation.

:class:`TransformedActivation` is ``output_scale * (phi(input_scale * x + input_shift) +
output_shift)`` with ``phi`` written exactly as the engine defines it, for every activation of the
catalogue (``sigprop.schemas.activations``, which has the names, parameters and defaults);
:class:`NormalizedSum` is the contract's normalized sum, or a residual ``x + beta / sqrt(L) F(x)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...schemas.activations import CATALOGUE, SELU_ALPHA, SELU_LAMBDA, activation_info, canonical_name
from ...schemas.solve import Solution
from ..solution import tailored, tailoring

__all__ = [
    "TransformedActivation",
    "NormalizedSum",
    "activation_function",
    "native_module",
    "ACTIVATION_FUNCTIONS",
    "ACT_MODULES",
]


def _leaky(x, negative_slope):
    return torch.where(x > 0, x, negative_slope * x)


def _softplus(x):
    # log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)): exact everywhere (F.softplus is linear above 20)
    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-torch.abs(x)))


def _bentid(x):
    return 0.5 * (x * x) / (torch.sqrt(x * x + 1.0) + 1.0) + x


def _elu(x, alpha):
    return torch.where(x > 0, x, alpha * torch.expm1(torch.clamp(x, max=0)))


def _crelu(x, tau, m):
    return torch.minimum(torch.clamp(x - tau, min=0), torch.as_tensor(m, dtype=x.dtype))


def _cst(x, tau, m):
    return torch.sign(x) * torch.minimum(torch.clamp(torch.abs(x) - tau, min=0), torch.as_tensor(m, dtype=x.dtype))


# phi(x, **params) of each catalogue activation (sigprop.schemas.activations has the names, the
# parameters and their defaults); Price et al., equations (7)-(10) for the sparsifying ones
_PHI: dict[str, Any] = {
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "softplus": _softplus,
    "erf": torch.erf,
    "atan": torch.atan,
    "asinh": torch.asinh,
    "softsign": lambda x: x / (1.0 + torch.abs(x)),
    "bentid": _bentid,
    "swish": lambda x: x * torch.sigmoid(x),
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "elu": _elu,
    "selu": lambda x: SELU_LAMBDA * _elu(x, SELU_ALPHA),
    "relu": lambda x: torch.clamp(x, min=0),
    "leaky_relu": _leaky,
    "relu_tau": lambda x, tau: torch.clamp(x - tau, min=0),
    "soft_threshold": lambda x, tau: torch.sign(x) * torch.clamp(torch.abs(x) - tau, min=0),
    "crelu": _crelu,
    "cst": _cst,
}

# name -> (phi(x, **params), parameter defaults)
ACTIVATION_FUNCTIONS: dict[str, tuple[Any, dict[str, float]]] = {
    name: (_PHI[name], dict(info.defaults)) for name, info in CATALOGUE.items()
}


def activation_function(name: str):
    """``(phi, defaults)`` for an activation name (PyTorch naming, as the service uses)."""
    return ACTIVATION_FUNCTIONS[activation_info(name).name]


class TransformedActivation(nn.Module):
    """``phi_hat(x) = output_scale * (phi(input_scale * x + input_shift) + output_shift)``.

    ``phi`` is the activation called ``name`` with the engine's exact definition; ``negative_slope``
    (leaky_relu), ``alpha`` (elu), ``tau`` and ``m`` (relu_tau, soft_threshold, crelu, cst) are its
    parameters. With ``trainable_slope=True`` the Leaky ReLU slope is an ``nn.Parameter`` (the
    trainable TReLU of the trainable-TAT paper); all other values are fixed floats.
    """

    def __init__(
        self,
        name: str,
        *,
        input_scale: float = 1.0,
        input_shift: float = 0.0,
        output_scale: float = 1.0,
        output_shift: float = 0.0,
        negative_slope: float | None = None,
        alpha: float | None = None,
        tau: float | None = None,
        m: float | None = None,
        trainable_slope: bool = False,
    ):
        super().__init__()
        self._phi, defaults = activation_function(name)
        self.name = canonical_name(name)
        given = {"negative_slope": negative_slope, "alpha": alpha, "tau": tau, "m": m}
        self._params = {k: float(given[k]) if given[k] is not None else float(v) for k, v in defaults.items()}
        if trainable_slope and self.name != "leaky_relu":
            raise ValueError(f"a trainable slope needs leaky_relu, not {self.name!r}")
        if trainable_slope:
            self.negative_slope = nn.Parameter(torch.tensor(self._params.pop("negative_slope")))
        self.input_scale = float(input_scale)
        self.input_shift = float(input_shift)
        self.output_scale = float(output_scale)
        self.output_shift = float(output_shift)

    @classmethod
    def from_solution(
        cls, solution: Solution, *, trainable_slope: bool | None = None, defaults: Mapping[str, float] | None = None
    ) -> TransformedActivation:
        """The answer's transformed activation. Parameters the answer omits come from ``defaults``
        (e.g. the slope of the model's own LeakyReLU), then the catalogue's defaults."""
        defaults = dict(defaults or {})
        if trainable_slope is None:
            trainable_slope = bool(solution.trainable and solution.trainable.negative_slope)

        def pick(key, value):
            return value if value is not None else defaults.get(key)

        _, known = activation_function(solution.activation)
        name = canonical_name(solution.activation)
        a, b, c, d = tailoring(solution)
        return cls(
            name,
            input_scale=a,
            input_shift=b,
            output_scale=c,
            output_shift=d,
            negative_slope=(pick("negative_slope", solution.negative_slope) if "negative_slope" in known else None),
            alpha=defaults.get("alpha") if "alpha" in known else None,
            tau=pick("tau", solution.tau) if "tau" in known else None,
            m=pick("m", solution.m) if "m" in known else None,
            trainable_slope=bool(trainable_slope) and name == "leaky_relu",
        )

    @property
    def params(self) -> dict[str, float]:
        out = dict(self._params)
        if isinstance(getattr(self, "negative_slope", None), nn.Parameter):
            out["negative_slope"] = float(self.negative_slope.detach())
        return out

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        """The untransformed activation."""
        params = dict(self._params)
        if isinstance(getattr(self, "negative_slope", None), nn.Parameter):
            params["negative_slope"] = self.negative_slope
        return self._phi(x, **params)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tailored(self.phi, x, self.input_scale, self.input_shift, self.output_scale, self.output_shift)

    def extra_repr(self) -> str:
        p = ", ".join(f"{k}={v:.6g}" for k, v in self.params.items())
        return (
            f"{self.name}{'(' + p + ')' if p else ''}, input_scale={self.input_scale:.6g}, "
            f"input_shift={self.input_shift:.6g}, output_scale={self.output_scale:.6g}, "
            f"output_shift={self.output_shift:.6g}"
        )


class NormalizedSum(nn.Module):
    """``sum_i weights[i] * inputs[i]``, the contract's normalized sum (sum of squares 1; equal
    weights ``1/sqrt(n)`` when ``weights`` is None).

    With ``beta`` (a float, or an ``nn.Parameter`` shared between the sums of a global beta) and
    ``blocks`` = L, it is the residual sum ``x + beta / sqrt(L) * F(x)`` of the trainable-TAT paper
    instead, ``x`` being input number ``shortcut`` and ``F(x)`` the other one.
    """

    def __init__(
        self,
        n: int = 2,
        weights: Iterable[float] | None = None,
        *,
        beta: float | torch.Tensor | None = None,
        blocks: int | None = None,
        shortcut: int = 0,
        trainable_beta: bool = True,
    ):
        super().__init__()
        self.n = int(n)
        if weights is None:
            weights = [1.0 / math.sqrt(self.n)] * self.n
        self.weights = [float(w) for w in weights]
        if len(self.weights) != self.n:
            raise ValueError(f"{self.n} inputs but {len(self.weights)} weights")
        self.shortcut = int(shortcut)
        self.blocks = blocks
        if beta is None:
            self.beta = None
        else:
            if self.n != 2 or not blocks:
                raise ValueError("a residual beta needs exactly two inputs and the number of blocks L")
            if isinstance(beta, nn.Parameter):
                self.beta = beta
            elif trainable_beta:
                self.beta = nn.Parameter(torch.tensor(float(beta)))
            else:
                self.register_buffer("beta", torch.tensor(float(beta)))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if len(xs) != self.n:
            raise TypeError(f"NormalizedSum expects {self.n} inputs, got {len(xs)}")
        if self.beta is not None:
            other = 1 - self.shortcut
            return xs[self.shortcut] + (self.beta / math.sqrt(self.blocks)) * xs[other]
        out = self.weights[0] * xs[0]
        for w, x in zip(self.weights[1:], xs[1:], strict=True):
            out = out + w * x
        return out

    def extra_repr(self) -> str:
        if self.beta is not None:
            return f"x{self.shortcut} + beta / sqrt({self.blocks}) * F, beta={float(self.beta.detach()):.6g}"
        return "weights=[" + ", ".join(f"{w:.6g}" for w in self.weights) + "]"


# PyTorch's own modules for catalogue activations (nn.GELU is either gelu or gelu_tanh: see native_module)
ACT_MODULES: dict[type, str] = {
    nn.ReLU: "relu",
    nn.LeakyReLU: "leaky_relu",
    nn.Tanh: "tanh",
    nn.Sigmoid: "sigmoid",
    nn.Softplus: "softplus",
    nn.SiLU: "swish",
    nn.ELU: "elu",
    nn.SELU: "selu",
    nn.Softsign: "softsign",
}


def native_module(name: str) -> nn.Module | None:
    """PyTorch's own module computing the catalogue activation ``name``, built with the catalogue's
    default parameters, or None where PyTorch has none (erf, bentid, the sparsifying ones, ...)."""
    key = activation_info(name).name
    if key in ("gelu", "gelu_tanh"):
        return nn.GELU(approximate="tanh" if key == "gelu_tanh" else "none")
    cls = next((c for c, n in ACT_MODULES.items() if n == key), None)
    return cls(**CATALOGUE[key].defaults) if cls is not None else None
