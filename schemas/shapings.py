"""The attention shapings a sequence graph's ``attention`` request names, defined once: the request
keys each takes, its defaults, and what an adapter does to the attention's query at initialization.
The engine's token-kernel schedules (``engine.maps.token_kernels``) and the adapters
(``sigprop.client.torch``, ``sigprop.client.jax``) import them from here.

- ``e-spa``, ``u-spa``: exponential and uniform target kernels, "Deep Transformers without Shortcuts:
  Modifying Self-attention for Faithful Signal Propagation" (He, Martens et al., arXiv:2302.10322),
  section 3;
- ``value-skipinit``: A = alpha I + beta softmax, alpha 1 and beta 0 at initialization (section 4);
- ``shaped``: A = I + softmax(logits / tau) - softmax(mask), "The Shaped Transformer: Attention Models
  in the Infinite Depth-and-Width Limit" (Noci et al., arXiv:2306.17759).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "DEFAULT_FINAL_GAMMA",
    "DEFAULT_FINAL_RHO",
    "DEFAULT_TEMPERATURE",
    "SHAPINGS",
    "SHAPING_TABLE",
    "ShapingName",
    "ScheduleName",
    "Shaping",
    "zero_query_shapings",
]

ShapingName = Literal["e-spa", "u-spa", "value-skipinit", "shaped"]
# how a Cholesky-ratio shaping's targets are scheduled: "paper" moves the kernel by attention alone
# (arXiv:2302.10322 section 3); "joint" chooses the attention targets with the MLP blocks' C maps so
# that the output kernel is the requested one (``engine.sequence.joint_schedule``, issue 37)
ScheduleName = Literal["joint", "paper"]

# the default of a public re-implementation of arXiv:2302.10322
DEFAULT_FINAL_GAMMA = 0.005
# ours: U-SPA's final correlation
DEFAULT_FINAL_RHO = 0.8
DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True)
class Shaping:
    name: str
    # the request keys it takes besides ``shaping``
    keys: tuple[str, ...]
    # whether the attention's query starts at zero (so softmax is the mask's uniform average at
    # initialization and the schedule's matrices are exactly the ones the engine solved for)
    zero_query: bool
    # the schedules it offers, the default first (empty: the attention is the identity at init)
    schedules: tuple[str, ...] = ()

    @property
    def default_schedule(self) -> str | None:
        return self.schedules[0] if self.schedules else None


SHAPING_TABLE: dict[str, Shaping] = {
    s.name: s
    for s in (
        Shaping("e-spa", ("final_gamma",), zero_query=True, schedules=("joint", "paper")),
        Shaping("u-spa", ("final_rho",), zero_query=True, schedules=("joint", "paper")),
        Shaping("value-skipinit", (), zero_query=True),
        Shaping("shaped", ("temperature",), zero_query=False),
    )
}
SHAPINGS: tuple[str, ...] = tuple(SHAPING_TABLE)
assert SHAPINGS == get_args(ShapingName)
assert all(set(s.schedules) <= set(get_args(ScheduleName)) for s in SHAPING_TABLE.values())


def zero_query_shapings() -> tuple[str, ...]:
    """The shapings whose attention query starts at zero."""
    return tuple(s.name for s in SHAPING_TABLE.values() if s.zero_query)
