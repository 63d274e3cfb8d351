"""Imported once by the solver processes' forkserver (``coldpool``): the engine, and a few tiny
solves that fill its lazy tables (quadrature nodes, compiled maps), so that every solver process
forked from it, a replacement for a killed one included, answers its first solve as fast as the
next one instead of spending its timeout on start-up work."""

from __future__ import annotations

import gc

from .. import preparation  # noqa: F401 - preparation.prepare_payload runs in the solver processes
from ..engine.solve import prepare, solve_canonical
from ..requests import parse_solve_request

_WARM_UP = (
    {"method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.1}},
    {"method": "tat", "activation": "softplus", "targets": {"tau": 0.3}},
    {"method": "eoc", "activation": "relu"},
    {"method": "eoc", "activation": "tanh"},
)


def warm_up() -> None:
    for extra in _WARM_UP:
        try:
            solve_canonical(
                prepare(parse_solve_request({"graph": {"template": "mlp", "depth": 2, "width": 4}, **extra}))
            )
        except Exception:  # noqa: BLE001 - a warm-up that fails only leaves that table cold
            pass


warm_up()
# What is loaded now lives as long as every solver process: out of the cyclic collector's sight
# (the gc.freeze recipe for a forking server), a solve's collections scan only what the solve
# made. That takes about 1 ms off a 100-layer solve, and forked pages stay shared.
gc.freeze()
