"""The Python client `sigprop.client` (Client, AsyncClient) against a real `sigprop serve`.

Everything except the retry-policy unit tests runs over real HTTP on loopback: the service under
uvicorn with its embedded SQLite cache, and, for answers that are not the contract's shape, a tiny
stdlib HTTP server. The retry tests on 503 and broken connections use ``httpx.MockTransport``,
because the real service cannot be made to answer 503 twice and then 200 on demand.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import sigprop.client.http as client_http
from sigprop.client import AsyncClient, Client, SigpropError, Solution
from sigprop.schemas import Graph, SolveRequest, Targets, Template

from ..service_fixtures import LOOPBACK, free_port, running_service, start_service

API_KEYS = "client-key-one-0123456789,client-key-two-0123456789"
GOOD_KEY = "client-key-two-0123456789"
ADMIN_KEY = "client-admin-key-0123456789"  # deletes cached solutions (shared by every key)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    env = {"SIGPROP_API_KEYS": API_KEYS, "SIGPROP_ADMIN_KEYS": ADMIN_KEY}
    with running_service(tmp_path_factory.mktemp("svc-client"), env) as svc:
        yield svc


@pytest.fixture
def client(service):
    with Client(service.base_url, api_key=GOOD_KEY) as c:
        yield c


@pytest.fixture
def anon(service):
    """A client without an API key."""
    with Client(service.base_url) as c:
        yield c


def mlp(depth: int, width: int = 8) -> dict:
    return {"template": "mlp", "depth": depth, "width": width}


def without_cached(answer: dict) -> dict:
    return {k: v for k, v in answer.items() if k != "cached"}


def wire(solution: Solution) -> dict:
    """The solution as the service writes it (contract keys by alias, absent values omitted)."""
    return json.loads(solution.to_json())


class CountingTransport(httpx.BaseTransport):
    """A real HTTP transport that counts the requests it is asked to send."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.attempts = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


class AsyncCountingTransport(httpx.AsyncBaseTransport):
    def __init__(self):
        self.inner = httpx.AsyncHTTPTransport()
        self.attempts = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture
def sleeps(monkeypatch):
    """Record the client's back-off waits instead of sleeping."""
    waits: list[float] = []

    async def fake_async_sleep(seconds):
        waits.append(seconds)

    monkeypatch.setattr(client_http, "_sleep", waits.append)
    monkeypatch.setattr(client_http, "_async_sleep", fake_async_sleep)
    return waits


# -- solving ------------------------------------------------------------------------------------


def test_solve_returns_a_typed_solution_equal_to_the_http_json(service, client):
    body = {"graph": mlp(12), "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.3}}
    sol = client.solve(mlp(12), "tat", "leaky_relu", {"eta": 0.3})
    assert isinstance(sol, Solution)
    assert sol.cached is False
    assert 0.0 <= sol.negative_slope < 1.0 and sol.c_f_0 == pytest.approx(0.3, abs=1e-6)
    assert [layer.id for layer in sol.layers][:1] == ["dense_0"]
    raw = httpx.post(f"{service.base_url}/v1/solve", json=body, timeout=30.0)
    assert raw.status_code == 200
    answer = raw.json()
    assert answer["cached"] is True and answer["key"] == sol.key
    assert without_cached(wire(sol)) == without_cached(answer)
    # Parsing the HTTP JSON gives the same model, field by field.
    assert Solution.model_validate(answer).model_copy(update={"cached": False}) == sol


def test_second_solve_is_cached(client):
    first = client.solve(mlp(20), "tat", "leaky_relu", Targets(eta=0.5))
    second = client.solve(mlp(20), "tat", "leaky_relu", {"eta": 0.5})
    assert (first.cached, second.cached) == (False, True)
    assert second.key == first.key
    assert without_cached(wire(second)) == without_cached(wire(first))


def test_graph_models_templates_and_whole_requests_give_the_same_key(client):
    base = client.solve(mlp(6), "tat", "leaky_relu", {"eta": 0.2})
    from_template_model = client.solve(Template(template="mlp", depth=6, width=8), "tat", "leaky_relu", {"eta": 0.2})
    expanded = Graph.model_validate(client.template("mlp", depth=6, width=8))
    from_graph_model = client.solve(expanded, "tat", "leaky_relu", {"eta": 0.2})
    request = SolveRequest.model_validate(
        {"graph": mlp(6), "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.2}}
    )
    from_request_model = client.solve_request(request)
    from_request_dict = client.solve_request(
        {"graph": mlp(6), "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.2}}
    )
    keys = {s.key for s in (base, from_template_model, from_graph_model, from_request_model, from_request_dict)}
    assert keys == {base.key}
    assert from_graph_model.cached and from_request_model.cached


def test_solve_options_reach_the_service(client):
    sol = client.solve(mlp(4), "eoc", "tanh", init="gaussian", c_map_points=5)
    assert sol.method == "eoc" and sol.sigma_w2 is not None
    assert {layer.distribution for layer in sol.layers} == {"gaussian"}
    assert len(sol.c_map.c) == 5


# -- stored solutions and keys ------------------------------------------------------------------


def test_get_list_and_delete_with_and_without_a_key(service, client, anon):
    sol = client.solve(mlp(9), "tat", "leaky_relu", {"eta": 0.4})

    # stored solutions (someone's requests and graphs) are read with a key when keys are configured
    for call in (lambda: anon.get(sol.key), lambda: anon.list()):
        with pytest.raises(SigpropError) as closed:
            call()
        assert (closed.value.code, closed.value.status) == ("unauthorized", 401)
    record = client.get(sol.key)
    assert record["key"] == sol.key and record["method"] == "tat"
    assert record["answer"]["key"] == sol.key
    assert record["request"]["graph"] == mlp(9)

    listed = client.list(method="tat", activation="leaky_relu", limit=500)
    assert {"total", "offset", "limit", "items"} <= set(listed) and listed["limit"] == 500
    assert sol.key in {item["key"] for item in listed["items"]}
    assert all(item["method"] == "dks" for item in client.list(method="dks")["items"])
    page = client.list(offset=0, limit=1)
    assert len(page["items"]) == 1 and page["total"] >= 1

    with pytest.raises(SigpropError) as missing:
        anon.delete(sol.key)
    assert (missing.value.code, missing.value.status) == ("unauthorized", 401)
    assert "Bearer" in missing.value.hint
    with Client(service.base_url, api_key="not-a-key") as wrong, pytest.raises(SigpropError) as bad:
        wrong.delete(sol.key)
    assert (bad.value.code, bad.value.status) == ("forbidden", 403)
    with pytest.raises(SigpropError) as not_admin:  # a valid key, but deleting takes an admin key
        client.delete(sol.key)
    assert (not_admin.value.code, not_admin.value.status) == ("forbidden", 403)
    assert "SIGPROP_ADMIN_KEYS" in not_admin.value.hint
    assert client.get(sol.key)["key"] == sol.key  # still there

    with Client(service.base_url, api_key=ADMIN_KEY) as admin:
        assert admin.delete(sol.key) == {"key": sol.key, "deleted": True}
        for call in (lambda: client.get(sol.key), lambda: admin.delete(sol.key)):
            with pytest.raises(SigpropError) as gone:
                call()
            assert (gone.value.code, gone.value.status) == ("not_found", 404)
            assert gone.value.message and gone.value.hint


# -- templates and probes -----------------------------------------------------------------------


def test_templates_and_template_expansion(client):
    names = [t["name"] for t in client.templates()]
    assert {"mlp", "resnet", "densenet", "cnn"} <= set(names)
    graph = client.template("mlp", depth=3, width=8)
    assert graph["schema"] == "sigprop.graph/v1"
    assert sum(1 for n in graph["nodes"] if n["op"] == "activation") == 3
    cnn = client.template("cnn", depth=2, input_shape=[3, 8, 8])  # a list travels as JSON text
    assert [n["shape"] for n in cnn["nodes"] if n["op"] == "input"] == [[3, 8, 8]]
    with pytest.raises(SigpropError) as unknown:
        client.template("unet")
    assert (unknown.value.code, unknown.value.status) == ("not_found", 404)
    with pytest.raises(SigpropError) as bad:
        client.template("resnet", depth=19)
    assert (bad.value.code, bad.value.status) == ("invalid_request", 422)


def test_health_and_ready(client):
    health = client.health()
    assert health["status"] == "ok" and health["version"] and health["engine_version"]
    assert client.ready() is True


def test_ready_is_false_without_a_server_and_tries_once():
    transport = CountingTransport()
    with Client(f"http://{LOOPBACK}:{free_port()}", transport=transport, backoff=5.0) as c:
        start = time.monotonic()
        assert c.ready() is False
    assert transport.attempts == 1 and time.monotonic() - start < 5.0


# -- errors -------------------------------------------------------------------------------------

CYCLE = {
    "schema": "sigprop.graph/v1",
    "nodes": [
        {"id": "x", "op": "input", "shape": [4]},
        {"id": "a", "op": "dense", "inputs": ["b"], "units": 4},
        {"id": "b", "op": "activation", "inputs": ["a"]},
        {"id": "out", "op": "output", "inputs": ["b"]},
    ],
}

ATTENTION = {
    "schema": "sigprop.graph/v1",
    "nodes": [
        {"id": "x", "op": "input", "shape": [4]},
        {"id": "t", "op": "lstm", "inputs": ["x"]},
        {"id": "out", "op": "output", "inputs": ["t"]},
    ],
}

ERROR_CASES = [
    pytest.param((mlp(10), "tat", "leaky_relu", {"eta": 0.9}), {}, "unreachable_target", id="unreachable_target"),
    pytest.param((mlp(10), "tat", "leaky_relu", {"zeta": 1.5}), {}, "invalid_target", id="invalid_target"),
    pytest.param(
        (mlp(10), "tat", "no_such_fn", {"tau": 0.3}), {}, "unsupported_activation", id="unsupported_activation"
    ),
    pytest.param((mlp(10), "no_such_method", "leaky_relu", {}), {}, "unsupported_method", id="unsupported_method"),
    pytest.param((CYCLE, "tat", "leaky_relu", {"eta": 0.3}), {}, "invalid_graph", id="invalid_graph"),
    pytest.param((ATTENTION, "tat", "leaky_relu", {"eta": 0.3}), {}, "unsupported_op", id="unsupported_op"),
    pytest.param(
        (mlp(10), "tat", "leaky_relu", {"eta": 0.3}), {"c_map_points": 1}, "invalid_request", id="invalid_request"
    ),
]


@pytest.mark.parametrize("args, kwargs, code", ERROR_CASES)
def test_rejected_requests_raise_sigprop_error_with_the_contract_code(service, args, kwargs, code):
    transport = CountingTransport()
    with Client(service.base_url, transport=transport) as c, pytest.raises(SigpropError) as exc:
        c.solve(*args, **kwargs)
    err = exc.value
    assert (err.code, err.status) == (code, 422)
    assert isinstance(err.message, str) and err.message
    assert isinstance(err.hint, str)
    assert str(err).startswith(f"{code}: ")
    assert transport.attempts == 1  # 4xx is never retried
    # Exactly what the service answers over plain HTTP.
    graph, method, activation, targets = args
    raw = httpx.post(
        f"{service.base_url}/v1/solve",
        timeout=30.0,
        json={"graph": graph, "method": method, "activation": activation, "targets": targets, **kwargs},
    )
    assert raw.status_code == 422 and raw.json() == err.to_dict()


def test_unreachable_target_carries_a_hint(client):
    with pytest.raises(SigpropError) as exc:
        client.solve(mlp(10), "tat", "leaky_relu", {"eta": 0.9})
    assert exc.value.code == "unreachable_target" and exc.value.status == 422
    assert exc.value.hint and "eta" in exc.value.hint


class _StubHandler(BaseHTTPRequestHandler):
    """Answers that are not the contract's error shape, and a record of the headers it saw."""

    seen_headers: list[dict] = []
    routes = {
        "/teapot": (418, "text/plain", b"I'm a teapot"),
        "/v1/solutions/detail": (400, "application/json", b'{"detail": "not the contract shape"}'),
        "/v1/solutions/bad-gateway": (502, "text/html", b"<html>bad gateway</html>"),
        "/healthz": (200, "application/json", b'{"status": "ok"}'),
    }

    def do_GET(self):
        type(self).seen_headers.append(dict(self.headers))
        status, ctype, body = self.routes.get(self.path, (404, "text/plain", b""))
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def stub_server():
    server = ThreadingHTTPServer((LOOPBACK, 0), _StubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_answers_outside_the_contract_shape_raise_http_error(stub_server):
    with Client(stub_server, retries=0) as c:
        for key, status in (("detail", 400), ("bad-gateway", 502)):
            with pytest.raises(SigpropError) as exc:
                c.get(key)
            assert (exc.value.code, exc.value.status) == ("http_error", status)
            assert str(status) in exc.value.message and exc.value.hint == ""
        with pytest.raises(SigpropError) as empty:
            c.get("nothing-here")  # 404 with an empty body
        assert (empty.value.code, empty.value.status) == ("http_error", 404)


def test_bearer_header_only_with_an_api_key(stub_server):
    _StubHandler.seen_headers.clear()
    with Client(stub_server) as c:
        c.health()
    with Client(stub_server, api_key="secret-key") as c:
        c.health()
    without, with_key = ({k.lower(): v for k, v in h.items()} for h in _StubHandler.seen_headers)
    assert "authorization" not in without
    assert with_key["authorization"] == "Bearer secret-key"
    assert with_key["user-agent"].startswith("sigprop-client/")


# -- AsyncClient --------------------------------------------------------------------------------


def test_async_client_does_the_same(service):
    async def scenario():
        async with AsyncClient(service.base_url, api_key=GOOD_KEY) as c, AsyncClient(service.base_url) as anon:
            assert (await c.health())["status"] == "ok"
            assert await c.ready() is True
            first = await c.solve(mlp(15), "tat", "leaky_relu", {"eta": 0.45})
            second = await c.solve_request(
                {"graph": mlp(15), "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.45}}
            )
            assert isinstance(first, Solution) and (first.cached, second.cached) == (False, True)
            assert second.key == first.key

            # Concurrent solves share the connection pool.
            many = await asyncio.gather(*(c.solve(mlp(15), "tat", "leaky_relu", {"eta": 0.45}) for _ in range(8)))
            assert {s.key for s in many} == {first.key} and all(s.cached for s in many)

            with pytest.raises(SigpropError) as closed:  # stored solutions: read with a key
                await anon.get(first.key)
            assert (closed.value.code, closed.value.status) == ("unauthorized", 401)
            assert (await c.get(first.key))["answer"]["key"] == first.key
            assert first.key in {i["key"] for i in (await c.list(method="tat", limit=500))["items"]}
            assert "mlp" in {t["name"] for t in await anon.templates()}
            graph = await anon.template("mlp", depth=2, width=4)
            assert sum(1 for n in graph["nodes"] if n["op"] == "activation") == 2

            with pytest.raises(SigpropError) as unauthorized:
                await anon.delete(first.key)
            assert (unauthorized.value.code, unauthorized.value.status) == ("unauthorized", 401)
            async with AsyncClient(service.base_url, api_key="wrong") as wrong:
                with pytest.raises(SigpropError) as forbidden:
                    await wrong.delete(first.key)
            assert (forbidden.value.code, forbidden.value.status) == ("forbidden", 403)
            with pytest.raises(SigpropError) as not_admin:
                await c.delete(first.key)
            assert (not_admin.value.code, not_admin.value.status) == ("forbidden", 403)
            async with AsyncClient(service.base_url, api_key=ADMIN_KEY) as admin:
                assert await admin.delete(first.key) == {"key": first.key, "deleted": True}
            with pytest.raises(SigpropError) as gone:
                await c.get(first.key)
            assert gone.value.code == "not_found"

            with pytest.raises(SigpropError) as unreachable:
                await c.solve(mlp(10), "tat", "leaky_relu", {"eta": 0.9})
            assert unreachable.value.code == "unreachable_target" and unreachable.value.hint

    asyncio.run(scenario())


def test_async_client_retries_connection_errors_then_raises():
    async def scenario():
        transport = AsyncCountingTransport()
        start = time.monotonic()
        async with AsyncClient(f"http://{LOOPBACK}:{free_port()}", retries=2, backoff=0.01, transport=transport) as c:
            with pytest.raises(httpx.ConnectError):
                await c.health()
            assert await c.ready() is False
        return transport.attempts, time.monotonic() - start

    attempts, elapsed = asyncio.run(scenario())
    assert attempts == 3 + 1  # 1 + retries for health, a single try for ready
    assert elapsed < 5.0


# -- retries ------------------------------------------------------------------------------------


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_connection_refused_is_retried_then_raised_within_bounded_time(retries):
    transport = CountingTransport()
    url = f"http://{LOOPBACK}:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with Client(url, retries=retries, backoff=0.02, transport=transport) as c, pytest.raises(httpx.ConnectError):
        c.solve(mlp(3), "tat", "leaky_relu", {"eta": 0.1})
    elapsed = time.monotonic() - start
    assert transport.attempts == retries + 1
    assert elapsed < 0.02 * (2**retries) + 5.0


def test_backoff_is_exponential_and_capped(sleeps):
    url = f"http://{LOOPBACK}:{free_port()}"
    with Client(url, retries=3, transport=CountingTransport()) as c, pytest.raises(httpx.ConnectError):
        c.get("abc")
    assert sleeps == [0.25, 0.5, 1.0]  # the default backoff, 0.25 * 2**attempt
    sleeps.clear()
    with Client(url, retries=5, backoff=3.0) as c, pytest.raises(httpx.ConnectError):
        c.list()
    assert sleeps == [3.0, 6.0, client_http.MAX_BACKOFF_S, client_http.MAX_BACKOFF_S, client_http.MAX_BACKOFF_S]


def test_a_stopped_server_raises_the_contract_error_naming_the_url_and_sigprop_serve(sleeps):
    url = f"http://{LOOPBACK}:{free_port()}"  # nothing listens there
    with Client(url, retries=2) as c, pytest.raises(SigpropError) as exc:
        c.solve(mlp(3), "tat", "leaky_relu", {"eta": 0.1})
    err = exc.value
    assert (err.code, err.status) == ("service_unreachable", 503)
    assert url in err.message and "3 attempts" in err.message
    assert "sigprop serve" in err.hint and "URL and port" in err.hint
    assert "sigprop serve" in str(err)  # a traceback shows the hint too
    # still the httpx exception it stands for, so code written against httpx keeps catching it
    assert isinstance(err, httpx.ConnectError) and isinstance(err.__cause__, httpx.ConnectError)
    assert sleeps == [0.25, 0.5]  # the documented retries with backoff are what the wait is

    async def scenario():
        async with AsyncClient(url, retries=0) as ac:
            with pytest.raises(SigpropError) as aexc:
                await ac.health()
            assert await ac.ready() is False  # a probe answers False, it does not raise
        return aexc.value

    aerr = asyncio.run(scenario())
    assert aerr.code == "service_unreachable" and url in aerr.message and "sigprop serve" in aerr.hint
    assert "attempts over" not in aerr.message  # one try: no retry count to report


def test_a_connect_timeout_is_service_unreachable_and_still_a_connect_timeout(sleeps):
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("timed out", request=request)

    with Client("http://sigprop.invalid:9", retries=1, transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(httpx.ConnectTimeout) as exc:
            c.health()
    assert isinstance(exc.value, SigpropError) and exc.value.code == "service_unreachable"
    assert "http://sigprop.invalid:9" in exc.value.message and sleeps == [0.25]


def test_a_broken_connection_still_raises_the_httpx_error(sleeps):
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("connection reset", request=request)

    with Client("http://sigprop.invalid:9", retries=1, transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(httpx.ReadError) as exc:
            c.delete("k")  # not idempotent: not retried
    assert not isinstance(exc.value, SigpropError) and sleeps == []


def _flaky(failures: int, status: int = 503, headers: dict | None = None):
    """A MockTransport answering ``status`` ``failures`` times, then a solve answer."""
    calls: list[httpx.Request] = []
    solution = {
        "key": "k" * 64,
        "engine_version": "2",
        "method": "eoc",
        "activation": "tanh",
        "targets": {},
        "sigma_w2": 1.0,
        "sigma_b2": 0.0,
        "layers": [],
        "cached": False,
        "warnings": [],
    }

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= failures:
            return httpx.Response(
                status,
                headers=headers,
                json={
                    "error": {
                        "code": "cache_unavailable",
                        "message": "the solution store cannot be reached right now",
                        "hint": "retry shortly",
                    }
                },
            )
        return httpx.Response(200, json=solution)

    return calls, handler


def test_503_is_retried_with_backoff_then_succeeds(sleeps):
    calls, handler = _flaky(2)
    with Client("http://sigprop.test", retries=3, backoff=0.1, transport=httpx.MockTransport(handler)) as c:
        sol = c.solve(mlp(3), "eoc", "tanh")
    assert isinstance(sol, Solution) and sol.sigma_w2 == 1.0
    assert len(calls) == 3 and sleeps == [0.1, 0.2]
    assert all(json.loads(r.content)["graph"] == mlp(3) for r in calls)  # the same request each time


def test_503_after_the_last_retry_raises_sigprop_error(sleeps):
    calls, handler = _flaky(100, headers={"Retry-After": "0.5"})
    with Client("http://sigprop.test", retries=2, backoff=0.1, transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(SigpropError) as exc:
            c.health()
    assert (exc.value.code, exc.value.status, exc.value.hint) == ("cache_unavailable", 503, "retry shortly")
    assert len(calls) == 3
    assert sleeps == [0.5, 0.5]  # Retry-After lengthens the wait (still capped)


def test_only_503_is_retried(sleeps):
    for status in (429, 500, 502, 422):
        calls, handler = _flaky(1, status=status, headers={"Retry-After": "7"})
        with Client("http://sigprop.test", transport=httpx.MockTransport(handler)) as c:
            with pytest.raises(SigpropError) as exc:
                c.health()
        assert len(calls) == 1, status
        assert exc.value.headers == {"Retry-After": "7"}  # the caller can decide to wait
    assert sleeps == []


def test_async_503_is_retried(sleeps):
    calls, handler = _flaky(2)

    async def scenario():
        async with AsyncClient("http://sigprop.test", backoff=0.1, transport=httpx.MockTransport(handler)) as c:
            return await c.solve(mlp(3), "eoc", "tanh")

    assert isinstance(asyncio.run(scenario()), Solution)
    assert len(calls) == 3 and sleeps == [0.1, 0.2]


def _broken(exc_type, failures: int = 1):
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if len(calls) <= failures:
            raise exc_type("connection broke", request=request)
        return httpx.Response(200, json={"key": "abc", "deleted": True})

    return calls, handler


@pytest.mark.parametrize("exc_type", [httpx.ReadError, httpx.RemoteProtocolError])
def test_broken_connections_are_retried_only_on_idempotent_calls(sleeps, exc_type):
    calls, handler = _broken(exc_type)
    with Client("http://sigprop.test", transport=httpx.MockTransport(handler)) as c:
        assert c.get("abc")["key"] == "abc"
    assert calls == ["GET", "GET"]

    calls, handler = _broken(exc_type)
    with Client("http://sigprop.test", transport=httpx.MockTransport(handler)) as c, pytest.raises(exc_type):
        c.delete("abc")  # may have happened on the server: not sent again
    assert calls == ["DELETE"]


def test_timeouts_and_other_transport_errors_are_not_retried(sleeps):
    for exc_type in (httpx.ReadTimeout, httpx.WriteError, httpx.WriteTimeout):
        calls, handler = _broken(exc_type)
        with Client("http://sigprop.test", transport=httpx.MockTransport(handler)) as c, pytest.raises(exc_type):
            c.get("abc")
        assert len(calls) == 1, exc_type
    calls, handler = _broken(httpx.ConnectTimeout, failures=2)
    with Client("http://sigprop.test", transport=httpx.MockTransport(handler)) as c:
        assert c.delete("abc")["deleted"] is True  # the request never left: safe even for DELETE
    assert len(calls) == 3


def test_constructor_settings():
    with Client() as c:
        assert c.base_url == "http://127.0.0.1:8000" and (c.retries, c.backoff) == (3, 0.25)
        assert c.timeout == httpx.Timeout(connect=10.0, read=30.0, write=30.0, pool=30.0)
    with Client("http://h:1/", timeout=httpx.Timeout(2.0)) as c:
        assert c.base_url == "http://h:1" and c.timeout == httpx.Timeout(2.0)
    for bad in ({"retries": -1}, {"backoff": -0.1}, {"timeout": 0}):
        with pytest.raises(ValueError):
            Client(**bad)
    with pytest.raises(TypeError):
        Client().solve(["not", "a", "graph"], "tat", "leaky_relu")


# -- import weight ------------------------------------------------------------------------------

BLOCKED = [
    "numpy",
    "scipy",
    "torch",
    "jax",
    "jaxlib",
    "fastapi",
    "starlette",
    "uvicorn",
    "redis",
    "prometheus_client",
    "pydantic_settings",
]

_BLOCKED_IMPORT = textwrap.dedent("""
    import importlib, json, sys
    BLOCKED = set(json.loads(sys.argv[1]))
    already = sorted(BLOCKED & {m.split(".")[0] for m in sys.modules})
    assert not already, f"imported before the test started: {already}"

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    for name in BLOCKED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        else:
            raise AssertionError(f"the blocker let {name} through")

    import sigprop.client
    from sigprop.client import AsyncClient, Client, SigpropError, Solution
    assert sigprop.client.__all__ == ["Client", "AsyncClient", "SigpropError", "Solution"]
    with Client(sys.argv[2]) as c:
        assert c.health()["status"] == "ok"
        sol = c.solve({"template": "mlp", "depth": 5, "width": 8}, "tat", "leaky_relu", {"eta": 0.25})
        assert isinstance(sol, Solution) and sol.negative_slope is not None
        try:
            c.solve({"template": "mlp", "depth": 10}, "tat", "leaky_relu", {"eta": 0.9})
        except SigpropError as e:
            assert e.code == "unreachable_target"
    loaded = sorted(BLOCKED & {m.split(".")[0] for m in sys.modules})
    assert not loaded, loaded
    print("ok", sorted(m for m in sys.modules if m.startswith("sigprop")))
""")


def test_client_imports_and_works_without_numpy_torch_jax_or_fastapi(service):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIGPROP_")}
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT, json.dumps(BLOCKED), service.base_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")
    loaded = json.loads(proc.stdout.split(" ", 1)[1].replace("'", '"'))
    assert "sigprop.client.http" in loaded
    assert not any(
        m.startswith(("sigprop.engine", "sigprop.api", "sigprop.cache", "sigprop.settings")) for m in loaded
    ), loaded


# The client side never imports the service: what it shares with it lives in sigprop.schemas.
SERVICE_MODULES = [
    "sigprop.engine",
    "sigprop.api",
    "sigprop.worker",
    "sigprop.cache",
    "sigprop.storage",
    "sigprop.dashboard",
]
SERVER_PACKAGES = [
    "fastapi",
    "starlette",
    "uvicorn",
    "redis",
    "rq",
    "scipy",
    "plotly",
    "limits",
    "jinja2",
    "prometheus_client",
    "pydantic_settings",
]

_ADAPTERS_IMPORT = textwrap.dedent("""
    import importlib, json, sys
    MODULES, PACKAGES = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))

    def blocked(name):
        return name.split(".")[0] in PACKAGES or any(name == m or name.startswith(m + ".") for m in MODULES)

    already = sorted(m for m in sys.modules if blocked(m))
    assert not already, f"imported before the test started: {already}"

    class Block:
        def find_spec(self, name, path=None, target=None):
            if blocked(name):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    for name in MODULES + sorted(PACKAGES):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        else:
            raise AssertionError(f"the blocker let {name} through")

    import sigprop.client
    import sigprop.client.jax as sjax
    import sigprop.client.torch as storch
    import jax
    import torch

    loaded = sorted(m for m in sys.modules if blocked(m))
    assert not loaded, f"imported by the client: {loaded}"

    # use them, so that imports made only when called count too; jaxlib itself loads scipy for
    # LAPACK the first time a QR runs (the orthogonal initializers), so scipy is let through now
    PACKAGES.discard("scipy")
    sol = sigprop.client.Solution.model_validate_json(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    graph = storch.graph_from_module(model, torch.randn(4, 8))
    report = storch.apply(model, sol, graph=graph, seed=0)
    assert report.complete and len(report.layers) == 2, report.summary()
    assert storch.native_module("silu") is not None and storch.TransformedActivation("cst").name == "cst"
    params = {"0": {"kernel": jax.numpy.zeros((8, 16)), "bias": jax.numpy.zeros(16)},
              "2": {"kernel": jax.numpy.zeros((16, 3)), "bias": jax.numpy.zeros(3)}}
    _, jax_report = sjax.apply_to_params(params, sol, None, jax.random.PRNGKey(0))
    assert jax_report.ok, str(jax_report)
    assert float(sjax.transformed_activation(sol)(-1.0)) < 0.0

    loaded = sorted(m for m in sys.modules if blocked(m))
    assert not loaded, f"imported by the client at work: {loaded}"
    print("ok", sorted(m for m in sys.modules if m.startswith("sigprop")))
""")


def test_client_and_framework_adapters_import_nothing_of_the_service():
    """sigprop.client, sigprop.client.torch and sigprop.client.jax, imported and used (graph
    extraction, apply, JAX initializers), import no engine, API, worker, cache, storage or dashboard
    module and no server package (fastapi, redis, rq, scipy, plotly, ...)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("jax")
    from sigprop.client.torch import graph_from_module
    from sigprop.engine.solve import solve

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    graph = graph_from_module(model, torch.randn(4, 8))
    sol = solve(
        SolveRequest.model_validate(
            {"graph": graph, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.2}}
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIGPROP_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _ADAPTERS_IMPORT,
            json.dumps(SERVICE_MODULES),
            json.dumps(SERVER_PACKAGES),
            sol.model_dump_json(exclude_none=True),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("ok")
    loaded = json.loads(proc.stdout.split(" ", 1)[1].replace("'", '"'))
    assert {"sigprop.client.torch", "sigprop.client.jax", "sigprop.schemas.activations"} <= set(loaded), loaded


def test_rate_limited_error_carries_retry_after(tmp_path):
    """A real service with a cold-solve budget of one per minute: the second cold solve raises
    rate_limited (not retried), and the error says how long to wait; a cache hit still answers."""
    svc = start_service(
        tmp_path,
        {
            "SIGPROP_REDIS_URL": None,
            "SIGPROP_DATA_DIR": str(tmp_path / "data"),
            "SIGPROP_RATE_LIMIT_COLD_SOLVES": "1/minute",
        },
    )
    try:
        with Client(svc.base_url) as c:
            first = c.solve(mlp(3), "tat", "leaky_relu", {"eta": 0.5})
            with pytest.raises(SigpropError) as exc:
                c.solve(mlp(3), "tat", "leaky_relu", {"eta": 0.6})
            assert (exc.value.code, exc.value.status) == ("rate_limited", 429)
            assert 1 <= int(exc.value.headers["Retry-After"]) <= 60
            assert exc.value.hint
            assert c.solve(mlp(3), "tat", "leaky_relu", {"eta": 0.5}).key == first.key  # hits are never limited
    finally:
        svc.stop()
