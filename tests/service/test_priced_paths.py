"""Every path priced and admitted like a solve (issue 35): template expansion and stored-answer
reads count against the client's cold-solve budget when large, and a large expansion runs in a
solver process; a cold solve's lane follows its price (a transformer's token work included), not
its graph family; BLAS runs on one thread in the attention generators; a classification
validation's training work and memory are bounded like a charlm one's; and the token-kernel price
is compared with a measured solve.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import sigprop.engine.templates.expand as expand_module
from sigprop.api.solutions import ColdSolve, SolutionService
from sigprop.engine.limits import token_work
from sigprop.engine.solve import solve_canonical
from sigprop.errors import SigpropError
from sigprop.preparation import prepare_data
from sigprop.schemas import attention_init
from sigprop.schemas.ops import ATTENTION
from sigprop.settings import Settings

from ..inprocess import KEY_ONE, app_client, bearer, mlp
from ..service_fixtures import assert_error

LARGE_TEMPLATE = {"depth": 2000, "width": 8}  # 8,000 nodes + edges: past SIGPROP_SMALL_SOLVE_COST


def transformer(depth: int, seq_len: int, shaping: str = "u-spa") -> dict:
    return {
        "graph": {"template": "transformer", "depth": depth, "seq_len": seq_len, "width": 64, "heads": 4},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.5},
        "attention": {"shaping": shaping},
    }


def test_large_template_expansions_count_as_cold_solves_and_small_ones_do_not(tmp_path):
    with app_client(tmp_path, rate_limit_cold_solves="2/minute", solve_processes=0) as c:
        for _ in range(5):  # small expansions: never counted
            assert c.get("/v1/templates/mlp", params={"depth": 3}).status_code == 200
        for _ in range(2):
            r = c.get("/v1/templates/mlp", params=LARGE_TEMPLATE)
            assert r.status_code == 200 and len(r.json()["nodes"]) > 2000, r.text[:200]
        r = c.get("/v1/templates/mlp", params=LARGE_TEMPLATE)
        assert_error(r, 429, "rate_limited")
        assert r.headers["retry-after"].isdigit()
        # another client (its own key) has a budget of its own
        assert c.get("/v1/templates/mlp", params=LARGE_TEMPLATE, headers=bearer(KEY_ONE)).status_code == 200
        # priced before anything is built: over the cost budget, 413 at once
        assert_error(c.get("/v1/templates/mlp", params={"depth": 20_000, "width": 8}), 413, "graph_too_large")


def test_a_large_template_is_expanded_in_a_solver_process_not_the_api_process(tmp_path, monkeypatch):
    calls: list[int] = []
    real = expand_module.expand_template

    def counted(t, *args, **kwargs):
        calls.append(t.depth)
        return real(t, *args, **kwargs)

    with app_client(tmp_path, solve_processes=1) as c:
        import sigprop.api.routers.templates as route

        for module in (expand_module, route):
            monkeypatch.setattr(module, "expand_template", counted, raising=False)
        try:
            import sigprop.api.priced as priced_module

            monkeypatch.setattr(priced_module, "expand_template", counted)
        except ImportError:
            pass
        r = c.get("/v1/templates/mlp", params=LARGE_TEMPLATE)
        assert r.status_code == 200 and len(r.json()["nodes"]) > 2000
        assert calls == []  # not in this (the API's) process
        assert c.get("/v1/templates/mlp", params={"depth": 3}).status_code == 200
        assert calls == [3]  # a small one is, in a thread


def test_large_stored_reads_count_as_cold_solves_and_small_ones_do_not(tmp_path):
    with app_client(tmp_path, rate_limit_cold_solves="3/minute") as c:
        big = c.post("/v1/solve", json=mlp(depth=2000), headers=bearer(KEY_ONE))  # one cold solve of KEY_ONE's
        assert big.status_code == 200, big.text[:300]
        small = c.post("/v1/solve", json=mlp(depth=3))  # the anonymous client's first
        assert small.status_code == 200
        keys = {it["graph_summary"]["nodes"] > 1000: it["key"] for it in _listed(c)}
        for _ in range(5):  # small reads: never counted
            r = c.get(f"/v1/solutions/{keys[False]}", headers=bearer(KEY_ONE))
            assert r.status_code == 200
        for _ in range(2):
            r = c.get(f"/v1/solutions/{keys[True]}", headers=bearer(KEY_ONE))
            assert r.status_code == 200 and len(r.content) > 256 << 10
            body = r.json()
            assert body["key"] == keys[True] and body["answer"]["cached"] is True
            assert body["request"]["graph"]["depth"] == 2000 and body["method"] == "tat"
        assert_error(c.get(f"/v1/solutions/{keys[True]}", headers=bearer(KEY_ONE)), 429, "rate_limited")


def _listed(c) -> list[dict]:
    deadline = time.monotonic() + 5
    while True:
        items = c.get("/v1/solutions", headers=bearer(KEY_ONE)).json()["items"]
        if len(items) >= 2 or time.monotonic() > deadline:
            return items
        time.sleep(0.05)


class _NoCache:
    """A cache that holds nothing: every request is a cold solve."""

    backend = "none"

    def get_answer(self, key):
        return None


def test_a_transformer_with_a_long_token_kernel_is_priced_large_whatever_its_node_count():
    service = SolutionService(_NoCache(), 1.0, 1.0, limits=Settings().limits(), small_cost=2_000)
    import json

    cold = service.begin(json.dumps(transformer(30, 256)).encode(), "key:a")
    assert isinstance(cold, ColdSolve)
    nodes_edges = cold.prep.graph.n + sum(len(nd.inputs) for nd in cold.prep.graph.nodes)
    assert nodes_edges < 2_000  # few nodes: the small lane, if lanes were chosen by graph size
    assert cold.cost > 2_000  # its price says large
    small = service.begin(json.dumps(transformer(1, 16)).encode(), "key:a")
    assert small.cost <= 2_000  # a tiny transformer is small: by price, not by family


def test_attention_generators_run_blas_on_one_thread(monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    seen: list[int] = []
    real = np.linalg.cholesky

    def spy(a):
        seen.extend(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")
        return real(a)

    monkeypatch.setattr(np.linalg, "cholesky", spy)
    generator = {
        "form": "cholesky_ratio",
        "target": {"family": "uniform", "rho": 0.6},
        "source": {"family": "uniform", "rho": 0.3},
    }
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):  # as a process with default threads
        attention_init.expand_attention(generator, 64, True)
    assert seen and set(seen) == {1}, seen


@pytest.mark.parametrize("shaping", ["u-spa", "e-spa"])
def test_the_token_kernel_price_bounds_a_measured_solve_within_a_factor(shaping):
    """Not a timing test: the price (ns of one core) and a measured solve of a small transformer
    agree within generous bounds (bench/README.md has the figures at 30-190 blocks, T 64-256)."""
    req = transformer(12, 128, shaping)
    limits = Settings().limits()
    solve_canonical(prepare_data(req, limits))  # warm: imports, tables
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        prep = prepare_data(req, limits)
        solve_canonical(prep)
        best = min(best, time.perf_counter() - start)
    g = prep.graph
    attention = sum(1 for nd in g.nodes if nd.kind == ATTENTION)
    price_s = token_work(128, attention, g.n - attention, shaping) / 1e9
    assert price_s / 30 < best < 3 * price_s, (best, price_s)
    from sigprop.preparation import solve_price

    assert solve_price(g, shaping) > g.n  # the token work is in the lane price


def test_a_classification_validation_past_the_training_bounds_is_refused_with_413(tmp_path):
    huge = {"solve": mlp(depth=1000, width=1024), "dataset": "digits", "steps": 20_000, "batch_size": 64}
    huge["solve"]["graph"].update({"input_shape": [64], "classes": 10})
    with app_client(tmp_path) as c:
        r = c.post("/v1/validations", json=huge, headers=bearer(KEY_ONE))
        err = assert_error(r, 413, "validation_too_large")
        assert "GiB" in err["message"] and err["hint"]
        ok = {**huge, "solve": mlp(depth=3), "steps": 5, "batch_size": 8}
        ok["solve"]["graph"].update({"input_shape": [64], "classes": 10})
        assert c.post("/v1/validations", json=ok, headers=bearer(KEY_ONE)).status_code == 202


def test_the_worker_checks_the_classify_bound_again():
    """A job that reached the queue some other way (an older API, a hand-edited record) is refused on
    the worker too, before it builds anything."""
    from sigprop.worker.job import confine_dataset

    nodes = [{"id": "x", "op": "input", "shape": [64]}]
    for i in range(400):
        nodes.append({"id": f"d{i}", "op": "dense", "inputs": [nodes[-1]["id"]], "units": 4096})
    nodes.append({"id": "out", "op": "output", "inputs": [nodes[-1]["id"]]})
    payload = {"graph": {"schema": "sigprop.graph/v1", "nodes": nodes}, "request": {"steps": 20000, "batch_size": 64}}
    with pytest.raises(SigpropError) as err:
        confine_dataset(payload, None)
    assert err.value.code == "validation_too_large" and err.value.hint
