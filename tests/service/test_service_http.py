"""End-to-end tests of the HTTP service (contract sections 2-3).

The real app runs under uvicorn (`python -m sigprop.cli serve`, the console script's module) on a
loopback port and is spoken to over real HTTP with httpx. The main tests run once per cache backend:
the shared Redis (database 14 only, flushed when its server starts) and the embedded SQLite cache
(SIGPROP_REDIS_URL unset, SIGPROP_DATA_DIR in a temporary folder).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from sigprop.storage.hot import FLUSH_S

from ..service_fixtures import (
    SHARED_REDIS_URL,
    assert_error,
    flush_shared_redis,
    metric_value,
    requests_by_pid,
    start_service,
    strip_cached,
)

API_KEYS = "test-key-one-0123456789,test-key-two-0123456789"
GOOD_KEY = "test-key-two-0123456789"
ADMIN_KEY = "test-admin-key-0123456789"
# stored solutions are read with a key: with keys configured they are closed to anonymous callers
# unless SIGPROP_ANONYMOUS_STORED_READS (issue 35)
READER = {"Authorization": f"Bearer {GOOD_KEY}"}
BACKENDS = ["sqlite", "redis"]


def _backend_env(backend: str, tmp: Path) -> dict:
    env = {"SIGPROP_DATA_DIR": str(tmp / "data"), "SIGPROP_API_KEYS": API_KEYS, "SIGPROP_ADMIN_KEYS": ADMIN_KEY}
    if backend == "redis":
        flush_shared_redis()  # skips the test when there is no Redis at 127.0.0.1:6379
        env["SIGPROP_REDIS_URL"] = SHARED_REDIS_URL
    else:
        env["SIGPROP_REDIS_URL"] = None
    return env


@pytest.fixture(scope="module", params=BACKENDS)
def service(request, tmp_path_factory):
    """One server per backend for the whole module (tests below never depend on each other's data)."""
    tmp = tmp_path_factory.mktemp(f"svc-{request.param}")
    svc = start_service(tmp, _backend_env(request.param, tmp))
    svc.backend = request.param
    request.addfinalizer(svc.stop)
    return svc


@pytest.fixture
def client(service):
    with httpx.Client(base_url=service.base_url, timeout=30.0) as c:
        yield c


@pytest.fixture(scope="module")
def limits_service(tmp_path_factory):
    """A dedicated server with tiny limits: 10 nodes, 1000-byte bodies (the smallest allowed)."""
    tmp = tmp_path_factory.mktemp("svc-limits")
    svc = start_service(
        tmp,
        {
            "SIGPROP_REDIS_URL": None,
            "SIGPROP_DATA_DIR": str(tmp / "data"),
            "SIGPROP_MAX_NODES": "10",
            "SIGPROP_MAX_BODY_BYTES": "1000",
        },
    )
    yield svc
    svc.stop()


# -- requests -----------------------------------------------------------------------------------


def mlp(depth: int, width: int = 16, method: str = "tat", activation: str = "leaky_relu", targets=None) -> dict:
    return {
        "graph": {"template": "mlp", "depth": depth, "width": width},
        "method": method,
        "activation": activation,
        "targets": {"eta": 0.5} if targets is None else targets,
    }


def graph_request(nodes: list[dict], targets=None) -> dict:
    return {
        "graph": {"schema": "sigprop.graph/v1", "nodes": nodes},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.3} if targets is None else targets,
    }


# A small residual network with distinctive ids ...
RESIDUAL = [
    {"id": "alpha_in", "op": "input", "shape": [16]},
    {"id": "alpha_fc1", "op": "dense", "inputs": ["alpha_in"], "units": 16},
    {"id": "alpha_act1", "op": "activation", "inputs": ["alpha_fc1"]},
    {"id": "alpha_fc2", "op": "dense", "inputs": ["alpha_act1"], "units": 16},
    {"id": "alpha_act2", "op": "activation", "inputs": ["alpha_fc2"]},
    {"id": "alpha_fc3", "op": "dense", "inputs": ["alpha_act2"], "units": 16},
    {"id": "alpha_add", "op": "sum", "inputs": ["alpha_fc1", "alpha_fc3"], "weights": [0.6, 0.8]},
    {"id": "alpha_act3", "op": "activation", "inputs": ["alpha_add"]},
    {"id": "alpha_head", "op": "dense", "inputs": ["alpha_act3"], "units": 10},
    {"id": "alpha_out", "op": "output", "inputs": ["alpha_head"]},
]
# ... and the same network, nodes in another order and every id renamed.
RENAME = {
    "alpha_in": "q7_source",
    "alpha_fc1": "q7_m",
    "alpha_act1": "q7_b",
    "alpha_fc2": "q7_zz",
    "alpha_act2": "q7_k",
    "alpha_fc3": "q7_a",
    "alpha_add": "q7_join",
    "alpha_act3": "q7_x",
    "alpha_head": "q7_cls",
    "alpha_out": "q7_sink",
}


def renamed(nodes: list[dict]) -> list[dict]:
    out = []
    for nd in nodes:
        nd = dict(nd, id=RENAME[nd["id"]])
        if "inputs" in nd:
            nd["inputs"] = [RENAME[i] for i in nd["inputs"]]
        out.append(nd)
    order = [3, 9, 0, 6, 1, 8, 4, 2, 7, 5]  # a fixed shuffle, not just a reversal
    return [out[i] for i in order]


def post_solve(c: httpx.Client, req, **kwargs) -> httpx.Response:
    return c.post("/v1/solve", json=req, **kwargs)


def cli_solve(tmp_path: Path, req: dict, name: str = "request.json") -> subprocess.Popen:
    """`sigprop solve FILE` in a subprocess (started now, read with .communicate())."""
    path = tmp_path / name
    path.write_text(json.dumps(req))
    return subprocess.Popen(
        [sys.executable, "-m", "sigprop.cli", "solve", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def cli_output(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err.decode()
    return out.decode()


# -- health, readiness, templates ---------------------------------------------------------------


def test_healthz_readyz(service, client):
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = client.get("/readyz")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ready" and body["cache"] == service.backend and body["cache_reachable"] is True


def test_templates(client):
    r = client.get("/v1/templates")
    assert r.status_code == 200
    names = {t["name"] for t in r.json()}
    assert {"mlp", "resnet", "densenet", "cnn"} <= names

    r = client.get("/v1/templates/mlp", params={"depth": 3})
    assert r.status_code == 200, r.text
    graph = r.json()
    assert graph["schema"] == "sigprop.graph/v1"
    ops = [nd["op"] for nd in graph["nodes"]]
    assert ops.count("activation") == 3 and ops.count("output") == 1 and ops.count("input") == 1

    # the expansion is the template: solving it hand-written gives the template's key
    key_template = post_solve(client, mlp(3, width=512)).json()["key"]
    key_graph = post_solve(client, {**mlp(3, width=512), "graph": graph}).json()["key"]
    assert key_template == key_graph


# -- solve, cache, CLI --------------------------------------------------------------------------


def test_solve_twice_is_cached_and_matches_cli(client, tmp_path):
    req = mlp(4, width=32, targets={"eta": 0.45})
    cli = cli_solve(tmp_path, req)  # runs while the server answers

    first = post_solve(client, req)
    assert first.status_code == 200, first.text
    assert first.headers["content-type"].startswith("application/json")
    a = first.json()
    assert a["cached"] is False and a["warnings"] == [] and a["method"] == "tat"
    assert first.headers["x-sigprop-key"] == a["key"]

    second = post_solve(client, req)
    assert second.status_code == 200, second.text
    assert second.json()["cached"] is True
    assert second.headers["x-sigprop-key"] == a["key"]
    # byte-identical apart from "cached"
    assert strip_cached(second.text) == strip_cached(first.text)

    # the CLI prints exactly the answer (it never caches: "cached": false, like the first answer)
    stdout = cli_output(cli)
    assert stdout == first.text + "\n"
    assert strip_cached(stdout.rstrip("\n")) == strip_cached(second.text)


def test_get_solution_by_key(client):
    req = mlp(3, width=24, targets={"eta": 0.35})
    answer = post_solve(client, req).json()
    post_solve(client, req)  # one hit

    assert_error(client.get(f"/v1/solutions/{answer['key']}"), 401, "unauthorized")  # stored: keyed
    r = client.get(f"/v1/solutions/{answer['key']}", headers=READER)
    assert r.status_code == 200, r.text
    rec = r.json()
    assert rec["key"] == answer["key"]
    assert rec["method"] == "tat" and rec["activation"] == "leaky_relu"
    assert rec["targets"] == {"eta": 0.35}
    assert rec["request"] == req
    assert rec["hits"] >= 1
    assert rec["answer"] == {**answer, "cached": True}


def test_list_newest_first_pagination_and_filters(client):
    keys = []
    for q in (1.0, 1.5, 2.0):  # oldest to newest
        r = post_solve(client, mlp(3, width=8, method="eoc", activation="softsign", targets={"q_star": q}))
        assert r.status_code == 200, r.text
        keys.append(r.json()["key"])
    other_act = post_solve(client, mlp(3, width=8, method="eoc", activation="tanh", targets={})).json()["key"]
    other_method = post_solve(client, mlp(3, width=8, method="dks", activation="softsign", targets={"zeta": 1.5}))
    assert other_method.status_code == 200, other_method.text
    other_method = other_method.json()["key"]
    newest_first = keys[::-1]

    def listing(**params):
        r = client.get("/v1/solutions", params=params, headers=READER)
        assert r.status_code == 200, r.text
        return r.json()

    both = listing(method="eoc", activation="softsign")
    assert both["total"] == 3 and both["offset"] == 0
    assert [it["key"] for it in both["items"]] == newest_first
    assert all(it["method"] == "eoc" and it["activation"] == "softsign" for it in both["items"])
    assert {"key", "created", "method", "activation", "targets", "hits"} <= set(both["items"][0])

    page = listing(method="eoc", activation="softsign", offset=1, limit=1)
    assert page["total"] == 3 and page["offset"] == 1 and page["limit"] == 1
    assert [it["key"] for it in page["items"]] == [newest_first[1]]
    page = listing(method="eoc", activation="softsign", offset=2, limit=5)
    assert [it["key"] for it in page["items"]] == [newest_first[2]]
    assert listing(method="eoc", activation="softsign", offset=3)["items"] == []

    by_method = listing(method="eoc", limit=500)
    got = [it["key"] for it in by_method["items"]]
    assert all(it["method"] == "eoc" for it in by_method["items"])
    assert got.index(other_act) < got.index(newest_first[0]) < got.index(newest_first[1]) < got.index(newest_first[2])
    assert other_method not in got

    by_act = listing(activation="softsign", limit=500)
    got = [it["key"] for it in by_act["items"]]
    assert all(it["activation"] == "softsign" for it in by_act["items"])
    assert got[:4] == [other_method] + newest_first and other_act not in got

    everything = listing(limit=500)
    assert everything["total"] >= 5
    assert everything["items"][0]["key"] == other_method  # the newest of all
    created = [it["created"] for it in everything["items"]]
    assert created == sorted(created, reverse=True)
    first_two = listing(limit=2)
    assert [it["key"] for it in first_two["items"]] == [it["key"] for it in everything["items"][:2]]
    assert listing(method="no_such_method")["total"] == 0


def test_key_ignores_node_order_and_ids(client, tmp_path):
    req_a = graph_request(RESIDUAL)
    req_b = graph_request(renamed(RESIDUAL))
    cli_b = cli_solve(tmp_path, req_b)

    ra = post_solve(client, req_a)
    assert ra.status_code == 200, ra.text
    a = ra.json()
    assert a["cached"] is False
    assert [l["id"] for l in a["layers"]] == ["alpha_fc1", "alpha_fc2", "alpha_fc3", "alpha_head"]

    rb = post_solve(client, req_b)
    assert rb.status_code == 200, rb.text
    b = rb.json()
    assert b["key"] == a["key"] and rb.headers["x-sigprop-key"] == a["key"]
    assert b["cached"] is True  # served from the entry the first request stored
    # ... but named with the second request's own ids
    assert [l["id"] for l in b["layers"]] == [RENAME[l["id"]] for l in a["layers"]]
    assert "alpha_" not in rb.text
    for la, lb in zip(a["layers"], b["layers"], strict=False):
        assert {**la, "id": None} == {**lb, "id": None}
    # and byte for byte what the CLI answers for the renamed request
    assert strip_cached(cli_output(cli_b).rstrip("\n")) == strip_cached(rb.text)


def test_delete_needs_an_admin_key(client):
    req = mlp(2, width=12, targets={"eta": 0.25})
    key = post_solve(client, req).json()["key"]
    path = f"/v1/solutions/{key}"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    assert_error(client.delete(path), 401, "unauthorized")
    assert_error(client.delete(path, headers={"Authorization": "Bearer"}), 401, "unauthorized")
    assert_error(client.delete(path, headers={"Authorization": f"Basic {GOOD_KEY}"}), 401, "unauthorized")
    assert_error(client.delete(path, headers={"Authorization": "Bearer wrong-key"}), 403, "forbidden")
    # a valid key that is not an admin key: solutions are shared, so it may not delete one
    err = assert_error(client.delete(path, headers=READER), 403, "forbidden")
    assert "SIGPROP_ADMIN_KEYS" in err["hint"]
    assert client.get(path, headers=READER).status_code == 200  # still there

    r = client.delete(path, headers=admin)
    assert r.status_code == 200, r.text
    assert r.json() == {"key": key, "deleted": True}
    assert_error(client.get(path, headers=READER), 404, "not_found")
    assert_error(client.delete(path, headers=admin), 404, "not_found")
    listed = client.get("/v1/solutions", params={"limit": 500}, headers=READER).json()["items"]
    assert key not in [it["key"] for it in listed]
    # solved again, not served from a stale entry
    assert post_solve(client, req).json()["cached"] is False


# -- errors -------------------------------------------------------------------------------------


def _chain(*extra: dict, shape=(8,)) -> list[dict]:
    return [
        {"id": "x", "op": "input", "shape": list(shape)},
        {"id": "d", "op": "dense", "inputs": ["x"], "units": 8},
        {"id": "a", "op": "activation", "inputs": ["d"]},
        {"id": "o", "op": "output", "inputs": ["a"]},
        *extra,
    ]


def _cycle():
    nodes = _chain()
    nodes[1] = {**nodes[1], "inputs": ["a"]}
    return graph_request(nodes)


def _dangling():
    nodes = _chain()
    nodes[1] = {**nodes[1], "inputs": ["nowhere"]}
    return graph_request(nodes)


def _nan_target() -> bytes:
    body = json.dumps(mlp(3, targets={"eta": math.nan}))  # Python writes NaN, which is not JSON
    assert "NaN" in body
    return body.encode()


# (id, method, path, body: dict -> json / bytes -> raw content, status, code)
ERROR_CASES = [
    ("cycle", "POST", "/v1/solve", _cycle(), 422, "invalid_graph"),
    ("dangling_input", "POST", "/v1/solve", _dangling(), 422, "invalid_graph"),
    (
        "two_outputs",
        "POST",
        "/v1/solve",
        graph_request(_chain({"id": "o2", "op": "output", "inputs": ["a"]})),
        422,
        "invalid_graph",
    ),
    ("bad_shape_zero", "POST", "/v1/solve", graph_request(_chain(shape=(0,))), 422, "invalid_graph"),
    ("bad_shape_4d", "POST", "/v1/solve", graph_request(_chain(shape=(1, 2, 3, 4))), 422, "invalid_graph"),
    ("bad_shape_dense_on_map", "POST", "/v1/solve", graph_request(_chain(shape=(3, 8, 8))), 422, "invalid_graph"),
    (
        "duplicate_id",
        "POST",
        "/v1/solve",
        graph_request(_chain({"id": "d", "op": "identity", "inputs": ["x"]})),
        422,
        "invalid_graph",
    ),
    (
        "unsupported_op",
        "POST",
        "/v1/solve",
        graph_request([{**nd, "op": "lstm"} if nd["id"] == "d" else nd for nd in _chain()]),
        422,
        "unsupported_op",
    ),
    ("unsupported_activation", "POST", "/v1/solve", mlp(3, activation="no_such_fn"), 422, "unsupported_activation"),
    ("nan_target", "POST", "/v1/solve", _nan_target(), 422, "invalid_target"),
    (
        "infinite_target",
        "POST",
        "/v1/solve",
        b'{"graph": {"template": "mlp", "depth": 3}, "method": "tat", '
        b'"activation": "leaky_relu", "targets": {"eta": Infinity}}',
        422,
        "invalid_target",
    ),
    (
        "overflowing_target",
        "POST",
        "/v1/solve",
        b'{"graph": {"template": "mlp", "depth": 3}, "method": "tat", '
        b'"activation": "leaky_relu", "targets": {"eta": 1e999}}',
        422,
        "invalid_target",
    ),
    ("target_out_of_range", "POST", "/v1/solve", mlp(3, targets={"eta": -0.5}), 422, "invalid_target"),
    ("target_of_another_method", "POST", "/v1/solve", mlp(3, targets={"eta": 0.5, "zeta": 1.5}), 422, "invalid_target"),
    ("unreachable_target", "POST", "/v1/solve", mlp(10, width=64, targets={"eta": 0.9}), 422, "unreachable_target"),
    ("unsupported_method", "POST", "/v1/solve", mlp(3) | {"method": "magic"}, 422, "unsupported_method"),
    ("not_json", "POST", "/v1/solve", b"this is not json", 422, "invalid_request"),
    ("empty_body", "POST", "/v1/solve", b"", 422, "invalid_request"),
    ("json_array", "POST", "/v1/solve", b"[1, 2, 3]", 422, "invalid_request"),
    ("json_string", "POST", "/v1/solve", b'"solve this"', 422, "invalid_request"),
    ("too_deep_json", "POST", "/v1/solve", b"[" * 100_000 + b"]" * 100_000, 422, "invalid_request"),
    ("bad_query", "GET", "/v1/solutions?limit=many", None, 422, "invalid_request"),
    ("negative_offset", "GET", "/v1/solutions?offset=-1", None, 422, "invalid_request"),
    ("bad_template_param", "GET", "/v1/templates/mlp?depth=three", None, 422, "invalid_request"),
    ("unknown_solution", "GET", "/v1/solutions/" + "0" * 64, None, 404, "not_found"),
    ("unknown_endpoint", "GET", "/v1/no/such/endpoint", None, 404, "not_found"),
    ("unknown_template", "GET", "/v1/templates/nosuch", None, 404, "not_found"),
    ("bad_template_param", "GET", "/v1/templates/mlp?depth=3&input_shape=notjson", None, 422, "invalid_request"),
]


@pytest.mark.parametrize("method,path,body,status,code", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_error_codes(client, method, path, body, status, code):
    keyed = READER if path.startswith("/v1/solutions") else {}  # stored solutions: read with a key
    if isinstance(body, bytes):
        r = client.request(method, path, content=body, headers={"content-type": "application/json", **keyed})
    else:
        r = client.request(method, path, json=body, headers=keyed)
    assert_error(r, status, code)


def test_template_with_non_json_input_shape_is_rejected_not_500(client):
    r = client.get("/v1/templates/mlp", params={"depth": 3, "input_shape": "not-json"})
    assert_error(r, 422, "invalid_request")


def test_graph_too_large(limits_service):
    c = limits_service.client()
    small = post_solve(c, mlp(3))  # 2 * 3 + 3 = 9 nodes: allowed
    assert small.status_code == 200, small.text
    # a template counted after expansion: 23 nodes
    assert_error(post_solve(c, mlp(10)), 413, "graph_too_large")
    # a hand-written graph: 11 nodes, the body still under 1000 bytes
    nodes = [{"id": "i", "op": "input", "shape": [4]}]
    nodes += [
        {"id": f"n{k}", "op": "identity", "inputs": [nodes[-1]["id"] if k == 0 else f"n{k - 1}"]} for k in range(9)
    ]
    nodes.append({"id": "o", "op": "output", "inputs": ["n8"]})
    body = json.dumps(graph_request(nodes), separators=(",", ":")).encode()
    assert len(body) < 1000
    assert_error(
        c.post("/v1/solve", content=body, headers={"content-type": "application/json"}), 413, "graph_too_large"
    )


def test_payload_too_large(limits_service):
    c = limits_service.client()
    big = json.dumps({**mlp(3), "padding": "x" * 2000}).encode()
    assert_error(
        c.post("/v1/solve", content=big, headers={"content-type": "application/json"}), 413, "payload_too_large"
    )

    def chunks():  # no Content-Length: chunked transfer encoding, the limit must hold while reading
        for _ in range(10):
            yield b" " * 300
        yield json.dumps(mlp(3)).encode()

    r = c.post("/v1/solve", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "payload_too_large")
    # the server is fine afterwards
    assert post_solve(c, mlp(3)).status_code == 200


# -- request ids and metrics --------------------------------------------------------------------


def test_request_id_echoed_or_generated(client):
    r = client.get("/healthz", headers={"X-Request-ID": "trace-abc.123_x"})
    assert r.headers["x-request-id"] == "trace-abc.123_x"
    r = client.post(
        "/v1/solve", content=b"not json", headers={"X-Request-ID": "err-req-1", "Content-Type": "application/json"}
    )
    assert r.status_code == 422 and r.headers["x-request-id"] == "err-req-1"
    # the same body without a JSON content type is refused before it is read
    assert_error(client.post("/v1/solve", content=b"not json"), 415, "unsupported_media_type")

    generated = {client.get("/healthz").headers["x-request-id"] for _ in range(3)}
    assert len(generated) == 3
    assert all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in generated)
    # an id that is not safe to log is replaced, not echoed
    r = client.get("/healthz", headers={"X-Request-ID": 'bad id"with{junk}'})
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


def test_metrics_after_a_hit(client):
    req = mlp(2, width=20, targets={"eta": 0.2})
    assert post_solve(client, req).json()["cached"] is False
    assert post_solve(client, req).json()["cached"] is True
    r = client.get("/metrics")
    assert r.status_code == 200
    text = r.text
    assert "sigprop_requests_total" in text
    assert (metric_value(text, "sigprop_cache_total", {"result": "hit"}) or 0) >= 1
    assert (metric_value(text, "sigprop_cache_total", {"result": "miss"}) or 0) >= 1
    assert (
        metric_value(text, "sigprop_requests_total", {"route": "/v1/solve", "method": "POST", "status": "200"}) or 0
    ) >= 2
    assert (metric_value(text, "sigprop_solve_seconds_count", {"method": "tat"}) or 0) >= 1


# -- concurrency: single flight across worker processes ------------------------------------------

N_PARALLEL = 8
# ~0.25 s of engine time, so the eight requests overlap the one solve
SLOW_REQUEST = {
    "graph": {"template": "mlp", "depth": 1000, "width": 64},
    "method": "dks",
    "activation": "tanh",
    "targets": {"zeta": 1.5},
}


@pytest.fixture(params=BACKENDS)
def two_worker_service(request, tmp_path):
    prom = tmp_path / "prom"
    prom.mkdir()
    env = _backend_env(request.param, tmp_path) | {"PROMETHEUS_MULTIPROC_DIR": str(prom)}
    svc = start_service(tmp_path, env, workers=2)
    svc.backend, svc.prom_dir = request.param, prom
    yield svc
    svc.stop()


def _clients_on_both_workers(svc, n: int, tries: int = 20) -> tuple[list[httpx.Client], dict]:
    """n keep-alive connections, at least one to each of the two workers (seen in the per-process
    metric files), so the parallel requests below really cross process boundaries."""
    for _ in range(tries):
        clients, owner = [], {}
        for i in range(n):
            c = httpx.Client(base_url=svc.base_url, timeout=60.0)
            before = requests_by_pid(svc.prom_dir)
            assert c.get("/healthz").status_code == 200
            after = requests_by_pid(svc.prom_dir)
            changed = [pid for pid, v in after.items() if v > before.get(pid, 0)]
            owner[i] = changed[0] if len(changed) == 1 else None
            clients.append(c)
        if len({p for p in owner.values() if p is not None}) == 2:
            return clients, owner
        for c in clients:
            c.close()
    pytest.fail(f"could not spread {n} connections over both workers in {tries} tries")


def test_parallel_cold_requests_are_solved_once(two_worker_service):
    svc = two_worker_service
    clients, owner = _clients_on_both_workers(svc, N_PARALLEL)
    barrier = threading.Barrier(N_PARALLEL)
    results: list = [None] * N_PARALLEL

    def call(i):
        try:
            barrier.wait(timeout=10)
            results[i] = clients[i].post("/v1/solve", json=SLOW_REQUEST)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(N_PARALLEL)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
    finally:
        for c in clients:
            c.close()

    assert all(isinstance(r, httpx.Response) for r in results), results
    assert [r.status_code for r in results] == [200] * N_PARALLEL, [r.text[:300] for r in results]
    bodies = {strip_cached(r.text) for r in results}
    assert len(bodies) == 1
    cached = [r.json()["cached"] for r in results]
    key = results[0].json()["key"]

    with httpx.Client(base_url=svc.base_url, timeout=10) as c:
        metrics = c.get("/metrics").text
        record = c.get(f"/v1/solutions/{key}", headers=READER).json()
        # Hit counts are eventually exact: each worker writes its hits in a batch at least every
        # FLUSH_S (storage/hot.py), and a read flushes only the reading worker's own batch.
        deadline = time.monotonic() + 5 * FLUSH_S
        while record["hits"] < N_PARALLEL - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            record = c.get(f"/v1/solutions/{key}", headers=READER).json()
    solves = metric_value(metrics, "sigprop_solve_seconds_count", {"method": "dks"})
    # The metric sums both workers (prometheus multiprocess mode). Every answer with "cached": false
    # is one engine solve; the others waited on the single-flight lock and read the stored answer,
    # each counting one hit on the stored record.
    assert solves == cached.count(False), (solves, cached)
    assert cached.count(False) == 1, cached
    assert record["hits"] == N_PARALLEL - 1, record["hits"]


# -- single-flight races, reproduced deterministically in-process ----------------------------------


def _two_caches(backend: str, tmp_path: Path):
    """Two cache clients on one store, as two worker processes have."""
    from sigprop.storage import RedisSolutionCache, SqliteSolutionCache

    if backend == "redis":
        flush_shared_redis()
        return RedisSolutionCache(SHARED_REDIS_URL), RedisSolutionCache(SHARED_REDIS_URL)
    return SqliteSolutionCache(tmp_path / "c.sqlite3"), SqliteSolutionCache(tmp_path / "c.sqlite3")


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_flight_rechecks_cache_after_lock(backend, tmp_path, monkeypatch):
    from sigprop.api import solutions

    ours, theirs = _two_caches(backend, tmp_path)
    solved = []
    real_solve = solutions.solve_canonical
    monkeypatch.setattr(solutions, "solve_canonical", lambda prep: solved.append(prep.key) or real_solve(prep))
    me = solutions.SolutionService(ours, 60.0, 30.0)
    other = solutions.SolutionService(theirs, 60.0, 30.0)
    req = mlp(3, width=8, targets={"eta": 0.15})
    real_acquire = ours.acquire

    def acquire_after_the_other_finished(key, ttl_s):
        if not solved:
            # The interleaving: our lookup missed; before our acquire, the other request
            # (another worker) solves, stores and releases the lock.
            assert other.solve(json.dumps(req).encode()).cached is False
        return real_acquire(key, ttl_s)

    monkeypatch.setattr(ours, "acquire", acquire_after_the_other_finished)
    try:
        outcome = me.solve(json.dumps(req).encode())
        assert len(solved) == 1, f"solved {len(solved)} times"
        assert outcome.cached is True
    finally:
        ours.close()
        theirs.close()


def test_sqlite_lookup_that_finds_an_entry_counts_its_hit(tmp_path, monkeypatch):
    from sigprop.storage import new_record

    reader, writer = _two_caches("sqlite", tmp_path)
    record = new_record("k" * 64, "{}", "{}", [], "tat", "leaky_relu")
    real_db = reader._db
    put_done = []

    class Interleaved:
        """The reader's connection, with the writer's put landing just before the reader's first SELECT."""

        def __init__(self, db):
            self.db = db

        def __getattr__(self, name):
            return getattr(self.db, name)

        def execute(self, sql, *args):
            if not put_done and sql.lstrip().upper().startswith("SELECT"):
                put_done.append(True)
                writer.put(record)
            return self.db.execute(sql, *args)

    monkeypatch.setattr(reader, "_db", lambda: Interleaved(real_db()))
    try:
        answer = reader.get_answer(record.key)
        if answer is not None:  # the lookup found the entry, so it must have counted a hit on it
            assert writer.get(record.key, count_hit=False).hits == 1
    finally:
        reader.close()
        writer.close()
