"""Two HTTP rules every API response follows, as pure ASGI middleware (no per-request task):

- a request with a body to a JSON route (a ``POST`` route of the API) must say
  ``Content-Type: application/json``, else 415 ``unsupported_media_type`` before anything reads
  it. A browser sends ``text/plain``, form or multipart bodies across origins without asking (a
  "simple" request), but ``application/json`` only after a CORS preflight this service never
  grants: so a page on another origin cannot make a signed-in user's browser submit work (CSRF);
- every response says ``X-Content-Type-Options: nosniff``, so a browser never runs a stored answer
  or an error that echoes input as anything but its declared type.
"""

from __future__ import annotations

import json

# POST is the only method the API takes a body with (and the only one a cross-origin page can send
# without a preflight); a PUT or PATCH goes on to routing, which answers 405
JSON_METHODS = frozenset({"POST"})
NOSNIFF = (b"x-content-type-options", b"nosniff")


def is_json(content_type: bytes | None) -> bool:
    """Whether a Content-Type header names ``application/json`` (parameters such as charset allowed)."""
    if not content_type:
        return False
    return content_type.split(b";", 1)[0].strip().lower() == b"application/json"


async def send_error(send, status: int, code: str, message: str, hint: str, headers: tuple = ()) -> None:
    """The contract's error object as a whole ASGI response, for middleware that answers before any
    route (413, 405, 415)."""
    body = json.dumps({"error": {"code": code, "message": message, "hint": hint}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class JsonBodiesMiddleware:
    """415 for a body to a JSON route that is not ``application/json`` (module docstring). Inside the
    request context (``observability.RequestContextMiddleware``), so the answer carries the request id
    and is logged and counted like any other."""

    def __init__(self, app, paths: frozenset[str]):
        self.app = app
        self.paths = paths  # the routes that take a JSON body (POST /v1/solve, POST /v1/validations)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in JSON_METHODS and scope["path"] in self.paths:
            content_type = next((v for k, v in scope["headers"] if k == b"content-type"), None)
            if not is_json(content_type):
                given = content_type.decode("latin-1")[:100] if content_type else "none"
                return await send_error(
                    send,
                    415,
                    "unsupported_media_type",
                    f"this endpoint takes a JSON body; the request's Content-Type is {given}",
                    "send the body with the header 'Content-Type: application/json'",
                )
        return await self.app(scope, receive, send)


class NosniffMiddleware:
    """``X-Content-Type-Options: nosniff`` on every response (module docstring): the outermost layer,
    so answers the other middleware write themselves (405, 413, 415) carry it too."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_nosniff(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == NOSNIFF[0] for k, _ in headers):
                    headers.append(NOSNIFF)
                message = {**message, "headers": headers}
            await send(message)

        return await self.app(scope, receive, with_nosniff)
