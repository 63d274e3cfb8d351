"""schemathesis against the live OpenAPI schema of a real `sigprop serve` (uvicorn on loopback,
a private Redis, no worker): every check it has, a bounded number of examples per operation
(all four phases: examples, coverage, fuzzing, stateful), a fixed seed so CI is repeatable.

It must find no 5xx, no response outside the documented statuses, content types, headers and
schemas, and no invalid request accepted. One check is relaxed, for a reason the schema cannot
carry: `positive_data_acceptance` expects schema-valid requests to be accepted, but a graph can
be schema-valid and still not a network (a cycle, no output node, weights not normalized, a
template expanding past the size limits), which answers the contract's 422 / 413.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .service_fixtures import start_redis, start_service

KEY = "schemathesis-key"
MAX_EXAMPLES = 100
RUN_LIMIT_S = 170  # the whole fuzzing run has a budget of 3 minutes


def _config(solution_key: str, validation_id: str) -> str:
    # Real identifiers for the read operations, so some cases reach stored resources, not only 404s.
    return f"""
seed = 20261121
max-failures = 50
[generation]
max-examples = {MAX_EXAMPLES}
[checks.positive_data_acceptance]
expected-statuses = ["2xx", 401, 403, 404, 409, 413, 422, 429]

[[operations]]
include-path = "/v1/solutions/{{key}}"
include-method = "GET"
parameters = {{ "path.key" = "{solution_key}" }}

[[operations]]
include-path = "/v1/validations/{{vid}}"
include-method = "GET"
parameters = {{ "path.vid" = "{validation_id}" }}
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schemathesis")
    redis_server = start_redis(tmp / "redis")
    svc = start_service(
        tmp / "svc",
        {
            "SIGPROP_REDIS_URL": redis_server.url,
            "SIGPROP_DATA_DIR": str(tmp / "data"),
            "SIGPROP_API_KEYS": KEY,
            "SIGPROP_RATE_LIMIT_COLD_SOLVES": "100000/minute",
            "SIGPROP_RATE_LIMIT_VALIDATIONS": "100000/minute",
        },
    )
    try:
        yield tmp, svc
    finally:
        svc.stop()
        redis_server.stop()


def test_schemathesis_finds_no_server_errors_or_schema_violations(live):
    tmp, svc = live
    auth = {"Authorization": f"Bearer {KEY}"}
    solve = {
        "graph": {"template": "mlp", "depth": 4, "width": 16},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.5},
    }
    solution_key = httpx.post(f"{svc.base_url}/v1/solve", json=solve, timeout=30).json()["key"]
    r = httpx.post(
        f"{svc.base_url}/v1/validations",
        json={"key": solution_key, "dataset": "synthetic", "steps": 5},
        headers=auth,
        timeout=30,
    )
    assert r.status_code == 202, r.text
    config = tmp / "schemathesis.toml"
    config.write_text(_config(solution_key, r.json()["id"]))

    st = Path(sys.executable).with_name("st")
    cmd = [
        str(st),
        "--config-file",
        str(config),
        "run",
        f"{svc.base_url}/openapi.json",
        "--checks",
        "all",
        "--header",
        f"Authorization: Bearer {KEY}",
        "--request-timeout",
        "30",
        "--no-color",
        "--report",
        "junit",
        "--report-dir",
        str(tmp / "report"),
    ]
    start = time.monotonic()
    out = subprocess.run(
        cmd,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S + 60,
        env={**os.environ, "SCHEMATHESIS_HOOKS": ""},
    )
    took = time.monotonic() - start
    summary = out.stdout[out.stdout.rfind("SUMMARY") :] if "SUMMARY" in out.stdout else out.stdout[-4000:]
    print(f"\nschemathesis: {took:.1f} s\n{summary}")
    assert out.returncode == 0, (
        f"schemathesis found problems (exit {out.returncode}):\n{out.stdout[-20000:]}\n{out.stderr[-3000:]}"
    )
    assert took < RUN_LIMIT_S, f"schemathesis took {took:.0f} s"
    assert "generated" in summary  # it really ran cases
