"""Python client for the sigprop HTTP service.

    from sigprop.client import Client, SigpropError

    with Client("http://127.0.0.1:8000", api_key="...") as sp:
        sol = sp.solve({"template": "mlp", "depth": 50}, "tat", "leaky_relu", {"eta": 0.9})
        print(sol.negative_slope, sol.key, sol.cached)

``Client`` (blocking) and ``AsyncClient`` (asyncio, same methods as coroutines) live in
``sigprop.client.http``; answers come back as ``sigprop.schemas.Solution`` models, rejected
requests raise ``SigpropError`` with the contract's ``code``, ``message``, ``hint`` and ``status``.

This package needs only httpx and pydantic: importing it imports no numpy, torch, jax or fastapi.
The framework adapters, which do need their framework, live in ``sigprop.client.torch`` and
``sigprop.client.jax``; import those modules explicitly.
"""

from ..schemas.errors import SigpropError
from ..schemas.solve import Solution
from .http import AsyncClient, Client

__all__ = ["Client", "AsyncClient", "SigpropError", "Solution"]
