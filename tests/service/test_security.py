"""API keys: writes that cost or destroy always need a key (a validation is cancelled by the key
that submitted it, a cached solution deleted only with an admin key); with keys configured, reads of
stored submissions need one too unless SIGPROP_ANONYMOUS_STORED_READS opens them; with
SIGPROP_KEYS_FOR_READS the solve and every read need one, while /healthz, /readyz and /metrics stay
open. Keys travel as Bearer tokens or as HTTP Basic passwords (browsers); 401 without a key, 403
with a wrong one, in the contract's error shape.

Most checks run the app in-process (tests/inprocess.py); one runs a real `sigprop serve`.
"""

from __future__ import annotations

import base64
import subprocess
import sys

import httpx
import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from sigprop.api.auth import KeyChecker, client_identity
from sigprop.api.handlers import error_response as _error
from sigprop.errors import SigpropError
from sigprop.settings import Settings

from ..inprocess import KEY_ONE, KEY_TWO, KEYS, app_client, basic, bearer, eoc, mlp, validation
from ..service_fixtures import assert_error, service_env, start_service

WRONG = "not-a-key"
ADMIN = "sec-admin-key-0123456789abc"
MALFORMED = [
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer   "},
    {"Authorization": f"Token {KEY_ONE}"},
    {"Authorization": f"Basic {KEY_ONE}"},  # not base64 of user:key
    {"Authorization": "Basic " + base64.b64encode(KEY_ONE.encode()).decode()},  # no colon
    {"Authorization": "Basic " + base64.b64encode(b"user:").decode()},  # empty password
    {"Authorization": "Basic !!!"},
    {"Authorization": ""},
]


@pytest.fixture(scope="module")
def open_reads(tmp_path_factory):
    with app_client(tmp_path_factory.mktemp("open"), admin_keys=ADMIN) as c:
        yield c


@pytest.fixture(scope="module")
def keyed_reads(tmp_path_factory):
    with app_client(tmp_path_factory.mktemp("keyed"), keys_for_reads=True) as c:
        yield c


def _stored_key(c) -> str:
    r = c.post("/v1/solve", json=eoc(1.25), headers=bearer(KEY_ONE))
    assert r.status_code == 200, r.text
    return r.json()["key"]


def _validation_id(c) -> str:
    r = c.post("/v1/validations", json=validation(), headers=bearer(KEY_ONE))
    assert r.status_code == 202, r.text
    return r.json()["id"]


# -- writes: always keyed ---------------------------------------------------------------------------


def _writes(c):
    """(method, path, json body) of every keyed write, each with a fresh target."""
    return [
        ("POST", "/v1/validations", validation()),
        ("DELETE", f"/v1/validations/{_validation_id(c)}", None),
        ("DELETE", f"/v1/solutions/{_stored_key(c)}", None),
    ]


# the keys each write succeeds with, first as Bearer then as HTTP Basic: any key submits a
# validation, its submitter (KEY_ONE, in _validation_id) cancels it, an admin key deletes a solution
ALLOWED = [(KEY_TWO, KEY_ONE), (KEY_ONE, KEY_ONE), (ADMIN, ADMIN)]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["post_validation", "delete_validation", "delete_solution"])
def test_writes_need_a_valid_key(open_reads, which):
    c = open_reads
    method, path, body = _writes(c)[which]
    as_bearer, as_basic = ALLOWED[which]
    err = assert_error(c.request(method, path, json=body), 401, "unauthorized")
    assert "Bearer" in err["hint"]
    assert c.request(method, path, json=body).headers["www-authenticate"].startswith("Bearer")
    for headers in MALFORMED:
        assert_error(c.request(method, path, json=body, headers=headers), 401, "unauthorized")
    assert_error(c.request(method, path, json=body, headers=bearer(WRONG)), 403, "forbidden")
    assert_error(c.request(method, path, json=body, headers=basic(WRONG)), 403, "forbidden")
    assert_error(c.request(method, path, json=body, headers=bearer(KEY_ONE + "x")), 403, "forbidden")
    # a valid key that may not do this: another key's validation does not exist for it (404), and
    # a key that is not an admin key may not delete a shared solution (403)
    if which == 1:
        assert_error(c.request(method, path, json=body, headers=bearer(KEY_TWO)), 404, "not_found")
    if which == 2:
        for key in (KEY_ONE, KEY_TWO):
            assert_error(c.request(method, path, json=body, headers=bearer(key)), 403, "forbidden")
    r = c.request(method, path, json=body, headers=bearer(as_bearer))
    assert 200 <= r.status_code < 300, r.text
    # and as HTTP Basic, with any user name (a fresh target: the first one is gone or cancelled)
    method, path, body = _writes(c)[which]
    r = c.request(method, path, json=body, headers=basic(as_basic, user="whoever"))
    assert 200 <= r.status_code < 300, r.text


def test_without_configured_keys_writes_are_refused(tmp_path):
    with app_client(tmp_path, api_keys="") as c:
        assert_error(c.post("/v1/validations", json=validation()), 401, "unauthorized")
        assert_error(c.post("/v1/validations", json=validation(), headers=bearer("anything")), 403, "forbidden")
        assert c.post("/v1/solve", json=eoc(1.0)).status_code == 200  # reads and solves stay open
        assert c.get("/v1/solutions").status_code == 200  # no keys, no owners: stored reads stay open
        assert c.get("/v1/validations").status_code == 200


# -- reads: stored submissions keyed by default, everything keyed with SIGPROP_KEYS_FOR_READS -------------


def _reads(c) -> list[tuple[str, str, dict | None]]:
    key, vid = _stored_key(c), _validation_id(c)
    return [
        ("POST", "/v1/solve", mlp(depth=2, eta=0.3)),
        ("GET", "/v1/solutions", None),
        ("GET", f"/v1/solutions/{key}", None),
        ("GET", "/v1/templates", None),
        ("GET", "/v1/templates/mlp?depth=2", None),
        ("GET", "/v1/validations", None),
        ("GET", f"/v1/validations/{vid}", None),
    ]


STORED = ("/v1/solutions", "/v1/validations")


def test_only_stored_submissions_need_a_key_by_default(open_reads):
    """With keys configured, the solve and the templates stay open; stored solutions and
    validations (someone's requests and graphs) need a key."""
    for method, path, body in _reads(open_reads):
        r = open_reads.request(method, path, json=body)
        if path.startswith(STORED):
            assert_error(r, 401, "unauthorized")
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert_error(open_reads.request(method, path, json=body, headers=bearer(WRONG)), 403, "forbidden")
        else:
            assert r.status_code == 200, (path, r.text[:300])
        r = open_reads.request(method, path, json=body, headers=bearer(KEY_ONE))  # the validation's owner
        assert r.status_code == 200, (path, r.text[:300])


def test_anonymous_stored_reads_open_the_solutions_not_the_validations(tmp_path):
    with app_client(tmp_path, anonymous_stored_reads=True) as c:
        key, vid = _stored_key(c), _validation_id(c)
        for method, path, body in _reads(c):
            r = c.request(method, path, json=body)
            if path.startswith("/v1/validations/"):  # KEY_ONE's: not there for anyone else
                assert_error(r, 404, "not_found")
            else:
                assert r.status_code == 200, (path, r.text[:300])
        assert c.get(f"/v1/solutions/{key}").json()["key"] == key
        assert vid not in [i["id"] for i in c.get("/v1/validations").json()["items"]]
        assert c.get(f"/v1/validations/{vid}", headers=bearer(KEY_ONE)).status_code == 200


def test_keys_for_reads_protects_the_solve_and_every_read(keyed_reads):
    c = keyed_reads
    for method, path, body in _reads(c):
        assert_error(c.request(method, path, json=body), 401, "unauthorized")
        assert_error(c.request(method, path, json=body, headers=MALFORMED[3]), 401, "unauthorized")
        assert_error(c.request(method, path, json=body, headers=bearer(WRONG)), 403, "forbidden")
        assert_error(c.request(method, path, json=body, headers=basic(WRONG)), 403, "forbidden")
        for headers in (bearer(KEY_ONE), basic(KEY_ONE), basic(KEY_TWO)):
            r = c.request(method, path, json=body, headers=headers)
            if headers == basic(KEY_TWO) and path.startswith("/v1/validations/"):
                assert_error(r, 404, "not_found")  # KEY_ONE's validation: another key never sees it
            else:
                assert r.status_code == 200, (path, r.text[:300])


def test_keys_for_reads_leaves_probes_open(keyed_reads):
    for path in ("/healthz", "/readyz", "/metrics"):
        assert keyed_reads.get(path).status_code == 200, path


def _all_routes(routes, prefix: str = ""):
    """(path, methods) of every route, looking into included routers (FastAPI >= 0.16x keeps them
    as _IncludedRouter objects rather than copying their routes)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _all_routes(inner.routes, prefix + route.include_context.prefix)
        elif getattr(route, "path", None) is not None:
            yield prefix + route.path, getattr(route, "methods", None) or set()


def test_keys_for_reads_covers_every_data_route(keyed_reads):
    """No route outside the probes and the API description answers without a key (new routes,
    the dashboard included, must be wired to the read-key dependency)."""
    open_paths = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    checked = 0
    for path, methods in _all_routes(keyed_reads.app.routes):
        if path in open_paths or not methods:  # (mounts, e.g. static files, have no methods)
            continue
        concrete = path.replace("{key}", "0" * 64).replace("{vid}", "0" * 32).replace("{name}", "mlp")
        concrete = concrete.replace("{path:path}", "x").replace("{path}", "x")
        method = next(m for m in ("GET", "POST", "DELETE", "PUT", "PATCH") if m in methods)
        # a JSON content type: a body-taking route answers 415 to anything else, before the key check
        r = keyed_reads.request(method, concrete, headers={"Content-Type": "application/json"})
        assert r.status_code == 401, (method, concrete, r.status_code, r.text[:200])
        checked += 1
    assert checked >= 7


def test_keys_for_reads_without_keys_refuses_to_start(tmp_path):
    with pytest.raises(ValidationError, match="SIGPROP_API_KEYS"):
        Settings(data_dir=tmp_path, keys_for_reads=True, api_keys=" , ")
    env = service_env({"SIGPROP_KEYS_FOR_READS": "true", "SIGPROP_API_KEYS": "", "SIGPROP_DATA_DIR": str(tmp_path)})
    proc = subprocess.run(
        [sys.executable, "-m", "sigprop.cli", "serve", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "SIGPROP_KEYS_FOR_READS" in proc.stderr and "SIGPROP_API_KEYS" in proc.stderr


# -- browsers: HTTP Basic and the dashboard's challenge -------------------------------------------------


def _browser_app(checker: KeyChecker) -> TestClient:
    """The checker guarding a /dashboard page and an API path, as the app wires it."""
    app = FastAPI()
    app.add_exception_handler(SigpropError, lambda _request, err: _error(err))

    @app.get("/dashboard/runs", dependencies=[Depends(checker)])
    def page():
        return {"page": True}

    @app.get("/v1/thing", dependencies=[Depends(checker)])
    def thing():
        return {"thing": True}

    return TestClient(app)


def test_dashboard_401_asks_the_browser_for_basic_credentials():
    c = _browser_app(KeyChecker(KEYS))
    r = c.get("/dashboard/runs")
    err = assert_error(r, 401, "unauthorized")
    assert r.headers["www-authenticate"].startswith('Basic realm="sigprop"')
    assert "password" in err["hint"]
    assert c.get("/dashboard/runs", headers=basic(KEY_ONE)).json() == {"page": True}
    assert c.get("/dashboard/runs", headers=bearer(KEY_ONE)).status_code == 200
    r = c.get("/dashboard/runs", headers=basic(WRONG))
    assert_error(r, 403, "forbidden")
    # API paths challenge with Bearer: no browser prompt for programmatic clients
    r = c.get("/v1/thing")
    assert_error(r, 401, "unauthorized")
    assert r.headers["www-authenticate"].startswith("Bearer")


def test_dashboard_of_the_app_is_keyed_when_reads_are(keyed_reads):
    pages = [
        path
        for path, methods in _all_routes(keyed_reads.app.routes)
        if path.startswith("/dashboard") and "{" not in path and "GET" in methods
    ]
    if not pages:
        pytest.skip("this checkout has no /dashboard routes yet")
    for page in ["/dashboard" if "/dashboard" in pages else pages[0], "/"]:
        r = keyed_reads.get(page, follow_redirects=False)
        assert_error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"].startswith('Basic realm="sigprop"')
        assert_error(keyed_reads.get(page, headers=basic(WRONG), follow_redirects=False), 403, "forbidden")
        assert keyed_reads.get(page, headers=basic(KEY_ONE)).status_code == 200


def test_keys_are_kept_and_counted_only_as_digests():
    checker = KeyChecker(KEYS)
    held = repr(vars(checker))
    assert KEY_ONE not in held and KEY_TWO not in held

    class Req:  # the parts of a starlette Request that identify a client
        def __init__(self, headers, host="10.0.0.7"):
            self.headers = {k.lower(): v for k, v in headers.items()}
            self.client = type("C", (), {"host": host})()

    keyed = client_identity(Req(bearer(KEY_ONE)), checker)
    assert keyed.startswith("key:") and KEY_ONE not in keyed
    assert client_identity(Req(basic(KEY_ONE)), checker) == keyed
    assert client_identity(Req(bearer(KEY_TWO)), checker) != keyed
    assert client_identity(Req(bearer(WRONG)), checker) == "addr:10.0.0.7"  # an invalid key is no identity
    assert client_identity(Req({}), checker) == "addr:10.0.0.7"


# -- a real server ------------------------------------------------------------------------------------


def test_real_server_with_keys_for_reads(tmp_path):
    svc = start_service(
        tmp_path,
        {
            "SIGPROP_REDIS_URL": None,
            "SIGPROP_DATA_DIR": str(tmp_path / "data"),
            "SIGPROP_API_KEYS": KEYS,
            "SIGPROP_KEYS_FOR_READS": "true",
            "SIGPROP_ADMIN_KEYS": ADMIN,
        },
    )
    try:
        anon = svc.client()
        for path in ("/healthz", "/readyz", "/metrics"):
            assert anon.get(path).status_code == 200
        r = anon.post("/v1/solve", json=mlp())
        assert_error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert_error(anon.get("/v1/solutions"), 401, "unauthorized")
        assert_error(anon.post("/v1/solve", json=mlp(), headers=bearer(WRONG)), 403, "forbidden")

        r = anon.post("/v1/solve", json=mlp(), headers=basic(KEY_ONE))
        assert r.status_code == 200, r.text
        key = r.json()["key"]
        keyed = svc.client(headers=bearer(KEY_TWO))
        assert keyed.post("/v1/solve", json=mlp()).json()["cached"] is True
        assert keyed.get(f"/v1/solutions/{key}").status_code == 200
        assert_error(anon.delete(f"/v1/solutions/{key}"), 401, "unauthorized")
        assert_error(keyed.delete(f"/v1/solutions/{key}"), 403, "forbidden")  # not an admin key
        admin = svc.client(headers=bearer(ADMIN))
        assert admin.delete(f"/v1/solutions/{key}").json() == {"key": key, "deleted": True}
        with httpx.Client(base_url=svc.base_url, auth=("browser-user", KEY_ONE), timeout=30) as browser:
            assert browser.get("/v1/templates").status_code == 200  # httpx's own Basic auth
    finally:
        svc.stop()
