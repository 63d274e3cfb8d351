"""Validations on RQ (``SIGPROP_REDIS_URL`` set): the queue the API enqueues to, the function a work
horse runs, and the job callbacks that write each attempt's outcome into the validation store.

A job's id is its validation id; its state for the API is the store's record
(``storage.RedisValidationStore``), which the job itself moves to ``running`` and ``finished``
(``job.execute``). RQ owns everything else about the job: the retries (``Retry``), the timeout,
the recovery of a job whose worker died, stopping a job (``rq.command.send_stop_job_command``). Its
outcomes reach the record through the callbacks every job is enqueued with, so they hold whichever
RQ worker runs the job:

* ``on_failure`` (an attempt raised in the work horse, or RQ's maintenance found the job abandoned
  by a dead worker): ``queued`` again ("attempt n failed: ...; retrying") while RQ will retry it,
  ``failed`` with the reason once the retries are spent, ``cancelled`` when a cancel was pending
  (and then no retry). A timeout or a request the trainer rejects (``SigpropError``) is never
  retried: it would only happen again.
* ``on_stopped`` (the job was stopped through RQ): ``cancelled``, with the reason its stopper left
  in ``job.meta``.

A work horse that died without raising (killed by a signal) is seen only by its worker, which
records it (``worker.SigpropWorker``); ``RedisQueue.outcome`` lets the API reflect an end RQ
recorded that no callback reached, from RQ's own job status.
"""

from __future__ import annotations

import logging
import time
import traceback

from rq import Callback, Queue, Retry, get_current_job
from rq.exceptions import AbandonedJobError, InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException

from ..errors import SigpropError
from ..storage import RedisValidationStore
from ..storage.records import MAX_ERROR_CHARS
from .job import execute

log = logging.getLogger("sigprop")

QUEUE_NAME = "sigprop-validations"
SERIALIZER = JSONSerializer
# job.meta key: why the job was stopped, written by whoever stops it, read by on_stopped
STOP_REASON = "sigprop_stop_reason"
_ENDED = (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED)


def reason_from_traceback(exc_string: str) -> str:
    """The last line of a formatted traceback (``RuntimeError: boom``), or the whole text."""
    lines = [ln.strip() for ln in (exc_string or "").strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "unknown error"
    return last.removeprefix("sigprop.errors.SigpropError: ")[:MAX_ERROR_CHARS]  # "invalid_request: ..."


def cancel_time(store: RedisValidationStore, vid: str) -> float | None:
    """When a cancel of ``vid`` was requested, or None (also when Redis does not answer)."""
    try:
        return store.cancel_requested(vid)
    except Exception:  # noqa: BLE001 - a Redis hiccup: treat as not cancelled
        return None


# -- what RQ runs ----------------------------------------------------------------------------------


def rq_job(vid: str, payload: dict) -> None:
    """The function a work horse runs (enqueued by :class:`RedisQueue`)."""
    job = get_current_job()
    execute(RedisValidationStore(job.connection), vid, payload)


def on_failure(job: Job, connection, exc_type, exc_value, tb) -> None:
    """RQ's failure callback: an attempt raised in the work horse, or RQ's maintenance found the job
    abandoned (``AbandonedJobError``). RQ decides about the retry right after this returns, from
    ``job.retries_left``, so this is where a job is kept from retrying."""
    store = RedisValidationStore(connection)
    abandoned = exc_type is AbandonedJobError or isinstance(exc_value, AbandonedJobError)
    try:
        if cancel_time(store, job.id) is not None:
            job.retries_left = 0  # a cancelled job is never retried
            store.mark_cancelled(
                job.id,
                "cancelled on request; its worker had died" if abandoned else "cancelled on request while running",
            )
            return
        if abandoned:
            reason = "abandoned: the worker running it stopped heartbeating (killed or lost)"
        else:
            if exc_type is not None and issubclass(exc_type, (JobTimeoutException, SigpropError)):
                # A job that ran out of time would only run out of time again, and a rejected request
                # (a missing .npz, a graph the trainer cannot build) is rejected again: no retry.
                job.retries_left = 0
            reason = reason_from_traceback("".join(traceback.format_exception(exc_type, exc_value, tb)))
        store.record_failure(job.id, reason, will_retry=job.should_retry)
    except Exception:  # noqa: BLE001 - RQ records the failure anyway; a raising callback would replace it
        log.exception("could not record the failure of validation %s", job.id)


def on_stopped(job: Job, connection) -> None:
    """RQ's stopped callback: the job's work horse was killed on a stop request (never retried)."""
    reason = job.meta.get(STOP_REASON) or "cancelled: stopped through RQ, its work horse was killed"
    try:
        RedisValidationStore(connection).mark_cancelled(job.id, reason)
    except Exception:  # noqa: BLE001
        log.exception("could not record the stop of validation %s", job.id)


# -- the queue -------------------------------------------------------------------------------------


class RedisQueue:
    """Validation jobs on the RQ queue ``name``, run by ``sigprop worker`` processes."""

    def __init__(self, connection, name: str = QUEUE_NAME, timeout_s: int = 3600, retries: int = 2):
        self.r = connection
        self.queue = Queue(name, connection=connection, serializer=SERIALIZER)
        self.timeout_s, self.retries = timeout_s, retries

    def submit(self, vid: str, payload: dict) -> None:
        self.queue.enqueue(
            rq_job,
            vid,
            payload,
            job_id=vid,
            job_timeout=self.timeout_s,
            retry=Retry(max=self.retries) if self.retries > 0 else None,
            result_ttl=86_400,
            failure_ttl=7 * 86_400,
            description=f"sigprop validation {vid}",
            on_failure=Callback(on_failure),
            on_stopped=Callback(on_stopped),
        )

    def cancel(self, vid: str) -> None:
        """Take a queued job off the queue (the record is already ``cancelled``; a worker that
        dequeued it meanwhile sees that and does not run it)."""
        try:
            Job.fetch(vid, connection=self.r, serializer=SERIALIZER).cancel()
        except (NoSuchJobError, InvalidJobOperation):
            pass

    def outcome(self, vid: str, settle_s: float = 5.0) -> tuple[str, str] | None:
        """For a record still queued/running: how RQ says the job ended (failed, stopped or
        canceled) more than ``settle_s`` ago, so the callbacks and the worker had their chance, as
        (status, reason); else None."""
        job = Job(vid, connection=self.r, serializer=SERIALIZER)
        try:
            if job.get_status() not in _ENDED:  # one field: the poll of a running job stays cheap
                return None
            job.refresh()
        except (NoSuchJobError, InvalidJobOperation):
            return None
        if job.ended_at is not None and time.time() - job.ended_at.timestamp() < settle_s:
            return None
        reason = "the worker reported the job failed"
        try:
            result = job.latest_result()
            if result is not None and result.exc_string:
                reason = reason_from_traceback(result.exc_string)
        except Exception:  # noqa: BLE001 - best effort: the status alone is enough
            pass
        return job.get_status(refresh=False).value, reason

    def close(self) -> None:
        pass
