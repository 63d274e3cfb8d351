"""schemathesis against the live OpenAPI schema of a real `sigprop serve` (uvicorn on loopback,
a private Redis, no worker): every check it has (all four phases: examples, coverage, fuzzing,
stateful), a bounded number of examples per operation, a fixed seed so CI is repeatable. The
default suite runs a short pass; `-m slow` a long one.

It must find no 5xx, no response outside the documented statuses, content types, headers and
schemas, no invalid request accepted, and no valid request refused. The schema is as strict as the
validator: which targets a method reads, `solve` or `key` in a validation, no repeated keys. A solve
or a validation may still answer 422 to a schema-valid request for what JSON Schema cannot say (a
graph that is not a network: a cycle, no output node, shapes that do not fit; a dataset the server
does not have) or 413 for a graph past the size limits (which may also answer an invalid request, as a graph's
size is checked before the rest): `positive_data_acceptance` and `negative_data_rejection` allow
those two operations 413 (and the first 422), and the check of `tests/schemathesis_hooks.py` then
accepts a 422 only with an error code of such a rule, never `invalid_request` for the JSON's shape.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ..service_fixtures import start_redis, start_service

KEY = "schemathesis-Zq4r8TnW2xLk"
ROOT = Path(__file__).resolve().parents[2]
# (examples per operation, budget of the whole run in seconds)
SHORT = (10, 90)
LONG = (300, 600)
SEMANTIC_REFUSALS = '["2xx", "401", "403", "404", "409", "413", "422", "429"]'
# schemathesis's list for invalid requests, plus 413: a graph past the size limits is refused from
# its size before the rest is validated (every cost is bounded before work starts)
REJECTIONS = '["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]'


def _config(solution_key: str, validation_id: str, max_examples: int) -> str:
    # Real identifiers for the read operations, so some cases reach stored resources, not only 404s.
    return f"""
seed = 20261121
max-failures = 50
[generation]
max-examples = {max_examples}

[[operations]]
include-path = "/v1/solve"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = {SEMANTIC_REFUSALS}
checks.negative_data_rejection.expected-statuses = {REJECTIONS}

[[operations]]
include-path = "/v1/validations"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = {SEMANTIC_REFUSALS}
checks.negative_data_rejection.expected-statuses = {REJECTIONS}

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


@pytest.mark.parametrize(
    "run", [pytest.param(SHORT, id="short"), pytest.param(LONG, id="long", marks=pytest.mark.slow)]
)
def test_schemathesis_finds_no_server_errors_or_schema_violations(live, run):
    max_examples, run_limit_s = run
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
    config.write_text(_config(solution_key, r.json()["id"], max_examples))

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
        timeout=run_limit_s + 60,
        env={**os.environ, "SCHEMATHESIS_HOOKS": str(ROOT / "tests" / "schemathesis_hooks.py")},
    )
    took = time.monotonic() - start
    summary = out.stdout[out.stdout.rfind("SUMMARY") :] if "SUMMARY" in out.stdout else out.stdout[-4000:]
    phases = "\n".join(line for line in out.stdout.splitlines() if "(in " in line)
    print(f"\nschemathesis: {took:.1f} s\n{phases}\n{summary}")
    assert out.returncode == 0, (
        f"schemathesis found problems (exit {out.returncode}):\n{out.stdout[-20000:]}\n{out.stderr[-3000:]}"
    )
    assert took < run_limit_s, f"schemathesis took {took:.0f} s"
    assert "generated" in summary  # it really ran cases
