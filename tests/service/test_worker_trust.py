"""A ``sigprop worker`` runs only sigprop's validation job: jobs planted straight into its Redis
queue that name any other function (``os.system``) or a foreign callback are refused, logged and
failed without running. A real worker process (``sigprop worker --burst``) on a private Redis."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis
from rq import Callback, Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from sigprop.worker.trust import ALLOWED_FUNCTIONS, RefusedJob, SigpropJob, refusal

from ..service_fixtures import _tail, service_env, start_redis

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "sigprop-validations"


@pytest.fixture
def redis_server(tmp_path):
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


def _run_burst_worker(url: str, log_path: Path) -> subprocess.CompletedProcess:
    env = service_env({"SIGPROP_REDIS_URL": url, "PYTHONPATH": str(ROOT), "SIGPROP_WORKER_MAINTENANCE_S": "1"})
    with open(log_path, "wb") as log:
        return subprocess.run(
            [sys.executable, "-m", "tests.fake_sigprop", "worker", "--burst"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=120,
        )


def test_planted_jobs_are_refused_by_a_real_worker(redis_server, tmp_path):
    marker = tmp_path / "pwned"
    marker_cb = tmp_path / "pwned-by-callback"
    r = redis.Redis.from_url(redis_server.url)
    q = Queue(QUEUE, connection=r, serializer=JSONSerializer)
    planted = q.enqueue("os.system", f"id > {marker}")
    # our own function with a foreign failure callback: the callback must not run either
    sneaky = q.enqueue(
        next(iter(ALLOWED_FUNCTIONS)),
        "no-such-validation",
        {},
        on_failure=Callback("os.system"),
        on_success=Callback("os.system"),
    )
    shell = q.enqueue("subprocess.check_call", ["sh", "-c", f"touch {marker_cb}"])
    log_path = tmp_path / "worker.log"
    proc = _run_burst_worker(redis_server.url, log_path)
    log = _tail(log_path, 20000)
    assert proc.returncode == 0, log
    assert not marker.exists() and not marker_cb.exists(), log
    for job in (planted, sneaky, shell):
        fetched = Job.fetch(job.id, connection=r, serializer=JSONSerializer)
        assert fetched.get_status() == JobStatus.FAILED, (job.id, fetched.get_status(), log)
        assert "RefusedJob" in (fetched.latest_result().exc_string or ""), log
        assert f"refused job {job.id}" in log, log
    assert q.count == 0
    r.close()


def test_refusal_names_what_was_asked_for(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    q = Queue("scratch", connection=r, serializer=JSONSerializer)
    bad = SigpropJob.fetch(q.enqueue("os.system", "true").id, connection=r, serializer=JSONSerializer)
    assert "os.system" in refusal(bad)
    with pytest.raises(RefusedJob):
        bad.func  # noqa: B018 - the property is the guard
    ours = SigpropJob.fetch(
        q.enqueue(next(iter(ALLOWED_FUNCTIONS)), "v", {}).id, connection=r, serializer=JSONSerializer
    )
    assert refusal(ours) is None and callable(ours.func)
    cb = SigpropJob.fetch(
        q.enqueue(next(iter(ALLOWED_FUNCTIONS)), "v", {}, on_failure=Callback("os.system")).id,
        connection=r,
        serializer=JSONSerializer,
    )
    assert "os.system" in refusal(cb) and cb.failure_callback is None
    r.close()
