"""Dependencies the routers share: the services behind them, the API-key checks, the client's
identity for rate limits, and the thread pool that keeps blocking work off the event loop.

Everything lives on ``app.state``, put there by ``create_app``; a route asks for what it needs
with the ``Annotated`` aliases below (FastAPI's "Bigger Applications" layout).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Annotated, Any

from fastapi import Depends, Request

from .auth import client_identity, open_access
from .coldpool import timeout_error
from .solutions import SolutionService, SolveOutcome
from .validations import Validations

__all__ = [
    "Client",
    "Offload",
    "Run",
    "Solutions",
    "ValidationsService",
    "client_id",
    "count_validation",
    "open_access",
    "read_access",
    "require_key",
    "stored_read_access",
]


class Offload:
    """Blocking work (store calls, parsing) in a thread pool of its own, so it cannot block the
    event loop; awaited with the solve timeout (503 ``solve_timeout`` past it).

    Cold solves wait in a second pool (``solve``): their threads only wait on a solver process
    (``coldpool.SolverPool``), so however many cold solves are in flight, cache hits, stored
    solutions and the probes always find a free thread."""

    def __init__(self, timeout_s: float, workers: int = 8, cold_workers: int = 32):
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sigprop-io")
        self.cold = ThreadPoolExecutor(max_workers=cold_workers, thread_name_prefix="sigprop-cold")

    async def __call__(self, fn: Callable, *args) -> Any:
        return await self._timed(self.timeout_s, self.pool, fn, *args)

    async def solve(self, service: SolutionService, body: bytes, client: str | None) -> SolveOutcome:
        """``service.begin`` (a cache hit answers here) then ``service.finish`` in the cold pool,
        both within one solve timeout; the solver process itself is killed at the deadline. A cold
        answer is stored before it comes back (``SolutionService.finish``): when the wait gives up
        first, the solve runs on in its thread and still stores it and releases its lock."""
        deadline = time.monotonic() + self.timeout_s
        # the solver pool answers solve_timeout at the deadline; the margin covers the rest
        margin = 1.0 if service.solver is not None else 0.0
        if not service.knows(body):
            # a body never seen (or too large to hash here): most likely a cold solve, so begin and
            # finish run in one thread among the cold solves, one hand-off fewer (each costs a
            # scheduling delay on a busy machine); a large one is prepared in a solver process,
            # waited for there too, never in the threads cache hits need
            return await self._timed(self.timeout_s + margin, self.cold, service.solve, body, client, deadline)
        step = await self._timed(self.timeout_s, self.pool, service.begin, body, client)
        if isinstance(step, SolveOutcome):
            return step
        left = deadline - time.monotonic()
        return await self._timed(left + margin, self.cold, service.finish, step, deadline)

    async def _timed(self, timeout_s: float, pool: ThreadPoolExecutor, fn: Callable, *args) -> Any:
        work = pool.submit(fn, *args)
        try:
            return await thread_result(work, timeout_s)
        except asyncio.TimeoutError:
            raise timeout_error(self.timeout_s) from None
        except asyncio.CancelledError:
            work.cancel()  # not started yet: it never runs (as run_in_executor's future did)
            raise

    async def untimed(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        """Wait for the work in flight (in-flight solves finish before the process exits)."""
        self.pool.shutdown(wait=True)
        self.cold.shutdown(wait=True)


async def thread_result(work: Future, timeout_s: float) -> Any:
    """The result of ``work``, a thread pool's future, awaited on the event loop; asyncio.TimeoutError
    after ``timeout_s`` (the work itself runs on). The thread wakes the loop once, and the waiting
    task resumes in that same loop iteration: ``asyncio.wait_for(asyncio.wrap_future(...))`` took
    three iterations and two futures more, 30-60 microseconds of every cold request on an idle
    2-vCPU machine (bench/README.md, "Cold solves over HTTP against in-process")."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def from_thread(_work: Future) -> None:
        try:
            loop.call_soon_threadsafe(wake)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    expiry = loop.call_later(max(timeout_s, 0.001), wake)
    work.add_done_callback(from_thread)
    try:
        await waiter
    finally:
        expiry.cancel()
    if not work.done():
        raise asyncio.TimeoutError
    return work.result()


# -- access ----------------------------------------------------------------------------------------


async def require_key(request: Request) -> None:  # async: runs inline, not in a thread pool
    """401 without an API key, 403 with a wrong one (``auth.KeyChecker``)."""
    await request.app.state.keys(request)


def read_access(keys_for_reads: bool) -> Callable:
    """The dependency guarding the solve and every read: :func:`require_key` itself with
    ``SIGPROP_KEYS_FOR_READS`` (FastAPI runs a dependency once per request, so a route that needs
    the key anyway checks it once), else open access."""
    return require_key if keys_for_reads else open_access


def stored_read_access(settings, keys_configured: bool) -> Callable:
    """The dependency guarding reads of stored submissions (solutions with their requests and
    graphs, validations, the dashboard): :func:`require_key` whenever keys are configured, unless
    ``SIGPROP_ANONYMOUS_STORED_READS`` opens them (``SIGPROP_KEYS_FOR_READS`` still wins)."""
    if settings.keys_for_reads or (keys_configured and not settings.anonymous_stored_reads):
        return require_key
    return open_access


async def client_id(request: Request) -> str:  # async: no I/O, so inline rather than in a thread
    """Who a rate limit counts this request against (``auth.client_identity``)."""
    return client_identity(request, request.app.state.keys)


# -- services --------------------------------------------------------------------------------------


# async: FastAPI runs a plain ``def`` dependency in a thread; these only read app.state
async def _solutions(request: Request) -> SolutionService:
    return request.app.state.solutions


async def _validations(request: Request) -> Validations:
    return request.app.state.validations


async def _offload(request: Request) -> Offload:
    return request.app.state.offload


Solutions = Annotated[SolutionService, Depends(_solutions)]
ValidationsService = Annotated[Validations, Depends(_validations)]
Run = Annotated[Offload, Depends(_offload)]
Client = Annotated[str, Depends(client_id)]


async def count_validation(request: Request, run: Run, client: Client) -> None:
    """Count a validation submission against the client's budget (429 ``rate_limited`` over it)."""
    limit = request.app.state.limits.validations
    if limit.enabled:
        await run(limit, client)  # the limiter may talk to Redis: off the event loop
