"""End-to-end tests of validations (contract section 4): the real API (`sigprop serve` on loopback),
a private `redis-server`, and real `sigprop worker` processes (RQ work horses forked per job).

The training function is ``tests.fake_training:run`` (the processes run ``python -m
tests.fake_sigprop``, sigprop's command line with that trainer patched in): it sleeps instead of
training, so these tests exercise the plumbing (queue, retries, recovery of a killed worker, cancel,
state) and not the trainer. Workers run with a 1 s heartbeat and maintenance interval, so a job
abandoned by a killed worker is retried in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sigprop.schemas.validation import ValidationJob

from ..fake_training import write_fake_datasets
from ..service_fixtures import (
    _stop_group,
    _tail,
    assert_error,
    running_service,
    service_env,
    start_redis,
    start_service,
)

ROOT = Path(__file__).resolve().parents[2]
KEY = "val-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAKE_CLI = "tests.fake_sigprop"  # `sigprop` with the sleep-only trainer
COMMON_ENV = {
    "SIGPROP_API_KEYS": KEY,
    "SIGPROP_WORKER_HEARTBEAT_S": "1",
    "SIGPROP_WORKER_MAINTENANCE_S": "1",
    "SIGPROP_VALIDATION_CANCEL_GRACE_S": "2",
    "PYTHONPATH": str(ROOT),  # workers (and the local runner) import tests.fake_training
    # crash.npz, stubborn.npz, rejected.npz: .npz names resolve only inside this folder
    "SIGPROP_DATASETS_DIR": write_fake_datasets(tempfile.mkdtemp(prefix="sigprop-fake-datasets-")),
}


def solve_request(depth: int = 3, eta: float = 0.5) -> dict:
    return {
        "graph": {"template": "mlp", "depth": depth, "width": 8},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": eta},
    }


def validation(steps: int = 5, dataset: str = "synthetic", **extra) -> dict:
    return {"solve": solve_request(), "dataset": dataset, "steps": steps, "batch_size": 32, **extra}


# -- processes ----------------------------------------------------------------------------------


@dataclass
class WorkerProc:
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return _tail(self.log_path)

    def stop(self) -> None:
        _stop_group(self.proc)


def session_pids(sid: int) -> list[int]:
    """Processes whose session id is ``sid`` (a worker started in its own session, and its horses)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry))
    return out


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("val-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def env(redis_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("val-data")
    return {**COMMON_ENV, "SIGPROP_REDIS_URL": redis_server.url, "SIGPROP_DATA_DIR": str(tmp)}


@pytest.fixture(scope="module")
def service(env, tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("val-svc"), env) as svc:
        yield svc


@pytest.fixture
def api(service):
    with httpx.Client(base_url=service.base_url, timeout=30.0, headers=AUTH) as c:
        yield c


@pytest.fixture
def workers(env, tmp_path):
    """start(*args) -> a `sigprop worker` in its own session; all stopped after the test."""
    started: list[WorkerProc] = []

    def start(*args: str) -> WorkerProc:
        log_path = tmp_path / f"worker-{len(started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", FAKE_CLI, "worker", *args],
                cwd=ROOT,
                env=service_env(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        w = WorkerProc(proc, log_path)
        started.append(w)
        return w

    start.started = started
    yield start
    for w in started:
        w.stop()


def submit(api: httpx.Client, body: dict) -> str:
    r = api.post("/v1/validations", json=body)
    assert r.status_code == 202, r.text
    out = r.json()
    assert set(out) == {"id", "status"} and out["status"] == "queued", out
    assert r.headers["location"] == f"/v1/validations/{out['id']}"
    return out["id"]


def wait_for(api: httpx.Client, vid: str, done, timeout_s: float, workers=None) -> dict:
    """Poll GET /v1/validations/{vid} until ``done(job)``; every answer must be a ValidationJob."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = api.get(f"/v1/validations/{vid}")
        assert r.status_code == 200, r.text
        job = r.json()
        ValidationJob.model_validate(job)
        if done(job):
            return job
        if time.monotonic() > deadline:
            logs = "\n".join(w.log() for w in (workers.started if workers else []))
            raise AssertionError(f"validation {vid} did not get there in {timeout_s} s: {job}\n{logs}")
        time.sleep(0.1)


def status_is(*statuses):
    return lambda job: job["status"] in statuses


# -- the Redis + RQ mode ------------------------------------------------------------------------


def test_bad_requests_get_contract_errors(service, api):
    before = api.get("/v1/validations").json()["total"]
    with httpx.Client(base_url=service.base_url, timeout=30.0) as anon:
        assert_error(anon.post("/v1/validations", json=validation()), 401, "unauthorized")
        assert_error(
            anon.post("/v1/validations", json=validation(), headers={"Authorization": "Bearer nope"}), 403, "forbidden"
        )
        assert_error(anon.delete("/v1/validations/" + "0" * 32), 401, "unauthorized")
        # stored submissions are read with a key (unless SIGPROP_ANONYMOUS_STORED_READS)
        assert_error(anon.get("/v1/validations/" + "0" * 32), 401, "unauthorized")
        assert_error(anon.get("/v1/validations"), 401, "unauthorized")

    key = api.post("/v1/solve", json=solve_request()).json()["key"]
    assert_error(api.post("/v1/validations", json={**validation(), "key": key}), 422, "invalid_request")  # both
    assert_error(api.post("/v1/validations", json={"dataset": "synthetic", "steps": 5}), 422, "invalid_request")
    assert_error(api.post("/v1/validations", json={"key": "f" * 64, "steps": 5}), 404, "not_found")
    assert_error(api.post("/v1/validations", json={"key": "not-a-key"}), 422, "invalid_request")
    assert_error(api.post("/v1/validations", json=validation(dataset="imagenet")), 422, "invalid_request")
    assert_error(api.post("/v1/validations", json=validation(steps=0)), 422, "invalid_request")
    assert_error(api.post("/v1/validations", json=validation(optimizer="lbfgs")), 422, "invalid_request")
    assert_error(api.post("/v1/validations", json=validation(baselines=["nope"])), 422, "invalid_request")
    assert_error(api.post("/v1/validations", json=validation(surprise=1)), 422, "invalid_request")
    json_type = {"Content-Type": "application/json"}
    assert_error(api.post("/v1/validations", content=b"{not json", headers=json_type), 422, "invalid_request")
    # a body that does not say it is JSON is refused before it is read (no cross-origin form posts)
    assert_error(api.post("/v1/validations", content=json.dumps(validation())), 415, "unsupported_media_type")
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert_error(
        api.post("/v1/validations", content=json.dumps(validation()), headers=form), 415, "unsupported_media_type"
    )
    assert_error(api.post("/v1/validations", json=[1, 2]), 422, "invalid_request")
    # the solve part is rejected with the code POST /v1/solve answers
    bad_graph = {
        **validation(),
        "solve": {
            **solve_request(),
            "graph": {
                "schema": "sigprop.graph/v1",
                "nodes": [{"id": "x", "op": "input", "shape": [4]}, {"id": "o", "op": "output", "inputs": ["missing"]}],
            },
        },
    }
    assert_error(
        api.post("/v1/validations", json=bad_graph),
        422,
        api.post("/v1/solve", json=bad_graph["solve"]).json()["error"]["code"],
    )
    unreachable = {**validation(), "solve": {**solve_request(depth=10, eta=0.9)}}
    assert_error(api.post("/v1/validations", json=unreachable), 422, "unreachable_target")
    assert_error(api.get("/v1/validations/" + "0" * 32), 404, "not_found")
    assert_error(api.delete("/v1/validations/" + "0" * 32), 404, "not_found")
    assert_error(api.get("/v1/validations", params={"limit": 0}), 422, "invalid_request")
    # nothing was queued by any of these
    assert api.get("/v1/validations").json()["total"] == before


def test_job_is_queued_then_runs_to_finished(api, workers, redis_server):
    solved = api.post("/v1/solve", json=solve_request()).json()
    vid = submit(api, validation(steps=5))
    job = api.get(f"/v1/validations/{vid}").json()
    assert job["status"] == "queued" and job["attempts"] == 0 and job["started"] is None, job
    assert job["key"] == solved["key"] and job["request"]["solve"]["graph"]["template"] == "mlp"

    workers()
    job = wait_for(api, vid, status_is("finished", "failed"), 30, workers)
    assert job["status"] == "finished", job
    assert job["attempts"] == 1 and job["error"] is None
    assert job["device"] in ("cpu", "cuda")
    assert job["created"] <= job["started"] <= job["ended"]
    assert job["progress"] == {"step": 5, "total": 5, "run": "solution"}
    res = job["results"]
    # the job got the solved answer (a Solution) and the expanded graph, and its device
    assert res["key"] == solved["key"] and res["activation"] == "leaky_relu"
    assert res["layers"] == len(solved["layers"]) and res["graph_nodes"] > 3
    assert res["device"] == job["device"]
    assert res["runs"]["solution"] == {"final_loss": 0.5, "nan": None}  # NaN stored as null: strict JSON

    # results persist: the record has no expiry
    import redis as redis_lib

    r = redis_lib.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        assert r.ttl(f"sigprop:val:{vid}") == -1
    finally:
        r.close()

    # a stored solution's key works too, and the job carries that solution
    # (synthetic: the solved MLP takes 8 features, which digits' 64 do not fit since submissions check it)
    vid2 = submit(api, {"key": solved["key"], "dataset": "synthetic", "steps": 3})
    job2 = wait_for(api, vid2, status_is("finished", "failed"), 30, workers)
    assert job2["status"] == "finished", job2
    assert job2["results"]["key"] == solved["key"] and job2["request"]["key"] == solved["key"]
    assert "solve" not in job2["request"]


def test_job_of_a_killed_worker_is_retried_by_another(api, workers):
    first = workers()
    vid = submit(api, validation(steps=40))
    wait_for(api, vid, lambda j: j["status"] == "running" and j["progress"].get("step", 0) >= 3, 30, workers)

    os.killpg(first.proc.pid, signal.SIGKILL)  # the worker and everything in its process group
    first.proc.wait(timeout=10)
    # The work horse sits in a process group of its own (RQ's choice): it must die with its worker
    # rather than train on as an orphan while another worker retries the job.
    deadline = time.monotonic() + 5
    while session_pids(first.proc.pid):
        assert time.monotonic() < deadline, f"left running: {session_pids(first.proc.pid)}"
        time.sleep(0.05)
    stale = api.get(f"/v1/validations/{vid}").json()
    assert stale["status"] in ("running", "queued") and stale["attempts"] == 1, stale

    workers()
    job = wait_for(api, vid, status_is("finished", "failed", "cancelled"), 45, workers)
    assert job["status"] == "finished", job
    assert job["attempts"] == 2, job
    assert job["progress"]["step"] == 40


def test_job_that_always_crashes_fails_after_its_retries(api, workers):
    workers()
    vid = submit(api, validation(steps=5, dataset="crash.npz"))
    seen = set()

    def done(job):
        seen.add(job["status"])
        return job["status"] in ("finished", "failed", "cancelled")

    job = wait_for(api, vid, done, 45, workers)
    assert job["status"] == "failed", job
    assert job["attempts"] == 3, job  # the first attempt and two retries
    assert "fake training crashed on purpose" in job["error"] and "3 attempt" in job["error"], job
    assert job["results"] is None and job["ended"] is not None
    assert "queued" in seen or "running" in seen

    # a request the trainer rejects (SigpropError) is not retried: it would be rejected again
    vid = submit(api, validation(steps=5, dataset="rejected.npz"))
    job = wait_for(api, vid, status_is("finished", "failed", "cancelled"), 30, workers)
    assert job["status"] == "failed" and job["attempts"] == 1, job
    assert "invalid_request" in job["error"] and "does not exist" in job["error"], job


def test_cancel_a_running_job(api, workers):
    w = workers()
    vid = submit(api, validation(steps=300))
    wait_for(api, vid, lambda j: j["status"] == "running" and j["progress"].get("step", 0) >= 2, 30, workers)
    r = api.delete(f"/v1/validations/{vid}")
    assert r.status_code in (200, 202), r.text
    assert r.json()["status"] in ("running", "cancelled")
    t0 = time.monotonic()
    job = wait_for(api, vid, status_is("cancelled", "finished", "failed"), 5, workers)
    assert job["status"] == "cancelled", job
    assert time.monotonic() - t0 < 5 and job["progress"]["step"] < 300 and job["ended"] is not None
    assert job["attempts"] == 1  # never retried

    # A job that ignores cancelled() is stopped by its worker after the grace period (2 s here).
    vid = submit(api, validation(steps=300, dataset="stubborn.npz"))
    wait_for(api, vid, lambda j: j["status"] == "running" and j["progress"].get("step", 0) >= 2, 30, workers)
    assert api.delete(f"/v1/validations/{vid}").status_code == 202
    job = wait_for(api, vid, status_is("cancelled", "finished", "failed"), 15, workers)
    assert job["status"] == "cancelled" and "killed" in job["error"], job
    assert job["attempts"] == 1 and job["progress"]["step"] < 300

    # the worker lives on and takes the next job
    assert w.proc.poll() is None
    vid = submit(api, validation(steps=2))
    assert wait_for(api, vid, status_is("finished", "failed"), 30, workers)["status"] == "finished"


def test_cancel_a_queued_job_it_never_runs(api, workers, redis_server):
    vid = submit(api, validation(steps=3))
    r = api.delete(f"/v1/validations/{vid}")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled"
    again = api.delete(f"/v1/validations/{vid}")  # idempotent
    assert again.status_code == 200 and again.json()["status"] == "cancelled"

    burst = workers("--burst")
    assert burst.proc.wait(timeout=60) == 0, burst.log()
    job = api.get(f"/v1/validations/{vid}").json()
    assert job["status"] == "cancelled" and job["attempts"] == 0 and job["started"] is None, job
    assert job["results"] is None


def test_list_is_newest_first_and_paginated(api):
    ids = [submit(api, validation(steps=1, seed=i)) for i in range(3)]
    try:
        page = api.get("/v1/validations", params={"limit": 3}).json()
        assert [it["id"] for it in page["items"]] == ids[::-1]
        assert page["total"] >= 3 and page["offset"] == 0 and page["limit"] == 3
        assert all("request" not in it and "results" not in it for it in page["items"])
        assert {it["status"] for it in page["items"]} == {"queued"}
        second = api.get("/v1/validations", params={"offset": 1, "limit": 1}).json()
        assert [it["id"] for it in second["items"]] == [ids[1]]
        created = [it["created"] for it in api.get("/v1/validations", params={"limit": 500}).json()["items"]]
        assert created == sorted(created, reverse=True)
    finally:
        for vid in ids:  # leave nothing queued
            assert api.delete(f"/v1/validations/{vid}").json()["status"] == "cancelled"


def test_worker_without_redis_exits_with_an_error():
    proc = subprocess.run(
        [sys.executable, "-m", "sigprop.cli", "worker", "--burst"],
        cwd=ROOT,
        env=service_env({"SIGPROP_REDIS_URL": None}),
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert json.loads(proc.stderr)["error"]["code"] == "invalid_request"


# -- the embedded mode: no Redis, jobs run in the API process, state in SQLite -------------------


def test_local_mode_runs_cancels_and_survives_a_restart(tmp_path):
    data = tmp_path / "data"
    env = {**COMMON_ENV, "SIGPROP_REDIS_URL": None, "SIGPROP_DATA_DIR": str(data)}
    svc = start_service(tmp_path / "svc", env, cli=FAKE_CLI)
    try:
        api = svc.client(headers=AUTH)
        vid = submit(api, validation(steps=4))
        job = wait_for(api, vid, status_is("finished", "failed"), 30)
        assert job["status"] == "finished", job
        assert job["attempts"] == 1 and job["device"] in ("cpu", "cuda") and job["results"]["device"] == job["device"]
        assert job["progress"]["step"] == 4 and job["results"]["runs"]["solution"]["nan"] is None

        running = submit(api, validation(steps=300))
        queued = submit(api, validation(steps=3))  # one local worker: this one waits
        wait_for(api, running, lambda j: j["status"] == "running" and j["progress"].get("step", 0) >= 1, 30)
        assert api.get(f"/v1/validations/{queued}").json()["status"] == "queued"
        r = api.delete(f"/v1/validations/{queued}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert api.delete(f"/v1/validations/{running}").status_code == 202
        job = wait_for(api, running, status_is("cancelled", "finished", "failed"), 5)
        assert job["status"] == "cancelled" and job["progress"]["step"] < 300, job
        assert_error(api.post("/v1/validations", json=validation(dataset="cifar")), 422, "invalid_request")
        assert_error(svc.client().post("/v1/validations", json=validation()), 401, "unauthorized")

        page = api.get("/v1/validations").json()
        assert [it["id"] for it in page["items"]] == [queued, running, vid] and page["total"] == 3
        time.sleep(0.5)
        assert api.get(f"/v1/validations/{queued}").json()["attempts"] == 0  # never ran

        # a job still running when the service stops ends failed ("interrupted"), not running forever
        last = submit(api, validation(steps=300))
        wait_for(api, last, status_is("running"), 30)
    finally:
        svc.stop()
    with sqlite3.connect(data / "solutions.sqlite3") as db:  # the table next to the solutions
        status, error = db.execute("SELECT status, error FROM validations WHERE id = ?", (last,)).fetchone()
    assert status == "failed" and "interrupted" in error, (status, error)

    svc = start_service(tmp_path / "svc2", env, cli=FAKE_CLI)
    try:
        api = svc.client(headers=AUTH)
        job = api.get(f"/v1/validations/{last}").json()
        assert job["status"] == "failed" and "interrupted" in job["error"], job
        # a service killed outright leaves its job running in the table: the next start fails it
        killed = submit(api, validation(steps=300))
        wait_for(api, killed, status_is("running"), 30)
        os.killpg(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(timeout=10)
    finally:
        svc.stop()
    svc = start_service(tmp_path / "svc3", env, cli=FAKE_CLI)
    try:
        job = svc.client(headers=AUTH).get(f"/v1/validations/{killed}").json()  # errors are shown with a key
        assert job["status"] == "failed" and "exited before it finished" in job["error"], job
    finally:
        svc.stop()
