"""uvicorn wiring that the defaults get wrong for this service, and the one set of uvicorn options
``sigprop serve`` runs with (``bench/http_bench.py`` serves its bare baseline app with the same).

With ``--workers`` > 1 uvicorn binds the listening socket itself with protocol number 0, and
asyncio only enables TCP_NODELAY on sockets created with IPPROTO_TCP; Nagle's algorithm then holds
every keep-alive response until the client's delayed ACK, about 40 ms (uvicorn issue #3149).
Setting the option on each accepted connection restores sub-millisecond responses.

Each connection also gets the header and body deadlines, the connection cap and the header-size
limit of ``connections.py``: uvicorn has none of them. No response says ``Server: uvicorn``.

The metrics port is a uvicorn server too (``serve_metrics``), with the same protocol classes and a
guard of its own: prometheus_client's ``start_http_server`` ran a thread per connection with no
deadline, and 1,000 half-open connections grew it to 997 threads and 300% CPU for minutes.
"""

from __future__ import annotations

import importlib.util
import socket
import threading

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .connections import ConnectionGuard, GuardedConnection, guard_from_settings


def _no_delay(transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class NoDelayH11Protocol(GuardedConnection, H11Protocol):
    def connection_made(self, transport) -> None:  # type: ignore[override]
        _no_delay(transport)
        super().connection_made(transport)

    def handle_events(self) -> None:
        # h11 buffers a request until it is whole: its state after each batch of data says where
        # the request stands (a request pipelined behind one in flight waits in the buffer, and
        # its deadline starts once the parser turns to it)
        super().handle_events()
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._request_began()
            self._headers_done()
        elif state is h11.DONE or state is h11.MUST_CLOSE:
            self._request_done()
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            self._request_began()


if importlib.util.find_spec("httptools") is not None:
    from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class NoDelayHttpToolsProtocol(GuardedConnection, HttpToolsProtocol):  # module level: unpickled by name
        def connection_made(self, transport) -> None:  # type: ignore[override]
            _no_delay(transport)
            super().connection_made(transport)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._request_began()

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._headers_done()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._request_done()
            self._start_deferred()

        # A request with a body reaches the app once the body is whole (or past the flow-control
        # mark, where uvicorn waits for the app to read): a client stalled in its body then costs
        # a parser and a timer, not a run through the middleware and the route, which is what
        # made thousands of them slow the probes queued behind them.
        _deferred = None

        def _start_asgi_task(self, cycle, app) -> None:
            if cycle.more_body and not cycle.waiting_for_100_continue and self._phase != "idle":
                self._deferred = (cycle, app)
            else:
                super()._start_asgi_task(cycle, app)

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            if self._deferred is not None and len(self._deferred[0].body) > HIGH_WATER_LIMIT:
                self._start_deferred()

        def shutdown(self) -> None:
            if self._deferred is not None:  # the app never saw it: nothing to finish
                self.transport.close()
                return
            super().shutdown()

        def _start_deferred(self) -> None:
            if self._deferred is not None:
                cycle, app = self._deferred
                self._deferred = None
                super()._start_asgi_task(cycle, app)

else:  # without uvicorn[standard]: h11
    NoDelayHttpToolsProtocol = None


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def http_protocol() -> type:
    """The fastest HTTP parser uvicorn offers here (httptools, from ``uvicorn[standard]``, else
    h11), with TCP_NODELAY on every connection."""
    return NoDelayHttpToolsProtocol if NoDelayHttpToolsProtocol is not None else NoDelayH11Protocol


# h11 refuses an incomplete request past its own buffer bound with a 400; past ours plus one read,
# so that connections.py answers first, with 431
_H11_SLACK = 512 * 1024


def uvicorn_options(workers: int, max_header_bytes: int = 65_536) -> dict:
    """The uvicorn.run options of ``sigprop serve``: the parser and the event loop (uvloop, from
    ``uvicorn[standard]``, else asyncio's) that decide its speed, and no ``Server`` banner."""
    return {
        "workers": workers,
        "http": http_protocol(),
        "loop": "uvloop" if _installed("uvloop") else "asyncio",
        "server_header": False,
        "h11_max_incomplete_event_size": max_header_bytes + _H11_SLACK,
    }


# -- the metrics port ------------------------------------------------------------------------------

_METRICS_GUARD: ConnectionGuard | None = None


def _metrics_guard() -> ConnectionGuard:
    global _METRICS_GUARD
    if _METRICS_GUARD is None:
        _METRICS_GUARD = guard_from_settings()
    return _METRICS_GUARD


class MetricsH11Protocol(NoDelayH11Protocol):
    def _guard(self) -> ConnectionGuard:
        return _metrics_guard()


if NoDelayHttpToolsProtocol is not None:

    class MetricsHttpToolsProtocol(NoDelayHttpToolsProtocol):
        def _guard(self) -> ConnectionGuard:
            return _metrics_guard()

else:
    MetricsHttpToolsProtocol = None


def metrics_protocol() -> type:
    """``http_protocol()`` answering to the metrics port's own guard (its own cap and counts)."""
    return MetricsHttpToolsProtocol if MetricsHttpToolsProtocol is not None else MetricsH11Protocol


def serve_metrics(app, host: str, port: int, settings) -> threading.Thread:
    """Serve ``app`` (Prometheus' ASGI app) on ``host:port`` from a daemon thread with its own event
    loop, under the API's deadlines, connection cap and header limit. Binds before it returns:
    OSError when the port cannot be had."""
    import uvicorn

    global _METRICS_GUARD
    _METRICS_GUARD = guard_from_settings(settings)
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    config = uvicorn.Config(
        app,
        http=metrics_protocol(),
        loop="asyncio",
        lifespan="off",
        log_level="warning",
        access_log=False,
        server_header=False,
        proxy_headers=False,
        timeout_keep_alive=5,
        h11_max_incomplete_event_size=settings.max_header_bytes + _H11_SLACK,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="sigprop-metrics", daemon=True)
    thread.start()
    return thread
