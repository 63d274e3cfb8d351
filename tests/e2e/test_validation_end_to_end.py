"""Validation trainings through the real API to a real `sigprop worker` on a real Redis with the real
trainer. The headline check (`slow`): a depth-50 TReLU MLP on digits trains clearly better than the
same ReLU MLP with He initialization in the same budget (TAT paper section 5.3, on a small scale).
The default suite runs the same path with a short training: submitted, picked up, progress seen,
finished once on the CPU with a result for every run."""

import subprocess
import sys
import time

import httpx
import pytest

from ..service_fixtures import _stop_group, service_env, start_redis, start_service

KEY = "e2e-key-0123456789"


def _validate_through_the_api(tmp_path, depth: int, steps: int, deadline_s: float) -> dict:
    """The finished validation record of a TReLU MLP against He ReLU on digits, run by a real worker."""
    redis = start_redis(tmp_path / "redis")
    env = {"SIGPROP_REDIS_URL": redis.url, "SIGPROP_DATA_DIR": str(tmp_path / "data"), "SIGPROP_API_KEYS": KEY}
    svc = worker = None
    try:
        svc = start_service(tmp_path / "svc", env)
        with open(tmp_path / "worker.log", "wb") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "sigprop.cli", "worker"],
                env=service_env(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        body = {
            "solve": {
                "graph": {"template": "mlp", "depth": depth, "width": 128, "input_shape": [64], "classes": 10},
                "method": "tat",
                "activation": "leaky_relu",
                "targets": {"eta": 0.9},
            },
            "dataset": "digits",
            "steps": steps,
            "batch_size": 64,
            "seed": 0,
            "baselines": ["he"],
        }
        with httpx.Client(base_url=svc.base_url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as api:
            r = api.post("/v1/validations", json=body)
            assert r.status_code == 202, r.text
            vid = r.json()["id"]
            seen_progress = False
            deadline = time.monotonic() + deadline_s
            while True:
                job = api.get(f"/v1/validations/{vid}").json()
                seen_progress |= job["status"] == "running" and job["progress"].get("step", 0) > 0
                if job["status"] in ("finished", "failed", "cancelled") or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
        assert job["status"] == "finished", (job, (tmp_path / "worker.log").read_text()[-3000:])
        assert seen_progress and job["device"] == "cpu" and job["attempts"] == 1
        return job
    finally:
        if worker is not None:
            _stop_group(worker)
        if svc is not None:
            svc.stop()
        redis.stop()


def test_a_short_validation_runs_through_the_api_to_the_worker(tmp_path):
    job = _validate_through_the_api(tmp_path, depth=20, steps=40, deadline_s=120)
    summary = job["results"]["summary"]
    assert 0.0 <= summary["solved"]["final_test_accuracy"] <= 1.0
    assert "he" in summary["baselines"] and "accuracy" in summary["baselines"]["he"]


@pytest.mark.slow
def test_trelu_mlp_on_digits_beats_he_relu_through_the_api(tmp_path):
    summary = _validate_through_the_api(tmp_path, depth=50, steps=300, deadline_s=300)["results"]["summary"]
    solved = summary["solved"]["final_test_accuracy"]
    he = summary["baselines"]["he"]["baseline_accuracy"]
    assert summary["baselines"]["he"]["accuracy"] == "better"
    assert solved >= 0.85 and solved - he >= 0.15, (solved, he)
