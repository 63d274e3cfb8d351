"""API keys: the app refuses to be built with a guessable key (an example key as in
``.env.example``, one shorter than 16 characters, with fewer than 8 distinct characters or under 48
bits of estimated entropy), whichever way it is started (``sigprop serve`` or ``uvicorn --factory``);
wrong keys from one client address are limited (429 with Retry-After once over
``SIGPROP_RATE_LIMIT_FAILED_AUTH``), while a right key always passes, whoever else failed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sigprop.api.app import create_app
from sigprop.api.auth import MIN_KEY_CHARS, WeakKeys, estimated_bits, weak_keys
from sigprop.settings import Settings

from ..inprocess import KEY_ONE, KEY_TWO, app_client, basic, bearer, mlp, validation
from ..service_fixtures import assert_error, service_env

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "sec-admin-key-0123456789abc"


def _example_keys() -> str:
    match = re.search(r"^SIGPROP_API_KEYS=(.*)$", (ROOT / ".env.example").read_text(), re.M)
    assert match, ".env.example sets no SIGPROP_API_KEYS"
    return match.group(1).strip()


def test_weak_keys_are_named_by_position_only():
    assert weak_keys(_example_keys()) is not None
    assert "example key" in weak_keys("change-me")
    assert "example key" in weak_keys("a-good-long-key-0123456789,CHANGE-ME")
    short = "x" * (MIN_KEY_CHARS - 1)
    problem = weak_keys(f"a-good-long-key-0123456789,{short}")
    assert problem.startswith("key 2 of 2 has 15 characters") and short not in problem
    assert weak_keys("") is None
    assert "1 distinct characters" in weak_keys("y" * MIN_KEY_CHARS)


# the examples: long enough, and guessable
LOW_ENTROPY = [
    "aaaaaaaaaaaaaaaa",
    "passwordpassword",
    "changemechangeme",
    "abcabcabcabcabcabcabcabc",
    "qwertyqwertyqwerty",
]


@pytest.mark.parametrize("key", LOW_ENTROPY)
def test_low_entropy_keys_are_weak(key):
    problem = weak_keys(f"{KEY_ONE},{key}")
    assert problem is not None and problem.startswith("key 2 of 2") and key not in problem, problem
    assert "distinct characters" in problem or "bits of estimated entropy" in problem, problem


def test_random_keys_are_not_weak():
    import secrets

    # the generator the hints recommend, and shorter random keys: never refused
    for _ in range(200):
        for key in (secrets.token_urlsafe(32), secrets.token_urlsafe(16), secrets.token_hex(16)):
            assert weak_keys(key) is None, key
    assert estimated_bits("passwordpassword") == estimated_bits("password") == 22.0  # repetition adds nothing
    assert estimated_bits("abcdefghijklmnop") == 64.0


@pytest.mark.parametrize("key", LOW_ENTROPY[:3])
def test_create_app_refuses_low_entropy_keys(tmp_path, key):
    with pytest.raises(WeakKeys, match="SIGPROP_API_KEYS: key 1 of 1") as info:
        create_app(Settings(data_dir=tmp_path, redis_url=None, api_keys=key))
    assert key not in str(info.value) and "token_urlsafe" in str(info.value)


def test_admin_keys_are_held_to_the_same_strength(tmp_path):
    """Admin keys are API keys that may do more: a weak one is refused by name of its setting."""
    with pytest.raises(WeakKeys, match="SIGPROP_ADMIN_KEYS: key 1 of 1"):
        create_app(Settings(data_dir=tmp_path, redis_url=None, api_keys=KEY_ONE, admin_keys="change-me"))
    env = service_env(
        {"SIGPROP_API_KEYS": KEY_ONE, "SIGPROP_ADMIN_KEYS": "abc123secret", "SIGPROP_DATA_DIR": str(tmp_path)}
    )
    proc = subprocess.run(
        [sys.executable, "-m", "sigprop.cli", "serve", "--port", "1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "SIGPROP_ADMIN_KEYS" in proc.stderr and "abc123secret" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("keys", ["example", "short", "short-among-good"])
def test_serve_refuses_to_start_with_weak_keys(tmp_path, keys):
    value = {
        "example": _example_keys(),
        "short": "abc123secret",
        "short-among-good": "a-good-long-key-0123456789,abc123secret",
    }[keys]
    env = service_env({"SIGPROP_API_KEYS": value, "SIGPROP_DATA_DIR": str(tmp_path)})
    proc = subprocess.run(
        [sys.executable, "-m", "sigprop.cli", "serve", "--port", "1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "SIGPROP_API_KEYS" in proc.stderr and "abc123secret" not in proc.stderr, proc.stderr
    assert "example key" in proc.stderr or f"at least {MIN_KEY_CHARS}" in proc.stderr, proc.stderr


def test_wrong_key_floods_are_limited(tmp_path):
    with app_client(tmp_path, rate_limit_failed_auth="5/minute") as c:
        wrong = bearer("not-the-key-0123456789")
        codes = [c.post("/v1/validations", headers=wrong, json=validation()).status_code for _ in range(5)]
        assert codes == [403] * 5, codes
        r = c.post("/v1/validations", headers=wrong, json=validation())
        err = assert_error(r, 429, "rate_limited")
        assert 1 <= int(r.headers["Retry-After"]) <= 60 and "wrong API key" in err["message"], (r.headers, err)
        floods = [c.delete("/v1/solutions/" + "0" * 64, headers=wrong).status_code for _ in range(300)]
        assert set(floods) == {429}, set(floods)
        # requests without a key are not failures, and reads stay open
        assert c.post("/v1/solve", json=mlp()).status_code == 200


def test_wrong_keys_never_lock_out_a_right_key(tmp_path):
    """The issue's case: 25 wrong keys from one address (over the default 20/minute), then the right
    key from that same address (a NAT, or a proxy not in SIGPROP_TRUSTED_PROXIES) is answered."""
    with app_client(tmp_path, admin_keys=ADMIN) as c:
        wrong = [bearer(f"guess-{i:02d}-0123456789abcdef") for i in range(25)]
        codes = [c.post("/v1/validations", headers=h, json=validation()).status_code for h in wrong]
        assert codes == [403] * 20 + [429] * 5, codes  # guessing is still slowed down
        for headers in (bearer(KEY_ONE), basic(KEY_TWO)):
            r = c.post("/v1/validations", headers=headers, json=validation())
            assert r.status_code == 202, r.text
        # (deleting a cached solution takes an admin key: a right one reaches the handler, 404 here)
        assert c.delete("/v1/solutions/" + "0" * 64, headers=bearer(ADMIN)).status_code == 404
        # ... and the flood goes on being refused, between and after the right key's requests
        assert_error(c.post("/v1/validations", headers=wrong[0], json=validation()), 429, "rate_limited")
        assert_error(c.delete("/v1/solutions/" + "0" * 64, headers=basic("still-guessing-0123")), 429, "rate_limited")


def test_right_keys_are_never_counted(tmp_path):
    with app_client(tmp_path, rate_limit_failed_auth="3/minute", rate_limit_validations="0") as c:
        for _ in range(10):
            assert c.post("/v1/validations", headers=bearer(KEY_ONE), json=validation()).status_code == 202
        assert c.post("/v1/validations", json=validation()).status_code == 401  # no key: 401, not counted
        assert c.post("/v1/validations", headers=bearer("wrong-key-0123456789"), json=validation()).status_code == 403


def test_failed_auth_counts_are_shared_through_redis(tmp_path):
    from ..service_fixtures import start_redis

    server = start_redis(tmp_path / "redis")
    try:
        wrong = bearer("not-the-key-0123456789")
        with (
            app_client(tmp_path / "a", redis_url=server.url, rate_limit_failed_auth="4/minute", admin_keys=ADMIN) as a,
            app_client(tmp_path / "b", redis_url=server.url, rate_limit_failed_auth="4/minute", admin_keys=ADMIN) as b,
        ):
            codes = [
                (a if i % 2 else b).delete("/v1/solutions/" + "0" * 64, headers=wrong).status_code for i in range(4)
            ]
            assert codes == [403] * 4, codes
            assert_error(a.delete("/v1/solutions/" + "0" * 64, headers=wrong), 429, "rate_limited")
            assert_error(b.delete("/v1/solutions/" + "0" * 64, headers=wrong), 429, "rate_limited")
            # the other process counts the same failures, and lets the right key through all the same
            assert b.delete("/v1/solutions/" + "0" * 64, headers=bearer(ADMIN)).status_code == 404
    finally:
        server.stop()
