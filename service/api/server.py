"""uvicorn wiring that the defaults get wrong for this service.

With ``--workers`` > 1 uvicorn binds the listening socket itself with protocol number 0, and
asyncio only enables TCP_NODELAY on sockets created with IPPROTO_TCP; Nagle's algorithm then holds
every keep-alive response until the client's delayed ACK, about 40 ms (uvicorn issue #3149).
Setting the option on each accepted connection restores sub-millisecond responses.
"""

from __future__ import annotations

import socket

from uvicorn.protocols.http.h11_impl import H11Protocol


class NoDelayH11Protocol(H11Protocol):
    def connection_made(self, transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        super().connection_made(transport)
