"""Typed HTTP client for the sigprop service (contract: docs/contract.md, sections 2-3).

``Client`` (blocking) and ``AsyncClient`` (asyncio) have the same constructor and the same methods;
the async ones are coroutines. Both wrap one ``httpx`` client, so connections are kept alive
between calls; use them as context managers or call ``close()`` / ``aclose()``.

Validation trainings (contract section 4) have their calls next to ``solve``: ``submit_validation``,
``validation``, ``wait_validation``, ``validations``, ``cancel_validation`` (``http_validations``).

Retries (``retries`` extra attempts after the first, waiting ``backoff * 2**attempt`` seconds,
at most ``MAX_BACKOFF_S``; a numeric ``Retry-After`` on a 503 lengthens the wait up to the same cap)
happen only where repeating the request cannot do harm:

- the connection could not be made (``httpx.ConnectError``, ``httpx.ConnectTimeout``): any call
  (a refused connection too: a service that is restarting refuses for a moment; with the defaults a
  service that is not running at all is reported after about 2 s);
- the connection broke before an answer arrived (``httpx.RemoteProtocolError``, ``httpx.ReadError``):
  only idempotent calls, which are every call except ``delete``, ``submit_validation`` and
  ``cancel_validation`` (a solve is a pure function of its request, and the service caches it, so
  sending it twice is harmless; a submission sent twice would train twice);
- the service answered 503 (``solve_timeout``, ``cache_unavailable``): any call.

Nothing else is retried: not read timeouts (a slow solve would only be started again), not 429
(the caller decides whether to wait: the error's ``headers["Retry-After"]`` says how long), not
other errors. When the retries run out, a connection that could not be made raises ``SigpropError``
with code ``service_unreachable`` (status 503), naming the URL and hinting at ``sigprop serve``; it is
also the ``httpx.ConnectError`` / ``httpx.ConnectTimeout`` it stands for, so ``except`` clauses
written for those still catch it. A broken connection propagates as the ``httpx`` exception it is,
and a 503 raises ``SigpropError``. Every other answer outside 2xx raises
``SigpropError`` with the contract's ``code``, ``message``, ``hint`` and the HTTP ``status``
(code ``http_error`` when the body is not the contract's ``{"error": {...}}`` shape).

This module imports only httpx, pydantic and the import-light parts of sigprop.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from ..schemas.errors import SigpropError
from ..schemas.graph import Graph, Template
from ..schemas.solve import Solution, SolveRequest, Targets, TrainableOptions
from ..version import __version__
from .http_validations import AsyncValidationCalls, ValidationCalls

__all__ = ["Client", "AsyncClient", "DEFAULT_BASE_URL", "MAX_BACKOFF_S", "ServiceUnreachable"]

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# The longest wait between two attempts, whatever backoff, attempt number or Retry-After say.
MAX_BACKOFF_S = 10.0
# Connecting should never take as long as a solve may: the connect phase has its own, shorter limit.
CONNECT_TIMEOUT_S = 10.0

GraphLike = Graph | Template | Mapping[str, Any]
TargetsLike = Targets | Mapping[str, float]
TimeoutLike = float | httpx.Timeout | None

# The request never reached the service: safe to send again whatever it was.
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# The connection broke after (part of) the request may have been sent: only for idempotent calls.
_BROKEN_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError)


class ServiceUnreachable(SigpropError, httpx.TransportError):
    """No connection could be made to the service, after every retry: a ``SigpropError`` (code
    ``service_unreachable``) naming the URL, with a hint what to start or check. The raised object is
    one of the two subclasses below, which are also the httpx exception that stands behind it."""

    def __init__(self, base_url: str, exc: httpx.TransportError, attempts: int, elapsed: float):
        tried = f" ({attempts} attempts over {elapsed:.1f} s)" if attempts > 1 else ""
        reason = str(exc) or type(exc).__name__
        super().__init__(
            "service_unreachable",
            f"could not connect to the sigprop service at {base_url}: {reason}{tried}",
            "is the service running? Start one with `sigprop serve` (it listens on "
            f"{DEFAULT_BASE_URL} by default), or check the URL and port given to the client",
            # no answer came back; 503 is what a service that cannot serve answers, and retrying later
            # is the right reaction to both
            503,
        )
        self._request = getattr(exc, "_request", None)


class _UnreachableConnectError(ServiceUnreachable, httpx.ConnectError):
    pass


class _UnreachableConnectTimeout(ServiceUnreachable, httpx.ConnectTimeout):
    pass


def _unreachable(base_url: str, exc: httpx.TransportError, attempts: int, started: float) -> ServiceUnreachable:
    """What a connection that could not be made raises once the retries ran out."""
    kind = _UnreachableConnectTimeout if isinstance(exc, httpx.ConnectTimeout) else _UnreachableConnectError
    return kind(base_url, exc, attempts, time.monotonic() - started)


# Indirections so tests can observe the waits without sleeping.
_sleep = time.sleep
_async_sleep = asyncio.sleep


def _make_timeout(timeout: TimeoutLike) -> httpx.Timeout:
    if isinstance(timeout, httpx.Timeout):
        return timeout
    if timeout is None:
        return httpx.Timeout(None)
    timeout = float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return httpx.Timeout(connect=min(timeout, CONNECT_TIMEOUT_S), read=timeout, write=timeout, pool=timeout)


def _dump(value: Any, what: str) -> dict:
    """A request part as plain JSON data: pydantic models by their wire aliases, mappings as given."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{what} must be a dict or a sigprop.schemas model, not {type(value).__name__}")


def solve_body(
    graph: GraphLike,
    method: str,
    activation: str,
    targets: TargetsLike | None,
    init: str | None = None,
    trainable: TrainableOptions | Mapping[str, Any] | None = None,
    c_map_points: int | None = None,
    assumptions: str | None = None,
    attention: Mapping[str, Any] | None = None,
) -> dict:
    """The JSON body of ``POST /v1/solve`` from its parts, optional keys left out when None
    (``attention``: a sequence graph's shaping, e.g. ``{"shaping": "e-spa"}``)."""
    body: dict[str, Any] = {"graph": _dump(graph, "graph"), "method": method, "activation": activation}
    if attention is not None:
        body["attention"] = _dump(attention, "attention")
    if assumptions is not None:
        body["assumptions"] = assumptions
    if targets is not None:
        body["targets"] = _dump(targets, "targets")
    if init is not None:
        body["init"] = init
    if trainable is not None:
        body["trainable"] = _dump(trainable, "trainable")
    if c_map_points is not None:
        body["c_map_points"] = c_map_points
    return body


def request_body(request: SolveRequest | Mapping[str, Any]) -> dict:
    """A whole solve request (a ``SolveRequest`` or its JSON as a dict) as plain JSON data."""
    return _dump(request, "request")


def _query_value(value: Any) -> Any:
    # Lists (input_shape) travel as JSON text, which is what GET /v1/templates/{name} parses.
    if isinstance(value, (builtins.list, tuple)):
        return json.dumps(builtins.list(value), separators=(",", ":"))
    return value


def _path(segment: str) -> str:
    return quote(str(segment), safe="")


def error_from_response(response: httpx.Response) -> SigpropError:
    """The ``SigpropError`` a non-2xx answer stands for (contract section 3)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str) and err["code"]:
        message = err.get("message")
        hint = err.get("hint")
        # Retry-After (429 rate_limited, 503) stays readable: ``exc.headers["Retry-After"]``
        kept = {k: response.headers[k] for k in ("Retry-After",) if k in response.headers}
        return SigpropError(
            err["code"],
            message if isinstance(message, str) else "",
            hint if isinstance(hint, str) else "",
            response.status_code,
            headers=kept or None,
        )
    text = response.text.strip()
    request = response.request
    message = f"HTTP {response.status_code} {response.reason_phrase} from {request.method} {request.url}"
    if text:
        message += f": {text[:300]}"
    return SigpropError("http_error", message, "", response.status_code)


def _check(response: httpx.Response) -> httpx.Response:
    if not response.is_success:
        raise error_from_response(response)
    return response


class _Base:
    """What the blocking and the async client share: settings, request bodies, retry decisions."""

    def __init__(self, base_url: str, api_key: str | None, timeout: TimeoutLike, retries: int, backoff: float):
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a non-negative integer, got {retries!r}")
        if not backoff >= 0:
            raise ValueError(f"backoff must be a non-negative number of seconds, got {backoff!r}")
        self.base_url = str(base_url).rstrip("/")
        self.retries = retries
        self.backoff = float(backoff)
        self.timeout = _make_timeout(timeout)
        self._headers = {"Accept": "application/json", "User-Agent": f"sigprop-client/{__version__}"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, retries={self.retries}, backoff={self.backoff})"

    # -- retry policy ------------------------------------------------------------------------------
    def _delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (``attempt`` counts from 0)."""
        delay = self.backoff * 2**attempt
        if response is not None:
            try:
                delay = max(delay, float(response.headers.get("retry-after", "")))
            except ValueError:
                pass  # absent, or an HTTP date: keep the exponential delay
        return min(delay, MAX_BACKOFF_S)

    @staticmethod
    def _retryable(exc: httpx.TransportError, idempotent: bool) -> bool:
        if isinstance(exc, _CONNECT_ERRORS):
            return True
        return idempotent and isinstance(exc, _BROKEN_CONNECTION_ERRORS)

    # -- request bodies (also what sigprop.solve builds in-process) ----------------------------------
    _solve_body = staticmethod(solve_body)
    _request_body = staticmethod(request_body)

    @staticmethod
    def _list_params(offset: int, limit: int, method: str | None, activation: str | None) -> dict:
        params: dict[str, Any] = {"offset": offset, "limit": limit}
        if method is not None:
            params["method"] = method
        if activation is not None:
            params["activation"] = activation
        return params

    @staticmethod
    def _template_params(params: Mapping[str, Any]) -> dict:
        return {k: _query_value(v) for k, v in params.items() if v is not None}


class Client(ValidationCalls, _Base):
    """Blocking client for a sigprop service.

    >>> with Client("http://127.0.0.1:8000") as sp:
    ...     sol = sp.solve({"template": "mlp", "depth": 50}, "tat", "leaky_relu", {"eta": 0.9})
    ...     sol.negative_slope

    Validations (``http_validations``): ``submit_validation`` (the arguments of ``solve``, or
    ``key=``, and the training options) returns the job id; ``validation``, ``wait_validation``
    (with a timeout), ``validations`` and ``cancel_validation`` follow it.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        timeout: TimeoutLike = 30.0,
        retries: int = 3,
        backoff: float = 0.25,
        transport: httpx.BaseTransport | None = None,
    ):
        super().__init__(base_url, api_key, timeout, retries, backoff)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self._headers, timeout=self.timeout, transport=transport
        )

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- transport with retries --------------------------------------------------------------------
    def _send(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        idempotent: bool = True,
        retry_503: bool = True,
        retries: int | None = None,
    ) -> httpx.Response:
        limit = self.retries if retries is None else retries
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                response = self._http.request(method, path, params=params, json=json)
            except httpx.TransportError as exc:
                if attempt >= limit or not self._retryable(exc, idempotent):
                    if isinstance(exc, _CONNECT_ERRORS):
                        raise _unreachable(self.base_url, exc, attempt + 1, started) from exc
                    raise
                _sleep(self._delay(attempt))
            else:
                if response.status_code != 503 or not retry_503 or attempt >= limit:
                    return response
                _sleep(self._delay(attempt, response))
            attempt += 1

    def _pause(self, seconds: float) -> None:
        # the module's _sleep, looked up at each call (tests replace it); http_validations waits
        # through this method rather than importing this module back
        _sleep(seconds)

    def _json(self, method: str, path: str, **kwargs) -> Any:
        return _check(self._send(method, path, **kwargs)).json()

    # -- solving -----------------------------------------------------------------------------------
    def solve(
        self,
        graph: GraphLike,
        method: str,
        activation: str,
        targets: TargetsLike | None = None,
        *,
        init: str | None = None,
        trainable: TrainableOptions | Mapping[str, Any] | None = None,
        c_map_points: int | None = None,
        assumptions: str | None = None,
        attention: Mapping[str, Any] | None = None,
    ) -> Solution:
        """``POST /v1/solve``. ``graph`` is a ``sigprop.graph/v1`` graph or a template, as a dict or a
        ``Graph`` / ``Template`` model, e.g. ``{"template": "mlp", "depth": 50}``. ``assumptions="warn"``
        solves a graph outside the kernel theory instead of raising ``unsupported_structure``."""
        body = self._solve_body(
            graph, method, activation, targets, init, trainable, c_map_points, assumptions, attention
        )
        return self.solve_request(body)

    def solve_request(self, request: SolveRequest | Mapping[str, Any]) -> Solution:
        """``POST /v1/solve`` with a whole request (a ``SolveRequest`` or its JSON as a dict)."""
        response = _check(self._send("POST", "/v1/solve", json=self._request_body(request)))
        return Solution.model_validate_json(response.content)

    # -- stored solutions --------------------------------------------------------------------------
    def get(self, key: str) -> dict:
        """``GET /v1/solutions/{key}``: the stored record (summary, ``request`` and ``answer``); with keys
        configured the server wants one here unless ``SIGPROP_ANONYMOUS_STORED_READS``."""
        return self._json("GET", f"/v1/solutions/{_path(key)}")

    def list(self, offset: int = 0, limit: int = 50, method: str | None = None, activation: str | None = None) -> dict:
        """``GET /v1/solutions``: ``{"total", "offset", "limit", "items"}``."""
        return self._json("GET", "/v1/solutions", params=self._list_params(offset, limit, method, activation))

    def delete(self, key: str) -> dict:
        """``DELETE /v1/solutions/{key}`` (needs an admin key: ``SIGPROP_ADMIN_KEYS``; 403 with another)."""
        return self._json("DELETE", f"/v1/solutions/{_path(key)}", idempotent=False)

    # -- templates ---------------------------------------------------------------------------------
    def templates(self) -> builtins.list[dict]:
        """``GET /v1/templates``: each template's name, description and parameters."""
        return self._json("GET", "/v1/templates")

    def template(self, name: str, **params: Any) -> dict:
        """``GET /v1/templates/{name}``: the graph the template expands to, e.g. ``template("mlp", depth=3)``."""
        return self._json("GET", f"/v1/templates/{_path(name)}", params=self._template_params(params))

    # -- probes ------------------------------------------------------------------------------------
    def health(self) -> dict:
        """``GET /healthz``: ``{"status": "ok", "version", "engine_version"}``."""
        return self._json("GET", "/healthz")

    def ready(self) -> bool:
        """``GET /readyz`` once, without retries: True when the service is ready; False when it
        answers 503 or cannot be reached."""
        try:
            response = self._send("GET", "/readyz", retry_503=False, retries=0)
        except httpx.TransportError:
            return False
        if response.status_code == 503:
            return False
        _check(response)
        return True


class AsyncClient(AsyncValidationCalls, _Base):
    """The asyncio twin of ``Client``: the same constructor, and the same methods as coroutines.

    >>> async with AsyncClient("http://127.0.0.1:8000") as sp:
    ...     sol = await sp.solve({"template": "mlp", "depth": 50}, "tat", "leaky_relu", {"eta": 0.9})
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        timeout: TimeoutLike = 30.0,
        retries: int = 3,
        backoff: float = 0.25,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        super().__init__(base_url, api_key, timeout, retries, backoff)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=self.timeout, transport=transport
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def _send(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        idempotent: bool = True,
        retry_503: bool = True,
        retries: int | None = None,
    ) -> httpx.Response:
        limit = self.retries if retries is None else retries
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                response = await self._http.request(method, path, params=params, json=json)
            except httpx.TransportError as exc:
                if attempt >= limit or not self._retryable(exc, idempotent):
                    if isinstance(exc, _CONNECT_ERRORS):
                        raise _unreachable(self.base_url, exc, attempt + 1, started) from exc
                    raise
                await _async_sleep(self._delay(attempt))
            else:
                if response.status_code != 503 or not retry_503 or attempt >= limit:
                    return response
                await _async_sleep(self._delay(attempt, response))
            attempt += 1

    async def _json(self, method: str, path: str, **kwargs) -> Any:
        return _check(await self._send(method, path, **kwargs)).json()

    async def solve(
        self,
        graph: GraphLike,
        method: str,
        activation: str,
        targets: TargetsLike | None = None,
        *,
        init: str | None = None,
        trainable: TrainableOptions | Mapping[str, Any] | None = None,
        c_map_points: int | None = None,
        assumptions: str | None = None,
        attention: Mapping[str, Any] | None = None,
    ) -> Solution:
        """``POST /v1/solve`` (see ``Client.solve``)."""
        body = self._solve_body(
            graph, method, activation, targets, init, trainable, c_map_points, assumptions, attention
        )
        return await self.solve_request(body)

    async def solve_request(self, request: SolveRequest | Mapping[str, Any]) -> Solution:
        response = _check(await self._send("POST", "/v1/solve", json=self._request_body(request)))
        return Solution.model_validate_json(response.content)

    async def get(self, key: str) -> dict:
        return await self._json("GET", f"/v1/solutions/{_path(key)}")

    async def list(
        self, offset: int = 0, limit: int = 50, method: str | None = None, activation: str | None = None
    ) -> dict:
        return await self._json("GET", "/v1/solutions", params=self._list_params(offset, limit, method, activation))

    async def delete(self, key: str) -> dict:
        return await self._json("DELETE", f"/v1/solutions/{_path(key)}", idempotent=False)

    async def templates(self) -> builtins.list[dict]:
        return await self._json("GET", "/v1/templates")

    async def template(self, name: str, **params: Any) -> dict:
        return await self._json("GET", f"/v1/templates/{_path(name)}", params=self._template_params(params))

    async def health(self) -> dict:
        return await self._json("GET", "/healthz")

    async def ready(self) -> bool:
        try:
            response = await self._send("GET", "/readyz", retry_503=False, retries=0)
        except httpx.TransportError:
            return False
        if response.status_code == 503:
            return False
        _check(response)
        return True
