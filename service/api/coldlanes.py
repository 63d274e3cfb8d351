"""Who may start a cold solve now: the scheduling half of ``coldpool.SolverPool``.

One semaphore in front of the solver processes made them first come, first served for everyone:
six large solves from one client held both processes and every later request, however small,
queued behind them for tens of seconds. ``Lanes`` admits a waiting solve when

- a slot of its lane is free: ``general`` slots take any solve, ``small`` more slots take only
  solves the caller marks small (a cost in nodes + edges known before the solve, see
  ``solutions.ColdSolve.cost``), so a small solve never waits behind large ones;
- and, for a solve not marked small, its client runs fewer than ``per_client`` such solves (0: no
  cap; a solve with no client, as in offline use, is not capped), so one client's queue of large
  solves never holds every general slot while another client waits. Small solves are not capped:
  they take milliseconds, so a queue of them moves on at once, and one client's many small
  solves (a load test, a sweep) keep the throughput they had.

Among the waiters that may start, the one that came first starts first; a waiter its client's
cap holds back keeps its place and is passed over meanwhile. The grants happen under one lock,
in ``acquire`` and ``release``, so a freed slot is handed to the next eligible waiter at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

GENERAL, SMALL = "general", "small"


@dataclass(eq=False)
class Ticket:
    """A waiter, and once granted, the lane it holds (``release`` gives it back)."""

    client: str | None
    small: bool
    event: threading.Event = field(default_factory=threading.Event)
    lane: str | None = None


class Lanes:
    def __init__(self, general: int, small: int = 0, per_client: int = 0):
        if general < 1:
            raise ValueError("a solver pool needs at least one general slot")
        self.free = {GENERAL: general, SMALL: max(0, small)}
        self.per_client = max(0, per_client)
        self._running: dict[str | None, int] = {}
        self._queue: list[Ticket] = []
        self._lock = threading.Lock()

    def acquire(self, client: str | None, small: bool, timeout_s: float) -> Ticket | None:
        """A granted ticket, or None when none was granted within ``timeout_s``."""
        ticket = Ticket(client, small)
        with self._lock:
            self._queue.append(ticket)
            self._grant()
        if ticket.event.wait(max(0.0, timeout_s)):
            return ticket
        with self._lock:
            if ticket.lane is not None:  # granted between the timeout and the lock
                return ticket
            self._queue.remove(ticket)
        return None

    def release(self, ticket: Ticket) -> None:
        with self._lock:
            self.free[ticket.lane] += 1
            if self._capped(ticket):
                left = self._running[ticket.client] - 1
                if left:
                    self._running[ticket.client] = left
                else:
                    del self._running[ticket.client]
            self._grant()

    def waiting(self) -> int:
        with self._lock:
            return len(self._queue)

    def _capped(self, ticket: Ticket) -> bool:
        return bool(self.per_client) and ticket.client is not None and not ticket.small

    def _grant(self) -> None:
        """Start every waiter that may start, oldest first (the lock is held)."""
        for ticket in list(self._queue):
            if not (self.free[GENERAL] or self.free[SMALL]):
                return
            if self._capped(ticket) and self._running.get(ticket.client, 0) >= self.per_client:
                continue
            lane = SMALL if ticket.small and self.free[SMALL] else GENERAL if self.free[GENERAL] else None
            if lane is None:
                continue
            self.free[lane] -= 1
            if self._capped(ticket):
                self._running[ticket.client] = self._running.get(ticket.client, 0) + 1
            self._queue.remove(ticket)
            ticket.lane = lane
            ticket.event.set()
