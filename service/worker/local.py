"""Validations without Redis: a thread pool inside the API process runs the jobs, with their state
in the embedded SQLite store. One attempt each (no retries); a job the process could not finish
ends ``failed`` with the reason, and one left behind by a process that died is failed by the next
start (``SqliteValidationStore.fail_orphans``)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import SigpropError
from ..storage import SqliteValidationStore
from .job import Interrupted, execute

log = logging.getLogger("sigprop")


class LocalRunner:
    """No Redis: jobs run in a thread pool inside the API process, one attempt each (no retries;
    a job the process could not finish ends ``failed`` with the reason)."""

    def __init__(self, store: SqliteValidationStore, workers: int = 1, timeout_s: float = 3600.0, policy=None):
        self.store, self.timeout_s, self.policy = store, timeout_s, policy
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sigprop-validation")
        self.futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def submit(self, vid: str, payload: dict) -> None:
        with self._lock:
            self.futures[vid] = self.pool.submit(self._run, vid, payload)

    def _run(self, vid: str, payload: dict) -> None:
        try:
            execute(
                self.store,
                vid,
                payload,
                deadline=time.monotonic() + self.timeout_s,
                stopping=self._stopping.is_set,
                policy=self.policy,
            )
        except BaseException as exc:  # noqa: BLE001 - recorded on the job, never lost in a thread
            if isinstance(exc, SigpropError):
                reason = f"{exc.code}: {exc.message}"
            elif isinstance(exc, Interrupted):
                reason = str(exc)
            else:
                reason = f"{type(exc).__name__}: {exc}"
                log.exception("validation %s failed", vid)
            self.store.record_failure(vid, reason, will_retry=False)
        finally:
            with self._lock:
                self.futures.pop(vid, None)

    def outcome(self, vid: str) -> None:
        """Always None: this runner records every outcome itself (see ``RedisQueue.outcome``)."""
        return None

    def cancel(self, vid: str) -> None:
        with self._lock:
            fut = self.futures.get(vid)
        if fut is not None:
            fut.cancel()  # not started yet: it never will; running: the job polls its cancel flag

    def close(self) -> None:
        """Stop: running jobs see cancelled() and end ``failed`` ("interrupted"), queued ones too."""
        self._stopping.set()
        with self._lock:
            pending = list(self.futures)
        for vid in pending:
            fut = self.futures.get(vid)
            if fut is not None and fut.cancel():
                self.store.record_failure(
                    vid, "interrupted: the service shut down before it started; submit it again", will_retry=False
                )
        self.pool.shutdown(wait=True, cancel_futures=True)
