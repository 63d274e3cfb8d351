"""``sigprop.solve``: the service's answer, computed in this process (no server, no subprocess).

For training pipelines and notebooks that want the answer without running ``sigprop serve``: the
request goes through the same strict parser and the same engine path as ``POST /v1/solve`` and
``sigprop solve``, so the answer is the one the service would send (``cached`` is always false, and
nothing is stored). Bad input raises the same ``SigpropError`` (code, message, hint).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .client.http import request_body, solve_body
from .schemas.errors import SigpropError
from .schemas.solve import Solution, SolveRequest

__all__ = ["solve"]


def solve(
    request_or_graph: SolveRequest | Mapping[str, Any] | str | bytes,
    method: str | None = None,
    activation: str | None = None,
    targets: Mapping[str, Any] | None = None,
    *,
    init: str | None = None,
    trainable: Mapping[str, Any] | None = None,
    c_map_points: int | None = None,
    assumptions: str | None = None,
    attention: Mapping[str, Any] | None = None,
) -> Solution:
    """The answer to a solve request, computed here.

    Two forms, as the client's ``Client.solve`` and ``Client.solve_request``::

        sigprop.solve({"graph": {"template": "mlp", "depth": 50}, "method": "tat",
                       "activation": "leaky_relu", "targets": {"eta": 0.9}})
        sigprop.solve(graph, "tat", "leaky_relu", {"eta": 0.9})  # graph: a dict or a Graph/Template

    The first takes a whole request (a dict, a ``SolveRequest`` or its JSON text); the second a
    graph with the method, activation and targets, plus the request's optional keys.
    """
    from .answers import prepared_json
    from .preparation import prepare_data
    from .requests import load_json
    from .settings import offline_limits

    if method is None:
        if activation is not None or targets is not None:
            raise TypeError("sigprop.solve: give a whole request, or a graph with method and activation")
        if isinstance(request_or_graph, (str, bytes)):
            text = request_or_graph.decode() if isinstance(request_or_graph, bytes) else request_or_graph
            data = load_json(text, "check the request with a JSON validator", what="the request")
        else:
            data = request_body(request_or_graph)
    else:
        if activation is None:
            raise SigpropError(
                "invalid_request",
                "sigprop.solve: a graph was given with a method but no activation",
                'e.g. sigprop.solve(graph, "tat", "leaky_relu", {"eta": 0.9})',
            )
        data = solve_body(
            request_or_graph, method, activation, targets, init, trainable, c_map_points, assumptions, attention
        )
    # a round trip through JSON text: the strict parser sees exactly what the service would
    data = json.loads(json.dumps(data, allow_nan=False))
    # the limits `sigprop solve` applies, from the same environment (settings.offline_limits)
    return Solution.model_validate_json(prepared_json(prepare_data(data, offline_limits())))
