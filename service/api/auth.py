"""API keys. Keys are kept only as SHA-256 digests and compared in constant time; the contract's
401 (no key) and 403 (wrong key) errors.

A key travels as ``Authorization: Bearer KEY`` or, for browsers (page loads cannot carry a Bearer
header), as HTTP Basic ``Authorization: Basic base64(anything:KEY)``: the user name is ignored and
the password is the key. A 401 on a ``/dashboard`` page (or ``/``, which redirects there) carries
``WWW-Authenticate: Basic`` so the browser asks for it; API paths challenge with ``Bearer``.

Keys always protect writes that cost or destroy (validations, deletes) and, unless
``SIGPROP_ANONYMOUS_STORED_READS`` says otherwise, the reads of stored submissions; with
``SIGPROP_KEYS_FOR_READS`` they also protect ``POST /v1/solve`` and every read.

Tenants: a validation belongs to the key that submitted it (its ``tenant``, a digest prefix, never
the key); another key is answered 404, as if it did not exist. Keys in ``SIGPROP_ADMIN_KEYS`` are
API keys too, and may also cancel anyone's validation and delete cached solutions (``Viewer``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
from collections import Counter
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..errors import SigpropError

BASIC_REALM = 'Basic realm="sigprop", charset="UTF-8"'
BEARER_REALM = 'Bearer realm="sigprop"'
BROWSER_PATHS = ("/dashboard",)
_MALFORMED = object()


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def presented_key(request: Request):
    """The key the request carries: a str, None when there is no Authorization header, or
    ``_MALFORMED`` for a header that is neither ``Bearer KEY`` nor Basic credentials with a password."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    scheme = scheme.lower()
    if scheme == "bearer" and token:
        return token
    if scheme == "basic" and token:
        try:
            decoded = base64.b64decode(token, validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            return _MALFORMED
        _user, colon, password = decoded.partition(":")
        if colon and password:
            return password
    return _MALFORMED


# keys a server refuses to start with: the examples the repository ships (.env.example) and the like
EXAMPLE_KEYS = frozenset({"change-me", "changeme", "change_me", "secret", "password", "your-key-here", "api-key"})
MIN_KEY_CHARS = 16
# A random 16-character base64url key (96 bits) clears both bounds in all but 1 of 100,000 draws,
# a random 32-hex-character one always; a 16-hex-character one (64 bits) fails the estimate in
# about 1 draw of 7, hence the hint to generate a longer key.
MIN_DISTINCT_CHARS = 8
MIN_KEY_BITS = 48.0
_GENERATE = "e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"


class WeakKeys(ValueError):
    """SIGPROP_API_KEYS holds a key that must not protect a server (``create_app`` refuses to build one)."""


def _period(key: str) -> int:
    """The length of the shortest string whose repetition spells ``key`` (``len(key)`` when none)."""
    n = len(key)
    return next((p for p in range(1, n) if n % p == 0 and key[:p] * (n // p) == key), n)


def estimated_bits(key: str) -> float:
    """Estimated entropy of a key in bits: the length times the Shannon entropy of its character
    frequencies, over the shortest unit it repeats ("passwordpassword" counts as "password").

    For random keys this underestimates the real entropy slightly (a short sample shows fewer
    symbols than its alphabet has), for keys people make up it overestimates it; it is a floor
    that catches repetition and small alphabets, not a password-strength meter."""
    unit = key[: _period(key)]
    if not unit:
        return 0.0
    n = len(unit)
    return sum(-c * math.log2(c / n) for c in Counter(unit).values())


def weak_keys(keys_csv: str) -> str | None:
    """Why a server must not start with these keys (an example key, one shorter than
    ``MIN_KEY_CHARS``, with fewer than ``MIN_DISTINCT_CHARS`` distinct characters, or below
    ``MIN_KEY_BITS`` of estimated entropy), naming keys by position only; None when they are all
    acceptable."""
    keys = [k.strip() for k in keys_csv.split(",") if k.strip()]
    for i, key in enumerate(keys, start=1):
        which = f"key {i} of {len(keys)}"
        if key.lower() in EXAMPLE_KEYS or key.lower().startswith("change-me"):
            return f"{which} is an example key (as in .env.example); set your own, {_GENERATE}"
        if len(key) < MIN_KEY_CHARS:
            return f"{which} has {len(key)} characters; use at least {MIN_KEY_CHARS}, {_GENERATE}"
        distinct = len(set(key))
        if distinct < MIN_DISTINCT_CHARS:
            return (
                f"{which} has only {distinct} distinct characters (at least {MIN_DISTINCT_CHARS} are needed): "
                f"it is easy to guess; use a random key, {_GENERATE}"
            )
        bits = estimated_bits(key)
        if bits < MIN_KEY_BITS:
            return (
                f"{which} has about {bits:.0f} bits of estimated entropy (at least {MIN_KEY_BITS:.0f} are needed; "
                f"repeated text and small alphabets count little): use a random key, {_GENERATE}"
            )
    return None


def check_keys(keys_csv: str, setting: str = "SIGPROP_API_KEYS") -> None:
    """Raise ``WeakKeys`` (its message names the setting and the fix) when ``weak_keys`` objects."""
    weak = weak_keys(keys_csv)
    if weak:
        raise WeakKeys(f"{setting}: {weak}")


class KeyChecker:
    """A FastAPI dependency: passes requests that carry one of ``keys_csv``, else 401/403.

    With ``failures`` (a ``ratelimit.RateLimit`` per client address), wrong keys are counted, and
    a client over that limit gets 429 for its wrong keys. A right key is compared first and always
    passes: it is never counted, and never refused for failures, its own or anyone else's, so an
    attacker without a key cannot lock out a user behind the same NAT or untrusted proxy. Guessing
    stays bounded by the keys' strength (``weak_keys`` refuses fewer than ``MIN_KEY_BITS``), and a
    client over the limit is told to back off with Retry-After instead of learning a 403."""

    def __init__(self, keys_csv: str, failures=None, admin_csv: str = ""):
        admins = [digest(k.strip()) for k in admin_csv.split(",") if k.strip()]
        self._digests = [digest(k.strip()) for k in keys_csv.split(",") if k.strip()] + admins
        self._admins = frozenset(admins)
        self.failures = failures if failures is not None and failures.enabled else None

    @property
    def configured(self) -> bool:
        return bool(self._digests)

    def _matches(self, key: str) -> bool:
        given = digest(key)
        ok = False
        for d in self._digests:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(given, d)
        return ok

    def valid_key_digest(self, request: Request) -> str | None:
        """Hex SHA-256 of the request's key when it is one of ours, else None (never raises):
        the identity rate limits count a keyed client by."""
        key = presented_key(request)
        if not isinstance(key, str) or not self._matches(key):
            return None
        return digest(key).hex()

    def viewer(self, request: Request) -> Viewer:
        """Who is asking, for what the tenant rules show them (never raises)."""
        keyed = self.valid_key_digest(request)
        if keyed is None:
            return Viewer(None, False, self.configured)
        return Viewer(tenant_of(keyed), bytes.fromhex(keyed) in self._admins, True)

    def has_valid_key(self, request: Request) -> bool:
        """Whether the request carries one of our keys (never raises): what decides whether a
        reader sees validation errors and dataset names."""
        return self.valid_key_digest(request) is not None

    async def __call__(self, request: Request) -> None:  # async: runs inline, not in a thread pool
        key = presented_key(request)
        path = request.url.path
        browser = path == "/" or path.startswith(BROWSER_PATHS)  # "/" redirects to the dashboard
        if not isinstance(key, str):
            hint = (
                "sign in with any user name and an API key as the password"
                if browser
                else "send the header 'Authorization: Bearer <key>' (or HTTP Basic with the key as the password)"
            )
            raise SigpropError(
                "unauthorized",
                "this endpoint needs an API key",
                hint,
                headers={"WWW-Authenticate": BASIC_REALM if browser else BEARER_REALM},
            )
        if self._matches(key):  # before any limiter: a right key is never refused for failures
            return
        if self.failures is not None:  # the limiter may talk to Redis: off the event loop
            address = f"addr:{request.client.host if request.client is not None else 'unknown'}"
            await run_in_threadpool(self.failures.check, address)  # 429 once over the limit
        raise SigpropError(
            "forbidden", "the API key is not valid here", "use a key listed in the server's SIGPROP_API_KEYS"
        )


def tenant_of(key_digest_hex: str) -> str:
    """A key's tenant id, as records store it: a prefix of its digest (the rate limits' identity)."""
    return f"key:{key_digest_hex[:32]}"


@dataclass(frozen=True)
class Viewer:
    """The caller as the tenant rules see it: its tenant (None without a valid key), whether its
    key is an admin key, and whether the server has keys at all (without keys nothing is owned)."""

    tenant: str | None
    admin: bool = False
    keys_configured: bool = True

    @property
    def full(self) -> bool:
        """Sees error texts and dataset names (any valid key, or a server without keys)."""
        return self.tenant is not None

    def may_see(self, owner: str | None) -> bool:
        """Whether a record submitted by ``owner`` exists for this caller (else: 404)."""
        if not self.keys_configured or self.admin:
            return True
        return owner is not None and owner == self.tenant


# internal callers (the worker side, tests of the logic): every record, unredacted
EVERYONE = Viewer("internal", admin=True, keys_configured=False)


async def require_admin(request: Request) -> None:  # async: inline, no thread
    """403 unless the request carries an admin key (``SIGPROP_ADMIN_KEYS``); call after the key check."""
    if not request.app.state.keys.viewer(request).admin:
        raise SigpropError(
            "forbidden",
            "this needs an admin key",
            "use a key listed in the server's SIGPROP_ADMIN_KEYS (cached solutions are shared by every key)",
        )


async def open_access() -> None:
    """The dependency for reads when SIGPROP_KEYS_FOR_READS is off: everyone may read."""


def has_valid_key(request: Request) -> bool:
    """``KeyChecker.has_valid_key`` with the app's checker."""
    return request.app.state.keys.has_valid_key(request)


def client_identity(request: Request, keys: KeyChecker) -> str:
    """Who a rate limit counts this request against: its valid API key (by digest), else its address."""
    keyed = keys.valid_key_digest(request)
    if keyed is not None:
        return f"key:{keyed[:32]}"
    host = request.client.host if request.client is not None else "unknown"
    return f"addr:{host}"
