"""A worker that rides out Redis trouble, and a killed worker's job re-run in bounded time
(issue 35), with real ``sigprop worker`` processes (the sleep-only trainer) on private Redis:

* a Redis full under ``noeviction`` (OOM on every write) and a Redis stall (``DEBUG SLEEP``): the
  worker waits, logs and retries, never exits, and runs the job once Redis takes writes again;
* a worker SIGKILLed mid-job, with the default heartbeat and maintenance settings: another worker,
  idle or busy, has the job ``queued`` again and running within the bound docs/service.md states.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import redis

from ..service_fixtures import running_service
from .test_redis_durability import private_redis
from .test_validations_api import AUTH, COMMON_ENV, session_pids, submit, validation, wait_for
from .test_validations_api import workers as workers  # noqa: F401 - the fixture

# the defaults (heartbeat 2 s, maintenance 2 s): heartbeat + 5 + 2 x maintenance
RERUN_BOUND_S = 2 + 5 + 2 * 2
ENV = {k: v for k, v in COMMON_ENV.items() if not k.startswith("SIGPROP_WORKER_")}


@pytest.fixture
def env(tmp_path):
    with private_redis(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction") as server:
        yield {**ENV, "SIGPROP_REDIS_URL": server.url, "SIGPROP_DATA_DIR": str(tmp_path / "data")}


@pytest.fixture
def api(env, tmp_path):
    with running_service(tmp_path / "svc", env) as svc:
        with httpx.Client(base_url=svc.base_url, timeout=30.0, headers=AUTH) as c:
            yield c


def _fill(r: redis.Redis) -> list[str]:
    keys = []
    while True:
        try:
            r.set(f"filler:{len(keys)}", b"x" * 65536)
        except redis.exceptions.OutOfMemoryError:
            return keys
        keys.append(f"filler:{len(keys)}")
        assert len(keys) < 10_000


def test_the_worker_survives_redis_out_of_memory_and_a_stall(env, api, workers):  # noqa: F811
    r = redis.Redis.from_url(env["SIGPROP_REDIS_URL"], socket_timeout=30)
    vid = submit(api, validation(steps=30))  # accepted before Redis filled up
    fillers = _fill(r)
    w = workers()
    deadline = time.monotonic() + 60  # the worker (torch imported first) meets a Redis that refuses writes
    # (or, its one-byte probe slipping through, one at its memory limit: a job taken then was lost
    # for a minute, until the abandoned-job check, which made this test take 72 s and sometimes fail)
    while "OutOfMemoryError" not in w.log() and "at its memory limit" not in w.log():
        assert w.proc.poll() is None, f"the worker exited on OOM:\n{w.log()}"
        assert time.monotonic() < deadline, w.log()
        time.sleep(0.2)
    time.sleep(3)  # it keeps waiting, and retrying
    assert w.proc.poll() is None, f"the worker exited on OOM:\n{w.log()}"
    r.delete(*fillers)  # memory freed: the worker starts again and runs the job
    wait_for(api, vid, lambda j: j["status"] == "running" and j["progress"].get("step", 0) >= 2, 60, workers)
    r.execute_command("DEBUG", "SLEEP", 6)  # a stall while the job runs
    job = wait_for(api, vid, lambda j: j["status"] in ("finished", "failed", "cancelled"), 60, workers)
    assert job["status"] == "finished", job
    assert w.proc.poll() is None, f"the worker exited after a stall:\n{w.log()}"
    vid2 = submit(api, validation(steps=3))  # and it takes the next job
    assert wait_for(api, vid2, lambda j: j["status"] in ("finished", "failed"), 30, workers)["status"] == "finished"
    r.close()


def test_a_killed_workers_job_runs_again_within_the_stated_bound(env, api, workers):  # noqa: F811
    first = workers()
    vid = submit(api, validation(steps=400))
    wait_for(api, vid, lambda j: j["status"] == "running" and j["progress"].get("step", 0) >= 3, 30, workers)
    workers()  # idle, waiting for work
    time.sleep(1.0)
    os.killpg(first.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    first.proc.wait(timeout=10)
    while session_pids(first.proc.pid):  # the horse dies with its worker
        assert time.monotonic() - killed < 5
        time.sleep(0.05)
    job = wait_for(api, vid, lambda j: j["attempts"] >= 2 and j["status"] == "running", RERUN_BOUND_S + 30, workers)
    rerun_s = time.monotonic() - killed
    print(f"a killed worker's job ran again after {rerun_s:.1f} s (stated bound {RERUN_BOUND_S} s)")
    assert job["attempts"] == 2, job
    assert rerun_s <= RERUN_BOUND_S, f"re-run took {rerun_s:.1f} s, the docs say at most {RERUN_BOUND_S} s"
