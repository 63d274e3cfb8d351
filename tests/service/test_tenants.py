"""Tenants (issue 35): a validation belongs to the key that submitted it (any other key gets 404,
as if it did not exist; its owner or an admin key may cancel it); cached solutions are shared
(content-addressed) and only an admin key deletes one; stored submissions need a key unless
``SIGPROP_ANONYMOUS_STORED_READS`` opens them; JSON routes take only ``application/json`` (415
otherwise: no cross-origin "simple" POST can submit work); every answer says ``nosniff``."""

from __future__ import annotations

import json

import pytest

from ..inprocess import KEY_ONE, KEY_TWO, app_client, bearer, mlp, validation
from ..service_fixtures import assert_error

ADMIN = "sec-admin-key-0123456789abc"


@pytest.fixture
def api(tmp_path):
    with app_client(tmp_path, admin_keys=ADMIN) as client:
        yield client


def _submit(api, key: str) -> str:
    r = api.post("/v1/validations", json=validation(steps=200), headers=bearer(key))
    assert r.status_code == 202, r.text
    return r.json()["id"]


def test_a_validation_is_its_submitters_only(api):
    vid = _submit(api, KEY_ONE)
    assert api.get(f"/v1/validations/{vid}", headers=bearer(KEY_ONE)).status_code == 200
    assert "submitted_by" not in api.get(f"/v1/validations/{vid}", headers=bearer(KEY_ONE)).json()["request"]
    # another key: 404, never 403 (existence is not revealed), and no cancel
    assert_error(api.get(f"/v1/validations/{vid}", headers=bearer(KEY_TWO)), 404, "not_found")
    assert_error(api.delete(f"/v1/validations/{vid}", headers=bearer(KEY_TWO)), 404, "not_found")
    assert api.get(f"/v1/validations/{vid}", headers=bearer(KEY_ONE)).json()["status"] != "cancelled"
    listed = api.get("/v1/validations", headers=bearer(KEY_TWO)).json()
    assert vid not in [i["id"] for i in listed["items"]]
    assert vid in [i["id"] for i in api.get("/v1/validations", headers=bearer(KEY_ONE)).json()["items"]]
    # an admin key sees and cancels anyone's
    assert api.get(f"/v1/validations/{vid}", headers=bearer(ADMIN)).status_code == 200
    assert api.delete(f"/v1/validations/{vid}", headers=bearer(ADMIN)).status_code in (200, 202)


def test_the_owner_cancels_its_own(api):
    vid = _submit(api, KEY_TWO)
    assert api.delete(f"/v1/validations/{vid}", headers=bearer(KEY_TWO)).status_code in (200, 202)


def test_only_an_admin_key_deletes_a_shared_solution(api):
    r = api.post("/v1/solve", json=mlp(), headers=bearer(KEY_ONE))
    assert r.status_code == 200, r.text
    key = r.json()["key"]
    # shared: another key reads the same content-addressed answer
    assert api.get(f"/v1/solutions/{key}", headers=bearer(KEY_TWO)).status_code == 200
    for k in (KEY_ONE, KEY_TWO):  # not even the key that solved it first
        assert_error(api.delete(f"/v1/solutions/{key}", headers=bearer(k)), 403, "forbidden")
    assert api.get(f"/v1/solutions/{key}", headers=bearer(KEY_TWO)).status_code == 200
    assert api.delete(f"/v1/solutions/{key}", headers=bearer(ADMIN)).status_code == 200
    assert_error(api.get(f"/v1/solutions/{key}", headers=bearer(KEY_ONE)), 404, "not_found")


def test_stored_submissions_need_a_key_by_default(api):
    key = api.post("/v1/solve", json=mlp()).json()["key"]  # solving stays open
    vid = _submit(api, KEY_ONE)
    for path in ("/v1/solutions", f"/v1/solutions/{key}", "/v1/validations", f"/v1/validations/{vid}"):
        assert_error(api.get(path), 401, "unauthorized")
        assert api.get(path, headers=bearer(KEY_TWO)).status_code in (200, 404)
    assert api.get(f"/v1/solutions/{key}", headers=bearer(KEY_TWO)).status_code == 200


def test_anonymous_stored_reads_only_when_the_setting_says_so(tmp_path):
    with app_client(tmp_path, anonymous_stored_reads=True) as client:
        key = client.post("/v1/solve", json=mlp()).json()["key"]
        assert client.get(f"/v1/solutions/{key}").status_code == 200
        assert client.get("/v1/solutions").status_code == 200
        vid = _submit(client, KEY_ONE)
        # validations stay their owner's: without a key, as with another key, there is none
        assert_error(client.get(f"/v1/validations/{vid}"), 404, "not_found")
        assert vid not in [i["id"] for i in client.get("/v1/validations").json()["items"]]


BODY = json.dumps(mlp()).encode()


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
@pytest.mark.parametrize("path", ["/v1/solve", "/v1/validations"])
def test_json_routes_take_only_json(api, path, content_type):
    body = BODY if path == "/v1/solve" else json.dumps(validation()).encode()
    headers = {**bearer(KEY_ONE), **({"content-type": content_type} if content_type else {})}
    r = api.post(path, content=body, headers=headers)
    err = assert_error(r, 415, "unsupported_media_type")
    assert "application/json" in err["hint"]
    # answered inside the request context: it carries the request's id (and is logged and counted)
    assert r.headers.get("x-request-id") and r.headers.get("x-content-type-options") == "nosniff"


def test_json_with_a_charset_is_json(api):
    r = api.post("/v1/solve", content=BODY, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/healthz", "/v1/templates", "/no/such/path"])
def test_every_answer_says_nosniff(api, path):
    assert api.get(path).headers.get("x-content-type-options") == "nosniff"
    assert api.post("/v1/solve", json=mlp()).headers.get("x-content-type-options") == "nosniff"
