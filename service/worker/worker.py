"""``sigprop worker``: an RQ worker for validation jobs, tuned so that a dead worker's job is
retried within seconds and its state always tells what happened.

Why the forking ``rq.Worker`` (not ``SimpleWorker``): each job runs in a child "work horse" while
the parent keeps heartbeating every ``SIGPROP_WORKER_HEARTBEAT_S`` seconds, enforces the job
timeout from outside, and can kill the horse (a cancel the job does not honour). SimpleWorker
runs the job in the process that should heartbeat, so its heartbeat TTL has to cover the whole
job timeout (an hour) before a lost job is noticed.

What this subclass changes in RQ 3.0:

* ``get_heartbeat_ttl``: RQ gives a running job ``min(job_monitoring_interval, time left) + 60``
  seconds; here it is ``job_monitoring_interval + HEARTBEAT_SLACK_S``. A job whose worker stopped
  heartbeating (killed, machine lost) expires from the StartedJobRegistry that much sooner.
* ``maintenance_interval`` (``SIGPROP_WORKER_MAINTENANCE_S``, RQ default 600 s) and an idle
  worker's blocking dequeue no longer than it (RQ blocks up to ``worker_ttl - 15`` = 405 s
  before it looks at maintenance again): any live worker's ``StartedJobRegistry.cleanup`` then
  retries an expired (abandoned) job that has retries left, or fails it.
* the work horse dies with its worker (Linux ``PR_SET_PDEATHSIG``): RQ puts the horse in its own
  process group, so a worker killed with SIGKILL (or its whole group) would otherwise leave an
  orphan horse training on while another worker retries the same job.
* failure hooks write the job's sigprop state: an attempt that raised, a horse that died, a job
  abandoned by a dead worker -> ``queued`` again ("attempt n failed: ...; retrying") or, once the
  retries are spent, ``failed`` with the reason; a stopped job -> ``cancelled``.
* a cancel the job does not acknowledge within ``SIGPROP_VALIDATION_CANCEL_GRACE_S`` is enforced
  by the worker itself through RQ's stop-job path (what ``rq.command.send_stop_job_command``
  triggers): the horse is killed and the job ends ``cancelled``.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import signal
import sys
import time

from rq import Worker
from rq.exceptions import AbandonedJobError
from rq.serializers import JSONSerializer

from .queue import QUEUE_NAME, RedisValidationStore, reason_from_traceback

log = logging.getLogger("sigprop")

HEARTBEAT_SLACK_S = 5
RESTART_DELAY_S = 1.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent (the worker) dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl: the horse may outlive a killed worker
        return
    if os.getppid() != parent_pid:  # the worker died before prctl took effect
        os._exit(1)


class SigpropWorker(Worker):
    """RQ's forking worker with fast recovery of abandoned jobs and sigprop's job-state hooks."""

    def __init__(self, *args, cancel_grace_s: float = 30.0, **kwargs):
        kwargs.setdefault("serializer", JSONSerializer)
        super().__init__(*args, **kwargs)
        self.cancel_grace_s = cancel_grace_s
        self.store = RedisValidationStore(self.connection)
        self._worker_pid = os.getpid()
        self.stop_requested = False  # SIGTERM/SIGINT: tells run_worker not to start again
        self.push_exc_handler(self._on_exception)

    def request_stop(self, signum, frame):
        self.stop_requested = True
        super().request_stop(signum, frame)

    def request_force_stop(self, signum, frame):
        self.stop_requested = True
        super().request_force_stop(signum, frame)

    # -- timing -----------------------------------------------------------------------------------
    def get_heartbeat_ttl(self, job, working_time: float = 0.0) -> int:  # noqa: ARG002 - RQ's signature
        return int(self.job_monitoring_interval + HEARTBEAT_SLACK_S)

    @property
    def dequeue_timeout(self) -> int:
        # Wake up from the blocking dequeue often enough to run maintenance on time.
        return max(1, min(self.worker_ttl - 15, int(self.maintenance_interval)))

    # -- the work horse -----------------------------------------------------------------------------
    def execute_job(self, job, queue):
        self._worker_pid = os.getpid()
        return super().execute_job(job, queue)

    def setup_work_horse_signals(self):
        super().setup_work_horse_signals()
        _die_with_parent(self._worker_pid)

    # -- failures -----------------------------------------------------------------------------------
    def handle_job_failure(self, job, queue, started_job_registry=None, exc_string="", execution=None):
        """Every failed attempt that a worker sees (an exception in the horse, a horse that died,
        a stopped job) comes through here: let RQ retry or fail it, then record the outcome."""
        stopped = self._stopped_job_id == job.id
        cancel = self._cancel_time(job.id)
        if cancel is not None:
            job.retries_left = 0  # a cancelled job is never retried
        will_retry = bool(job.should_retry) and not stopped
        super().handle_job_failure(job, queue, started_job_registry=started_job_registry, exc_string=exc_string,
                                   execution=execution)
        try:
            if stopped or cancel is not None:
                grace = f"it did not stop within {self.cancel_grace_s:g} s of the request, so its worker killed it"
                self.store.mark_cancelled(job.id, f"cancelled on request: {grace}" if stopped else
                                          "cancelled on request while running")
            else:
                self.store.record_failure(job.id, reason_from_traceback(exc_string), will_retry)
        except Exception:  # noqa: BLE001 - the RQ side is already recorded; never crash the worker
            log.exception("could not record the failure of validation %s", job.id)

    def _on_exception(self, job, exc_type, exc_value, tb):
        """Exception handler; RQ calls it for a job abandoned by a dead worker (from
        StartedJobRegistry.cleanup, before it decides about the retry) and, in the horse, for an
        exception a job raised (recorded by handle_job_failure instead)."""
        if exc_type is not AbandonedJobError and not isinstance(exc_value, AbandonedJobError):
            return True
        try:
            if self._cancel_time(job.id) is not None:
                job.retries_left = 0
                self.store.mark_cancelled(job.id, "cancelled on request; its worker had died")
            else:
                will_retry = bool(job.retries_left and job.retries_left > 0)
                self.store.record_failure(
                    job.id, "abandoned: the worker running it stopped heartbeating (killed or lost)", will_retry)
        except Exception:  # noqa: BLE001
            log.exception("could not record the abandonment of validation %s", job.id)
        return True

    # -- cancel fallback ------------------------------------------------------------------------------
    def _cancel_time(self, vid: str) -> float | None:
        try:
            return self.store.cancel_requested(vid)
        except Exception:  # noqa: BLE001 - Redis hiccup: treat as not cancelled
            return None

    def maintain_heartbeats(self, job, *args, **kwargs):
        super().maintain_heartbeats(job, *args, **kwargs)
        requested = self._cancel_time(job.id)
        if requested is not None and self._stopped_job_id != job.id and time.time() - requested > self.cancel_grace_s:
            log.warning("validation %s ignored its cancel for %.0f s: stopping its work horse", job.id,
                        time.time() - requested)
            self._stopped_job_id = job.id  # what RQ's stop-job command does (send_stop_job_command)
            self.kill_horse()


def _wait_for_redis(connection, max_wait_s: float = 5.0) -> None:
    """Block until Redis answers. A worker started during an outage (or before Redis in a compose
    stack) waits for it instead of exiting; once running, RQ's own loop rides out outages."""
    import redis

    wait = 0.2
    while True:
        try:
            connection.ping()
            return
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            log.warning("Redis is not reachable (%s); retrying in %.1f s", exc, wait)
            time.sleep(wait)
            wait = min(wait * 2, max_wait_s)


def run_worker(settings, queues: list[str] | None = None, burst: bool = False, name: str | None = None) -> bool:
    """Run a worker until stopped (or, with ``burst``, until the queues are empty).

    RQ's worker loop quits on an error it does not expect, and a Redis outage while a job runs is
    one (its horse cannot store the outcome, then the parent cannot read the job's status). So a
    worker that leaves its loop without being asked to stop waits for Redis and starts again as a
    new RQ worker; the interrupted job's heartbeat lapses and maintenance retries it
    (``SigpropWorker._on_exception``), so nothing accepted is lost."""
    import redis

    try:  # import torch once here, so each forked horse starts with it loaded (CUDA stays uninitialized)
        import torch  # noqa: F401
    except ImportError:
        pass
    connection = redis.Redis.from_url(settings.redis_url)
    for generation in itertools.count():
        _wait_for_redis(connection)
        worker = SigpropWorker(queues or [settings.validation_queue or QUEUE_NAME], connection=connection,
                               name=name if name is None or generation == 0 else f"{name}-{generation}",
                               job_monitoring_interval=settings.worker_heartbeat_s,
                               maintenance_interval=settings.worker_maintenance_s,
                               cancel_grace_s=settings.validation_cancel_grace_s)
        try:
            worked = worker.work(burst=burst, logging_level=settings.log_level)
            if burst or worker.stop_requested:
                return worked
            log.warning("the worker left its loop on an error; starting again once Redis answers")
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            if worker.stop_requested:
                return False
            log.warning("the worker lost Redis (%s); starting again once Redis answers", exc)
        time.sleep(RESTART_DELAY_S)
    return False  # pragma: no cover - the loop only returns
