"""Slow clients shed and open connections bounded, in each API process of ``sigprop serve``.

uvicorn closes an idle kept-alive connection after ``timeout_keep_alive``, but gives a request
that is still arriving no deadline: a client that sends part of its headers or body and stalls
holds a file descriptor for as long as it likes, and about a thousand of them exhaust a process's
descriptors, so that even ``/healthz`` goes unanswered (issue 26). The HTTP protocol classes of
``server.py`` add, per connection:

- a header deadline (``SIGPROP_HEADER_TIMEOUT_S``): from the moment the connection is accepted, or
  from the first byte of a later request on a kept-alive connection, to the end of the headers;
- a body deadline (``SIGPROP_BODY_TIMEOUT_S``): from the end of the headers to the end of the body;
- a cap on open connections (``SIGPROP_MAX_CONNECTIONS``, lowered to fit the process's descriptor
  limit). A connection accepted at the cap closes the connection that has been sending its request
  the longest, else the oldest idle kept-alive one, else itself (every connection then has a
  request in flight). A probe or any quick client is therefore admitted at the cap: what is shed is
  the slowest sender, which is what a slow-client attack is made of.

A deadline or a cap closes the transport without an answer (as nginx does for a header timeout
past which it closes too): a client that stalls has shown it is not reading one.

- a header-size limit (``SIGPROP_MAX_HEADER_BYTES``): a request whose line and headers pass it
  while still arriving gets 431 ``headers_too_large`` and the connection closes, so a client never
  makes the parser buffer more than the limit and one read (eight 150 MB header blocks grew an API
  process by 1.15 GB). Counted per read, a header block is refused within one read (at most
  256 KiB) past the limit.

The metrics port (``sigprop serve`` with ``SIGPROP_METRICS_PORT``) runs the same protocol classes
with a guard of its own (``server.metrics_protocol``): the same deadlines, cap and header limit.
"""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass, field

from .observability import CONNECTIONS_SHED

# descriptors each process keeps for everything but client connections: the listening socket,
# the event loop's own, Redis connections (one per pool thread at most), the solver processes'
# pipes, the metric files, and the connections accepted in one burst before the cap is applied
RESERVED_FDS = 256


def connection_cap(configured: int) -> int:
    """``configured``, lowered so that the open connections and the reserve fit the soft descriptor
    limit (``ulimit -n``): past that limit accept() fails and new connections, probes included, are
    refused until some close."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(16, min(configured, soft - RESERVED_FDS))


@dataclass
class ConnectionGuard:
    """This process's open connections, oldest first, and those still sending a request."""

    cap: int
    header_timeout_s: float
    body_timeout_s: float
    open: dict = field(default_factory=dict)  # protocol -> None: an insertion-ordered set
    reading: dict = field(default_factory=dict)  # protocol -> None, by when its request began
    max_header_bytes: int = 65_536
    shed: dict = field(
        default_factory=lambda: {"header_timeout": 0, "body_timeout": 0, "cap": 0, "headers_too_large": 0}
    )

    def admit(self, conn) -> bool:
        """Register ``conn``; at the cap, first close the slowest connection (False: none can go,
        ``conn`` must close)."""
        if len(self.open) >= self.cap:
            victim = next(iter(self.reading), None) or next((c for c in self.open if c.guard_idle()), None)
            if victim is None:
                self.shed["cap"] += 1
                CONNECTIONS_SHED.labels("cap").inc()
                return False
            self.drop(victim, "cap")
        self.open[conn] = None
        return True

    def drop(self, conn, reason: str) -> None:
        self.shed[reason] += 1
        CONNECTIONS_SHED.labels(reason).inc()
        self.forget(conn)
        conn.guard_close()

    def forget(self, conn) -> None:
        self.open.pop(conn, None)
        self.reading.pop(conn, None)


_GUARD: ConnectionGuard | None = None


def guard_from_settings(settings=None) -> ConnectionGuard:
    """A guard with the settings' deadlines, cap and header limit."""
    if settings is None:
        from ..settings import get_settings

        settings = get_settings()
    return ConnectionGuard(
        connection_cap(settings.max_connections),
        settings.header_timeout_s,
        settings.body_timeout_s,
        max_header_bytes=settings.max_header_bytes,
    )


def guard() -> ConnectionGuard:
    """This process's guard, from the settings at its first connection (every uvicorn worker is a
    process of its own and builds its own)."""
    global _GUARD
    if _GUARD is None:
        _GUARD = guard_from_settings()
    return _GUARD


def current_guard() -> ConnectionGuard | None:
    """This process's guard if it has served a connection through ``server.py``'s protocols."""
    return _GUARD


def use_guard(new: ConnectionGuard | None) -> None:
    """Replace this process's guard (tests serving in-process; None: rebuild from the settings)."""
    global _GUARD
    _GUARD = new


class GuardedConnection:
    """The deadlines and the cap, mixed into a uvicorn HTTP protocol class (before it in the bases).

    The parser-specific subclass calls ``_request_began``, ``_headers_done`` and ``_request_done``
    at those points of each request; the first request's header deadline starts at the accept."""

    _deadline = None  # the loop's TimerHandle while a request is arriving
    _phase = "idle"  # idle (no request arriving), headers, body
    _header_bytes = 0  # bytes read since the request began, while its headers are still arriving

    def _guard(self) -> ConnectionGuard:
        """The guard this connection answers to: the process's (the metrics port has its own)."""
        return guard()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self._guard().admit(self):
            transport.close()
            return
        self._request_began()

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        self._guard().forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase != "body":
            self._header_bytes += len(data)
        super().data_received(data)
        if self._phase != "headers":
            self._header_bytes = 0
        elif self._header_bytes > self._guard().max_header_bytes and not self.transport.is_closing():
            self._headers_too_large()

    def _headers_too_large(self) -> None:
        """431 with the contract's error, then close: the parser never buffers more."""
        limit = self._guard().max_header_bytes
        body = json.dumps(
            {
                "error": {
                    "code": "headers_too_large",
                    "message": f"the request line and headers exceed {limit} bytes",
                    "hint": "send fewer or shorter headers (cookies, tokens); the limit is SIGPROP_MAX_HEADER_BYTES",
                }
            }
        ).encode()
        head = (
            "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-content-type-options: nosniff\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self._guard().drop(self, "headers_too_large")

    # -- what the guard asks of a connection --------------------------------------------------

    def guard_idle(self) -> bool:
        """Kept alive between requests: no request arriving, none in flight."""
        cycle = getattr(self, "cycle", None)
        return self._phase == "idle" and (cycle is None or cycle.response_complete)

    def guard_close(self) -> None:
        self._cancel_deadline()
        self._phase = "idle"
        if not self.transport.is_closing():
            self.transport.close()

    # -- the request's phases -----------------------------------------------------------------

    def _request_began(self) -> None:
        if self._phase != "idle":
            return
        self._phase = "headers"
        self._guard().reading[self] = None
        self._arm(self._guard().header_timeout_s, "header_timeout")

    def _headers_done(self) -> None:
        if self._phase == "headers":
            self._phase = "body"
            self._arm(self._guard().body_timeout_s, "body_timeout")

    def _request_done(self) -> None:
        if self._phase != "idle":
            self._phase = "idle"
            self._cancel_deadline()
            self._guard().reading.pop(self, None)

    def _arm(self, seconds: float, reason: str) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(seconds, self._expired, reason)

    def _expired(self, reason: str) -> None:
        self._deadline = None
        if self._phase != "idle":
            self._guard().drop(self, reason)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
