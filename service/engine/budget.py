"""A cooperative time budget for a solve that runs where it cannot be killed.

The service solves a small cold request in its own API process (``api/solutions.py``, the inline
lane), where a solver process's hop costs as much as the solve. A solve there must not hold the
process for long: ``within(seconds)`` sets a wall-clock budget for the calling thread, and the
engine calls ``check()`` where its work repeats (each evaluation of a root search's conditions,
each pass of a network-wide root search, each shift of the root scan), so a solve past its budget
stops at the next such point with ``OverBudget``, and the caller solves it elsewhere.

The check points sit between evaluations, never inside one: a solve stopped there leaves no
half-built table or cache behind (the engine's caches are filled by completed evaluations only),
so a later solve in the same process computes exactly what it would have. ``OverBudget`` is a
``BaseException``, so the engine's ``except Exception`` fallbacks (a start that fails, a root
that does not polish) cannot mistake it for a failed step. Outside ``within`` a check costs one
attribute read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


class OverBudget(BaseException):
    """The solve ran past the budget ``within`` set for its thread."""


def check() -> None:
    until = getattr(_local, "until", None)
    if until is not None and time.perf_counter() > until:
        raise OverBudget


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """Run the block with a budget of ``seconds`` of wall-clock time from now (nests: the inner,
    earlier end wins, and the outer budget comes back after the block)."""
    outer = getattr(_local, "until", None)
    until = time.perf_counter() + seconds
    _local.until = until if outer is None else min(outer, until)
    try:
        yield
    finally:
        _local.until = outer
