"""Who may start a cold solve now: the scheduling half of ``coldpool.SolverPool``.

One semaphore in front of the solver processes made them first come, first served for everyone:
six large solves from one client held both processes and every later request, however small,
queued behind them for tens of seconds. ``Lanes`` admits a waiting solve when

- a slot of its lane is free: ``general`` slots take any solve, ``small`` more slots take only
  solves the caller marks small (by price, known before the solve: ``preparation.solve_price``),
  so a small solve never waits behind large ones;
- and, for a solve not marked small, its share runs fewer than ``per_client`` such solves (0: no
  cap; a solve with no client, as in offline use, is not capped), so one client's queue of large
  solves never holds every general slot while another client waits.

Fair queueing: the waiters are grouped by share, and a freed slot goes to the share served least
recently (round robin), not to the oldest waiter: a client with a backlog of 200 solves gets one
slot in turn like every other client, so another client's small solve waits at most for a solve
already running (its own service time), never for the backlog. A share is the client's API key
(``key:...``); every anonymous client (``addr:...``) shares one, so rotating source addresses does
not multiply a client's share, and within it the addresses take turns too. Within one client the
oldest waiter that may start goes first; a waiter its share's cap holds back keeps its place.
The grants happen under one lock, in ``acquire`` and ``release``, so a freed slot is handed to the
next eligible waiter at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

GENERAL, SMALL = "general", "small"
ANONYMOUS = "anonymous"  # the one share of every client without an API key


def share_of(client: str | None) -> str | None:
    """The share a client's solves are scheduled in: its key, or one for all anonymous clients."""
    if client is not None and client.startswith("addr:"):  # ``auth.client_identity``'s spelling
        return ANONYMOUS
    return client


@dataclass(eq=False)
class Ticket:
    """A waiter, and once granted, the lane it holds (``release`` gives it back)."""

    client: str | None
    small: bool
    event: threading.Event = field(default_factory=threading.Event)
    lane: str | None = None

    @property
    def share(self) -> str | None:
        return share_of(self.client)


class Lanes:
    def __init__(self, general: int, small: int = 0, per_client: int = 0):
        if general < 1:
            raise ValueError("a solver pool needs at least one general slot")
        self.free = {GENERAL: general, SMALL: max(0, small)}
        self.per_client = max(0, per_client)
        self._running: dict[str | None, int] = {}  # large solves running, per share
        # share -> client -> its waiters, oldest first; both orders are least recently served first
        self._queues: OrderedDict[str | None, OrderedDict[str | None, list[Ticket]]] = OrderedDict()
        self._waiting = 0
        self._lock = threading.Lock()

    def acquire(self, client: str | None, small: bool, timeout_s: float) -> Ticket | None:
        """A granted ticket, or None when none was granted within ``timeout_s``."""
        ticket = Ticket(client, small)
        with self._lock:
            self._enqueue(ticket)
            self._grant()
        if ticket.event.wait(max(0.0, timeout_s)):
            return ticket
        with self._lock:
            if ticket.lane is not None:  # granted between the timeout and the lock
                return ticket
            self._remove(ticket)
        return None

    def release(self, ticket: Ticket) -> None:
        with self._lock:
            self.free[ticket.lane] += 1
            if self._capped(ticket):
                left = self._running[ticket.share] - 1
                if left:
                    self._running[ticket.share] = left
                else:
                    del self._running[ticket.share]
            self._grant()

    def waiting(self) -> int:
        with self._lock:
            return self._waiting

    def _capped(self, ticket: Ticket) -> bool:
        return bool(self.per_client) and ticket.client is not None and not ticket.small

    def _may_start(self, ticket: Ticket) -> bool:
        if self._capped(ticket) and self._running.get(ticket.share, 0) >= self.per_client:
            return False
        return bool(self.free[GENERAL] or (ticket.small and self.free[SMALL]))

    def _enqueue(self, ticket: Ticket) -> None:
        """Into its client's queue; a share or client with no waiters goes to the front of the
        turn order (it was served least recently: a light client's solve starts next)."""
        share, client = ticket.share, ticket.client
        if share not in self._queues:
            self._queues[share] = OrderedDict()
            self._queues.move_to_end(share, last=False)
        clients = self._queues[share]
        if client not in clients:
            clients[client] = []
            clients.move_to_end(client, last=False)
        clients[client].append(ticket)
        self._waiting += 1

    def _remove(self, ticket: Ticket) -> None:
        clients = self._queues[ticket.share]
        waiters = clients[ticket.client]
        waiters.remove(ticket)
        self._waiting -= 1
        if not waiters:
            del clients[ticket.client]
            if not clients:
                del self._queues[ticket.share]

    def _next(self) -> Ticket | None:
        """The waiter to start next: of the share and client served least recently, the oldest one
        that may start (the lock is held)."""
        for clients in self._queues.values():
            for waiters in clients.values():
                for ticket in waiters:
                    if self._may_start(ticket):
                        return ticket
        return None

    def _grant(self) -> None:
        """Start waiters while a slot is free, in turn by share (the lock is held)."""
        while self.free[GENERAL] or self.free[SMALL]:
            ticket = self._next()
            if ticket is None:
                return
            lane = SMALL if ticket.small and self.free[SMALL] else GENERAL
            self.free[lane] -= 1
            if self._capped(ticket):
                self._running[ticket.share] = self._running.get(ticket.share, 0) + 1
            share, client = ticket.share, ticket.client
            self._remove(ticket)
            # served: to the back of the turn order, the share and, within it, the client
            if share in self._queues:
                self._queues.move_to_end(share)
                if client in self._queues[share]:
                    self._queues[share].move_to_end(client)
            ticket.lane = lane
            ticket.event.set()
