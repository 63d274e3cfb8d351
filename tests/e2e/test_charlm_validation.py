"""Character-level LM validations (``"task": "charlm"``, issue 28): a transformer solved with E-SPA
and TAT trained on the stdlib corpus next to the shortcut and standard pre-LN arms.

The default suite runs a tiny validation in process (arms, curves, the answer applied) and one
through the real API, a real Redis queue and a real ``sigprop worker``, then reads its curves on
the dashboard page. The measured comparison (a few hundred steps per arm) is ``slow``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sigprop.engine.solve import solve  # noqa: E402
from sigprop.engine.templates.expand import expand_template  # noqa: E402
from sigprop.schemas.attention_init import expand_attention  # noqa: E402
from sigprop.schemas.graph import Template  # noqa: E402
from sigprop.schemas.solve import SolveRequest  # noqa: E402
from sigprop.worker.charlm import _make_arm, run_charlm_validation  # noqa: E402
from sigprop.worker.charlm_plan import transformer_params  # noqa: E402

from ..service_fixtures import _stop_group, service_env, start_redis, start_service  # noqa: E402

KEY = "charlm-e2e-key-0123456789"
ARMS = ("solved", "shortcuts", "standard")


def solve_request(**graph) -> dict:
    template = {"template": "transformer", "depth": 2, "seq_len": 8, "width": 16, "heads": 2, **graph}
    return {
        "graph": template,
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.3},
        "attention": {"shaping": "e-spa"},
    }


def _wire(template: dict) -> dict:
    return expand_template(Template.model_validate(template), max_nodes=10_000).model_dump(
        mode="json", by_alias=True, exclude_none=True
    )


@pytest.fixture(scope="module")
def tiny():
    sreq = solve_request()
    sol = solve(SolveRequest.model_validate(sreq))
    request = {"solve": sreq, "task": "charlm", "steps": 4, "batch_size": 4, "seed": 3}
    seen = []
    res = run_charlm_validation(request, _wire(sreq["graph"]), sol, progress=seen.append, device="cpu")
    return sreq, sol, request, res, seen


def _check_results(res: dict, steps: int) -> None:
    assert res["task"] == "charlm" and list(res["runs"]) == list(ARMS)
    assert res["dataset"]["name"] == "stdlib" and re.fullmatch(r"[0-9a-f]{64}", res["dataset"]["digest"])
    for name, run in res["runs"].items():
        assert "error" not in run, (name, run)
        assert run["steps_done"] == steps and not run["diverged"]
        assert run["loss"]["steps"][-1] == steps and len(run["loss"]["values"]) == len(run["loss"]["steps"])
        val = run["validation_loss"]
        assert val["steps"][-1] == steps and len(val["values"]) == len(val["steps"]) <= steps
        # bytes: a loss near log(256) = 5.55 nats at the start, finite and positive throughout
        assert all(0 < v < 8 for v in run["loss"]["values"] + val["values"]), (name, run["loss"], val)
        assert run["final_validation_loss"] == pytest.approx(val["values"][-1])
        assert 0 < run["final_train_loss"] < 8 and 0 <= run["final_test_accuracy"] <= 1
    assert set(res["summary"]["arms"]) == {"shortcuts", "standard"} and "solved vs standard" in res["summary"]["text"]


def test_tiny_charlm_validation_trains_three_arms_with_curves(tiny):
    sreq, sol, request, res, seen = tiny
    _check_results(res, 4)
    assert seen[-1]["step"] == seen[-1]["total"] == 12 and seen[-1]["runs"] == list(ARMS)
    solved, shortcuts = res["runs"]["solved"]["apply"], res["runs"]["shortcuts"]["apply"]
    assert solved["complete"] and solved["attention"] == {"b0.attn": "cholesky_ratio", "b1.attn": "cholesky_ratio"}
    assert solved["sums"] == 0 and shortcuts["sums"] == 4 and shortcuts["complete"]
    assert res["plan"]["transformer"]["shortcuts"] is False and res["config"]["optimizer"] == "adam"
    # the same request gives the same numbers (same batches, same initialization)
    again = run_charlm_validation(request, _wire(sreq["graph"]), sol, device="cpu")
    for name in ARMS:
        assert again["runs"][name]["loss"]["values"] == pytest.approx(res["runs"][name]["loss"]["values"], rel=1e-5)


def test_solved_arm_is_the_answer_applied_and_the_standard_arm_is_plain():
    sreq = solve_request()
    sol = solve(SolveRequest.model_validate(sreq))
    wire = _wire(sreq["graph"])
    params = transformer_params(wire)
    graph = expand_template(Template.model_validate(sreq["graph"]), max_nodes=10_000)
    arm = _make_arm("solved", {"solve": sreq}, graph, sol, params, seed=0)
    body = arm.model.body  # the GraphModule apply returned; node ids map to paths in it
    gens = {entry.node: entry.generator for entry in sol.attention.layers}
    for i in range(2):
        att = body.get_submodule(arm.paths[f"b{i}.attn"])
        want = expand_attention(gens[f"b{i}.attn"], 8, True).matrix()
        np.testing.assert_allclose(att.matrix(8).numpy(), want, atol=1e-6)
        assert float(body.get_submodule(arm.paths[f"b{i}.q"]).weight.detach().abs().max()) == 0.0  # zero queries
        acts = [m for m in body.modules() if type(m).__name__ == "TransformedActivation"]
        assert len(acts) == 2 and f"negative_slope={sol.negative_slope:.6g}" in acts[0].extra_repr()
    standard = _make_arm("standard", {"solve": sreq}, graph, sol, params, seed=0).model.body
    assert float(standard.module_of("b0.attn").matrix(8).sum(1).sub(1).abs().max()) < 1e-6  # plain softmax rows
    assert "b0.ln1" in standard.norms and len(standard.sums) == 4


def test_charlm_validation_through_the_queue_and_on_the_dashboard(tmp_path):
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
        body = {"solve": solve_request(), "task": "charlm", "steps": 3, "batch_size": 4, "seed": 0}
        with httpx.Client(base_url=svc.base_url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as api:
            # refused before anything is queued: not a transformer, and over the cost bounds
            mlp = {"graph": {"template": "mlp", "depth": 3, "width": 8}, "method": "tat", "activation": "leaky_relu"}
            r = api.post("/v1/validations", json={**body, "solve": {**mlp, "targets": {"eta": 0.5}}})
            assert r.status_code == 422 and "transformer" in r.json()["error"]["hint"], r.text
            r = api.post("/v1/validations", json={**body, "steps": 10**6 - 1})
            assert r.status_code == 413 and r.json()["error"]["code"] == "validation_too_large", r.text
            r = api.post("/v1/validations", json=body)
            assert r.status_code == 202, r.text
            vid = r.json()["id"]
            deadline = time.monotonic() + 240
            while True:
                job = api.get(f"/v1/validations/{vid}").json()
                if job["status"] in ("finished", "failed", "cancelled") or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
            assert job["status"] == "finished", (job, (tmp_path / "worker.log").read_text()[-3000:])
            assert job["request"]["task"] == "charlm" and job["request"]["arms"] == list(ARMS)
            _check_results(job["results"], 3)
            page = api.get(f"/dashboard/validations/{vid}")
        assert page.status_code == 200
        data = json.loads(re.search(r'id="page-data">(.*?)</script>', page.text, re.S).group(1))
        curves = {s["name"]: s for s in data["plots"]["validation_loss"]}
        assert set(curves) == set(ARMS) and {s["name"] for s in data["plots"]["loss"]} == set(ARMS)
        for name in ARMS:
            assert curves[name]["values"] == pytest.approx(job["results"]["runs"][name]["validation_loss"]["values"])
        assert 'id="validation-loss-plot"' in page.text and "Next-byte accuracy" in page.text
        assert job["results"]["dataset"]["digest"][:12] in page.text
    finally:
        if worker is not None:
            _stop_group(worker)
        if svc is not None:
            svc.stop()
        redis.stop()


@pytest.mark.slow
def test_measured_comparison_of_the_three_arms():
    """The run docs/benchmarks.md quotes (depth 8, width 64, seq_len 32, 150 steps of batch 8): every
    arm trains; normalization-free with skips is within 0.2 nats of the standard pre-LN transformer
    (He et al.: about as fast); the skipless E-SPA arm is behind but within 0.5 nats (measured: 0.22)."""
    sreq = solve_request(depth=8, width=64, heads=4, seq_len=32)
    sol = solve(SolveRequest.model_validate(sreq))
    request = {"solve": sreq, "task": "charlm", "steps": 150, "batch_size": 8, "seed": 0}
    res = run_charlm_validation(request, _wire(sreq["graph"]), sol, device="cpu")
    _check_results(res, 150)
    val = {name: run["final_validation_loss"] for name, run in res["runs"].items()}
    assert all(v < 3.0 for v in val.values()), val
    assert abs(val["shortcuts"] - val["standard"]) < 0.2, val
    assert val["solved"] < val["standard"] + 0.5, val
