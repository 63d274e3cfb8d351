"""Cache hits of ``POST /v1/solve`` answered from memory before FastAPI routes the request.

A hit whose answer is in this process's memory (``SolutionService.hot_hit``: a body seen before,
its answer in ``storage/hot.py``) costs a few microseconds; FastAPI's routing and dependency
resolution around it cost several times that. This ASGI middleware sits inside the logging,
metrics and body-limit middlewares (``observability.py``), so a hit served here is logged,
counted and size-limited like any request, with the same headers the route sends. Anything else,
and every request when reads need an API key (``SIGPROP_KEYS_FOR_READS``: the route's dependency
checks the key), goes on to the app with its body replayed.
"""

from __future__ import annotations

from types import SimpleNamespace

_PATH = "/v1/solve"
_ROUTE = SimpleNamespace(path=_PATH)  # what the logs and metrics read as the route (scope["route"])


class HotHitMiddleware:
    def __init__(self, app, solutions, enabled: bool = True):
        self.app = app
        self.solutions = solutions
        self.enabled = enabled and solutions.hot is not None

    async def __call__(self, scope, receive, send):
        if not self.enabled or scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != _PATH:
            return await self.app(scope, receive, send)
        body, replay = await _read_body(receive)
        outcome = self.solutions.hot_hit(body)
        if outcome is None:
            return await self.app(scope, replay, send)
        scope["route"] = _ROUTE
        scope.setdefault("state", {})["cache_hit"] = True  # logged at DEBUG (observability.py)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [  # as the route's Response sends them, in its order
                    (b"x-sigprop-key", outcome.key.encode()),
                    (b"content-length", str(len(outcome.body)).encode()),
                    (b"content-type", b"application/json"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": outcome.body})


async def _read_body(receive):
    """The whole request body, and a ``receive`` that gives it again to the app behind."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: the app sees it too
            return b"", _replay([message], receive)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    return body, _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


def _replay(messages: list, receive):
    async def replay():
        return messages.pop(0) if messages else await receive()

    return replay
