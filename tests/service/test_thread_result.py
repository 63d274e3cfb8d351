"""``deps.thread_result``: a thread pool's result awaited on the event loop with a timeout, and
``Offload``'s cold path built on it: a cold solve runs on to its store write when nobody waits for
the answer any more (the wait timed out, or the request's task was cancelled)."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from sigprop.api.deps import Offload, thread_result
from sigprop.errors import SigpropError


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2) as p:
        yield p


def test_the_result_of_the_thread_comes_back(pool):
    async def main():
        return await thread_result(pool.submit(lambda: 41 + 1), 5)

    assert asyncio.run(main()) == 42


def test_an_exception_in_the_thread_is_raised_to_the_waiter(pool):
    def fails():
        raise SigpropError("unreachable_target", "no root", "a smaller target")

    async def main():
        return await thread_result(pool.submit(fails), 5)

    with pytest.raises(SigpropError) as info:
        asyncio.run(main())
    assert info.value.code == "unreachable_target"


def test_past_the_timeout_the_waiter_gives_up_and_the_work_runs_on(pool):
    release, ran = threading.Event(), threading.Event()

    def slow():
        release.wait(5)
        ran.set()
        return "done"

    async def main():
        work = pool.submit(slow)
        start = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await thread_result(work, 0.05)
        waited = time.monotonic() - start
        assert not work.done()
        return waited, work

    waited, work = asyncio.run(main())
    assert 0.04 <= waited < 1.0
    release.set()
    assert work.result(timeout=5) == "done" and ran.is_set()


def test_a_work_already_done_answers_without_waiting(pool):
    work = pool.submit(lambda: "ready")
    work.result()

    async def main():
        return await thread_result(work, 5)

    assert asyncio.run(main()) == "ready"


class _ColdService:
    """Just enough of ``SolutionService`` for ``Offload.solve``'s cold path: an unknown body, and a
    solve that blocks until released, then stores its answer and returns it (as ``finish`` does)."""

    solver = None

    def __init__(self):
        self.release = threading.Event()
        self.stored = threading.Event()

    def knows(self, body):
        return False

    def solve(self, body, client, deadline):
        self.release.wait(5)
        self.stored.set()
        return SimpleNamespace()


@pytest.mark.parametrize("how", ["timeout", "cancelled"])
def test_a_cold_answer_nobody_waits_for_is_still_stored(how):
    offload = Offload(timeout_s=0.05 if how == "timeout" else 30)
    service = _ColdService()

    async def main():
        task = asyncio.ensure_future(offload.solve(service, b"{}", None))
        if how == "timeout":
            with pytest.raises(SigpropError) as info:
                await task
            assert info.value.code == "solve_timeout"
        else:
            await asyncio.sleep(0.05)  # the solve is running in its thread
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    try:
        asyncio.run(main())
        assert not service.stored.is_set()
        service.release.set()
        assert service.stored.wait(5), "the solve did not run on to its store write"
    finally:
        service.release.set()
        offload.shutdown()
