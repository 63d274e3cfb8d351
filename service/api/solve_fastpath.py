"""``POST /v1/solve`` answered before FastAPI routes the request: hits from memory, cold solves
straight from the solve threads.

A hit whose answer is in this process's memory (``SolutionService.hot_hit``: a body seen before,
its answer in ``storage/hot.py``) costs a few microseconds; FastAPI's routing, its exception
middlewares and dependency resolution around it cost several times that. A cold MLP-100 solve
takes 1-4 ms, and the same layers, plus the route's background task (a thread hop on the event
loop for the store write), were a fifth of a cold request's time over HTTP. So this ASGI
middleware answers the whole endpoint: a hit on the event loop, anything else through
``Offload.solve`` exactly as the route does (admission, single flight, the solve, the store write
after the answer is sent, in the cold threads), with the contract's error answers
(``handlers.error_response``). It sits inside the logging, metrics and body-limit middlewares
(``observability.py``), so every request it answers is logged, counted and size-limited like any
other, with the same headers the route sends.

Requests go on to the route (``routers/solve.py``, which keeps the OpenAPI description and the same
behaviour) when reads need an API key (``SIGPROP_KEYS_FOR_READS``: the route's dependency checks it),
and for any other method or path.
"""

from __future__ import annotations

from types import SimpleNamespace

from starlette.requests import Request

from ..errors import SigpropError
from ..storage import CacheUnavailable
from .auth import client_identity
from .handlers import CACHE_DOWN_ERROR, error_response
from .solutions import SolveOutcome

_PATH = "/v1/solve"
_ROUTE = SimpleNamespace(path=_PATH)  # what the logs and metrics read as the route (scope["route"])


class SolveFastPath:
    def __init__(self, app, state, enabled: bool = True):
        self.app = app
        self.state = state  # the app's state: solutions, offload and keys (set up by create_app)
        self.enabled = enabled

    async def __call__(self, scope, receive, send):
        if not self.enabled or scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != _PATH:
            return await self.app(scope, receive, send)
        body, disconnected = await _read_body(receive)
        if disconnected is not None:  # the client went away mid-body: the app sees it as before
            return await self.app(scope, _replay([disconnected], receive), send)
        scope["route"] = _ROUTE
        solutions = self.state.solutions
        outcome = solutions.hot_hit(body)
        if outcome is None:
            try:
                client = client_identity(Request(scope), self.state.keys)
                outcome = await self.state.offload.solve(solutions, body, client)
            except SigpropError as err:
                return await error_response(err)(scope, receive, send)
            except CacheUnavailable:
                return await error_response(CACHE_DOWN_ERROR)(scope, receive, send)
        if outcome.cached:
            scope.setdefault("state", {})["cache_hit"] = True  # logged at DEBUG (observability.py)
        await send_outcome(outcome, send)


async def send_outcome(outcome: SolveOutcome, send) -> None:
    """Send a solve's answer (200, its key header): the path above and the route
    (``routers/solve.py``) both answer through here. A cold answer was stored before it came here
    (``SolutionService.finish``), so a client's next request finds it."""
    answer = outcome.body if isinstance(outcome.body, bytes) else outcome.body.encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"x-sigprop-key", outcome.key.encode()),
                (b"content-length", str(len(answer)).encode()),
                (b"content-type", b"application/json"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": answer})


async def _read_body(receive):
    """The whole request body, or the message that ended it early (a disconnect)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"", message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _replay(messages: list, receive):
    async def replay():
        return messages.pop(0) if messages else await receive()

    return replay
