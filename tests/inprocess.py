"""The HTTP app in-process (FastAPI's TestClient: real ASGI, lifespan included, no socket) for the
security, rate-limit, input-hardening and HTTP fuzz tests, where a real server adds nothing.

Validations run in the app's local runner with the sleep-only trainer of ``tests/fake_training.py``
(patched in for the duration of ``app_client``), and the embedded SQLite cache lives in the test's
temporary folder.
"""

from __future__ import annotations

import base64
import contextlib
import time
from pathlib import Path

from fastapi.testclient import TestClient

from sigprop.api.app import create_app
from sigprop.settings import Settings
from sigprop.worker import job

from . import fake_training

KEYS = "sec-key-one-0123456789,sec-key-two-0123456789"  # 16+ characters: `sigprop serve` refuses shorter
KEY_ONE, KEY_TWO = KEYS.split(",")


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def basic(key: str, user: str = "anyone") -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()}


def mlp(depth: int = 3, eta: float = 0.5, width: int = 8) -> dict:
    return {
        "graph": {"template": "mlp", "depth": depth, "width": width},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": eta},
    }


def eoc(q_star: float) -> dict:
    """A quick cold solve (a few ms): a new ``q_star`` is a new cache key."""
    return {
        "graph": {"template": "mlp", "depth": 2, "width": 4},
        "method": "eoc",
        "activation": "tanh",
        "targets": {"q_star": q_star},
    }


def validation(solve: dict | None = None, steps: int = 2, dataset: str = "synthetic") -> dict:
    return {"solve": solve or mlp(), "dataset": dataset, "steps": steps, "batch_size": 8}


@contextlib.contextmanager
def app_client(tmp_path: Path, **settings):
    """A TestClient on a fresh app: SQLite cache under ``tmp_path``, API keys ``KEYS`` unless given,
    the fake trainer for validations. Closes the app (lifespan) on exit."""
    previous = job.train
    job.train = fake_training.run
    try:
        values = {"data_dir": tmp_path / "data", "redis_url": None, "api_keys": KEYS, **settings}
        with TestClient(create_app(Settings(**values)), raise_server_exceptions=False) as client:
            yield client
    finally:
        job.train = previous


def readyz_when(client, check, timeout_s: float = 3.0):
    """The first ``/readyz`` answer for which ``check(response)`` holds, polled for ``timeout_s``:
    the probe reports the store as a background thread last saw it, every half second
    (``api/probe_state.py``), so a change of the store shows up within about that."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.get("/readyz")
        if check(r) or time.monotonic() > deadline:
            return r
        time.sleep(0.05)
