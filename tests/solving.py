"""The in-process solve the client tests ask for: a graph (a traced model's, or written by hand)
solved by the engine itself, with no server."""

from __future__ import annotations

from sigprop.engine.solve import solve
from sigprop.schemas.solve import Solution, SolveRequest


def solve_graph(
    graph: dict, method: str = "tat", activation: str = "leaky_relu", targets: dict | None = None, *, eta=0.5, **extra
) -> Solution:
    """``graph``'s answer; without ``targets``, TAT's eta = ``eta``. ``extra``: the request's other
    keys (``init``, ``trainable``, ``attention``, ...)."""
    targets = targets if targets is not None else {"eta": eta}
    return solve(SolveRequest(graph=dict(graph), method=method, activation=activation, targets=targets, **extra))
