"""API keys for writes that cost or destroy. Keys are kept only as SHA-256 digests and compared
in constant time; the contract's 401 (no key) and 403 (wrong key) errors."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from ..errors import SigpropError


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyChecker:
    def __init__(self, keys_csv: str):
        self._digests = [digest(k.strip()) for k in keys_csv.split(",") if k.strip()]

    def __call__(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise SigpropError("unauthorized", "this endpoint needs an API key",
                               "send the header 'Authorization: Bearer <key>'")
        given = digest(token.strip())
        ok = False
        for d in self._digests:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(given, d)
        if not ok:
            raise SigpropError("forbidden", "the API key is not valid here",
                               "use a key listed in the server's SIGPROP_API_KEYS")
