"""``sigprop worker``: an RQ worker for validation jobs, tuned so that a dead worker's job is
retried within seconds and its state always tells what happened.

Why the forking ``rq.Worker`` (not ``SimpleWorker``): each job runs in a child "work horse" while
the parent keeps heartbeating every ``SIGPROP_WORKER_HEARTBEAT_S`` seconds, enforces the job
timeout from outside, and can kill the horse (a cancel the job does not honour). SimpleWorker
runs the job in the process that should heartbeat, so its heartbeat TTL has to cover the whole
job timeout (an hour) before a lost job is noticed.

What this subclass changes in RQ 3.0 (the outcomes of attempts are recorded by the callbacks each
job carries, see ``queue.py``):

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
* a horse that died without raising (a signal, the out-of-memory killer) is recorded through RQ's
  ``work_horse_killed_handler``: ``queued`` again while RQ retries it, else ``failed``.
* a cancel the job does not acknowledge within ``SIGPROP_VALIDATION_CANCEL_GRACE_S`` is enforced
  by the worker itself with ``rq.command.send_stop_job_command``, the reason noted in
  ``job.meta``: RQ kills the horse and the job's ``on_stopped`` callback ends it ``cancelled``.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import signal
import socket
import sys
import time

import redis
from rq import Worker
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation, NoSuchJobError

from ..storage import RedisValidationStore
from .queue import QUEUE_NAME, SERIALIZER, STOP_REASON, cancel_time
from .trust import SigpropJob, refusal

log = logging.getLogger("sigprop")

HEARTBEAT_SLACK_S = 5
RESTART_DELAY_S = 1.0  # the first wait before a worker that lost Redis starts again
RESTART_DELAY_MAX_S = 30.0  # the longest: the wait doubles while Redis keeps failing
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
    """RQ's forking worker with fast recovery of abandoned jobs and sigprop's cancel grace."""

    def __init__(self, *args, cancel_grace_s: float = 30.0, **kwargs):
        kwargs.setdefault("serializer", SERIALIZER)
        kwargs.setdefault("work_horse_killed_handler", self._horse_killed)
        kwargs.setdefault("job_class", SigpropJob)
        super().__init__(*args, **kwargs)
        self.cancel_grace_s = cancel_grace_s
        self.store = RedisValidationStore(self.connection)
        self._worker_pid = os.getpid()
        self.stop_requested = False  # SIGTERM/SIGINT: tells run_worker not to start again

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
        reason = refusal(job)
        if reason is not None:
            return self._refuse(job, queue, reason)
        return super().execute_job(job, queue)

    def _refuse(self, job, queue, reason: str) -> None:
        """Fail a job that is not sigprop's (``trust.refusal``) without forking a horse or running
        any of it: no retry, no callback; the job ends ``failed`` with the reason."""
        log.error("refused job %s from queue %s: %s", job.id, queue.name, reason)
        job.retries_left = 0
        for field in ("_success_callback_name", "_failure_callback_name", "_stopped_callback_name"):
            setattr(job, field, None)
        execution = self.prepare_execution(job)
        self.handle_job_failure(job, queue, exc_string=f"RefusedJob: {reason}", execution=execution)

    def setup_work_horse_signals(self):
        super().setup_work_horse_signals()
        _die_with_parent(self._worker_pid)

    def _horse_killed(self, job, retpid, ret_val, rusage) -> None:  # noqa: ARG002 - RQ's signature
        """RQ's work_horse_killed_handler: the horse ended without raising (a signal, the OOM
        killer). Called before RQ retries or fails the job, so a cancelled job is kept from retrying."""
        try:
            if cancel_time(self.store, job.id) is not None:
                job.retries_left = 0
                self.store.mark_cancelled(job.id, "cancelled on request while running")
                return
            killed_by = f" (signal {os.WTERMSIG(ret_val)})" if ret_val and os.WIFSIGNALED(ret_val) else ""
            reason = f"Work-horse terminated unexpectedly; waitpid returned {ret_val}{killed_by};"
            self.store.record_failure(job.id, reason, will_retry=job.should_retry)
        except Exception:  # noqa: BLE001 - the RQ side is recorded anyway; never crash the worker
            log.exception("could not record the failure of validation %s", job.id)

    # -- cancel grace, and recovery while busy --------------------------------------------------------
    def maintain_heartbeats(self, job, *args, **kwargs):
        super().maintain_heartbeats(job, *args, **kwargs)
        self._enforce_cancel(job)
        self._recover_while_busy()

    def _recover_while_busy(self) -> None:
        """RQ runs maintenance only between jobs: with every other worker busy, a dead worker's
        job would wait for one to finish before it is even marked ``queued`` again. A busy worker
        looks too, on its heartbeat, so the re-run bound holds whoever is idle."""
        if not self.should_run_maintenance_tasks:
            return
        try:
            self.clean_registries()
        except redis.RedisError as exc:  # asked again on the next heartbeat
            log.warning("registry maintenance failed (%s); trying again", exc)

    def _enforce_cancel(self, job) -> None:
        """Stop the job through RQ once its cancel is older than the grace period."""
        requested = cancel_time(self.store, job.id)
        if requested is None or STOP_REASON in job.meta or time.time() - requested <= self.cancel_grace_s:
            return
        log.warning(
            "validation %s ignored its cancel for %.0f s: stopping its work horse", job.id, time.time() - requested
        )
        job.meta[STOP_REASON] = (
            f"cancelled on request: it did not stop within {self.cancel_grace_s:g} s of the "
            "request, so its worker killed it"
        )
        try:
            job.save_meta()
            send_stop_job_command(self.connection, job.id, serializer=self.serializer)
        except (redis.RedisError, NoSuchJobError, InvalidJobOperation) as exc:
            log.warning("validation %s: the stop request failed (%s); trying again", job.id, exc)
            job.meta.pop(STOP_REASON, None)


_PROBE_KEY = "sigprop:worker-probe"


def _wait_for_redis(connection, max_wait_s: float = 5.0) -> None:
    """Block until Redis answers, takes a write and has memory to spare. A worker started during an
    outage (or before Redis in a compose stack) waits for it instead of exiting; one facing a Redis
    that refuses writes (OOM under noeviction, READONLY) waits too, before it dequeues anything: RQ
    pops a job off the queue before it writes that it started it, and a refused write then loses
    the job (until the abandoned-job check, a minute later). A write alone is not enough under
    noeviction: a Redis at its maxmemory frees a little now and then (an expiring key), a probe
    slips through, and RQ's next writes fail with the job in hand; so the worker also waits until
    INFO's used_memory is a margin below maxmemory (``_memory_headroom``)."""
    wait = 0.2
    while True:
        try:
            connection.set(_PROBE_KEY, "1", px=10_000)
            short = _memory_headroom(connection)
            if short is None:
                return
            log.warning("Redis is at its memory limit (%s); retrying in %.1f s", short, wait)
        except (redis.RedisError, OSError) as exc:
            log.warning("Redis does not take writes (%s: %s); retrying in %.1f s", type(exc).__name__, exc, wait)
        time.sleep(wait)
        wait = min(wait * 2, max_wait_s)


def _memory_headroom(connection) -> str | None:
    """None when Redis has no maxmemory or is a margin (a tenth of it, at most 1 MiB) below it; else
    what INFO says. A Redis whose ACL refuses INFO is taken at its write probe's word."""
    try:
        info = connection.info("memory")
    except redis.ResponseError:
        return None
    limit = int(info.get("maxmemory") or 0)
    used = int(info.get("used_memory") or 0)
    if limit <= 0 or used < limit - min(1 << 20, limit // 10):
        return None
    return f"used_memory {used} of maxmemory {limit}"


def check_worker(settings, timeout_s: float = 3.0) -> tuple[bool, str]:
    """``sigprop worker --check`` (the worker image's HEALTHCHECK): Redis answers with these
    settings (credentials and TLS included) and a worker of this host is registered with RQ, as
    (healthy, what was found). A worker's registration expires with it, so a hung or dead worker
    reads as unhealthy."""
    host = socket.gethostname()
    try:
        connection = redis.Redis.from_url(
            settings.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        connection.ping()
        keys = connection.smembers("rq:workers")
        hosts = [connection.hget(key, "hostname") for key in keys]
    except (redis.RedisError, OSError) as exc:
        return False, f"Redis does not answer ({type(exc).__name__}: {exc})"
    mine = sum(1 for h in hosts if h is not None and h.decode(errors="replace") == host)
    if not mine:
        return False, f"Redis answers, but no worker of host {host} is registered ({len(hosts)} worker(s) in all)"
    return True, f"Redis answers and {mine} worker(s) of host {host} are registered"


def run_worker(settings, queues: list[str] | None = None, burst: bool = False, name: str | None = None) -> bool:
    """Run a worker until stopped (or, with ``burst``, until the queues are empty).

    RQ's worker loop quits on an error it does not expect, and a Redis outage while a job runs is
    one (its horse cannot store the outcome, then the parent cannot read the job's status). So a
    worker that leaves its loop without being asked to stop waits for Redis and starts again as a
    new RQ worker; the interrupted job's heartbeat lapses and maintenance retries it
    (the job's ``on_failure`` callback), so nothing accepted is lost."""
    try:  # import torch once here, so each forked horse starts with it loaded (CUDA stays uninitialized)
        import torch  # noqa: F401
    except ImportError:
        pass
    connection = redis.Redis.from_url(settings.redis_url)
    delay = RESTART_DELAY_S
    for generation in itertools.count():
        _wait_for_redis(connection)
        started = time.monotonic()
        worker = None
        try:
            worker = SigpropWorker(
                queues or [settings.validation_queue or QUEUE_NAME],
                connection=connection,
                name=name if name is None or generation == 0 else f"{name}-{generation}",
                job_monitoring_interval=settings.worker_heartbeat_s,
                maintenance_interval=settings.worker_maintenance_s,
                cancel_grace_s=settings.validation_cancel_grace_s,
            )
            worked = worker.work(burst=burst, logging_level=settings.log_level)
            if burst or worker.stop_requested:
                return worked
            log.warning("the worker left its loop on an error; starting again in %.0f s", delay)
        except (redis.RedisError, OSError) as exc:
            # a Redis that refuses writes (OOM under noeviction, READONLY, MISCONF) as well as one
            # that is gone or stalled: the worker waits and starts again, it never exits (issue 35)
            if worker is not None and worker.stop_requested:
                return False
            log.warning("the worker lost Redis (%s: %s); starting again in %.0f s", type(exc).__name__, exc, delay)
        if time.monotonic() - started > RESTART_DELAY_MAX_S:
            delay = RESTART_DELAY_S  # it ran a good while: a new failure starts the backoff over
        time.sleep(delay)
        if worker is not None and worker.stop_requested:  # SIGTERM while it waited
            return False
        delay = min(delay * 2, RESTART_DELAY_MAX_S)
    return False  # pragma: no cover - the loop only returns
