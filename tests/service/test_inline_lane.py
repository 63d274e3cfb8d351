"""Small cold solves in the API process (``api/inline_lane.py``) within a cooperative budget
(``engine/budget.py``), and ``POST /v1/solve`` answered before FastAPI routing
(``api/solve_fastpath.py``) exactly as the route answers it."""

from __future__ import annotations

import gc
import json
import time

import numpy as np
import pytest

import sigprop
from sigprop.api.inline_lane import COOLDOWN_FACTOR, InlineLane
from sigprop.engine import budget
from sigprop.engine.maps.activations import get_activation
from sigprop.engine.maps.qc_maps import shaped_stats
from sigprop.engine.maps.transform import MAX_INPUT_SCALE
from sigprop.engine.solve import solve_canonical
from sigprop.errors import SigpropError
from sigprop.preparation import prepare_data
from sigprop.settings import offline_limits

from ..service_fixtures import metric_value

MLP = {"template": "mlp", "depth": 20, "width": 64}
EASY = {"graph": MLP, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.9}}
# A target no transformation reaches, by proof rather than by where a root search gives up: the
# search spends its whole evaluation budget on it (~100 ms). TAT asks every layer for C'(1) = 1 and
# C''(1) = tau / kappa (kappa = 20 on this MLP, so 5e5). For phi_hat = gamma (tanh(alpha z + beta) +
# delta), C''(1) / C'(1) = alpha^2 E[tanh''(y)^2] / E[tanh'(y)^2] with y = alpha z + beta, and
# tanh'' = -2 tanh tanh' with |tanh| < 1, so C''(1) < 4 alpha^2 C'(1) <= 4 MAX_INPUT_SCALE^2 = 4e4:
# 12x short of the target at the search's largest input scale
# (test_tanh_curvature_is_bounded_by_the_input_scale checks the bound on the engine's own moments).
UNREACHABLE = {"graph": MLP, "method": "tat", "activation": "tanh", "targets": {"tau": 1e7}}
# a smooth solve whose root search takes many condition evaluations (tens of ms)
SLOW_SMOOTH = {"graph": MLP, "method": "tat", "activation": "elu", "targets": {"tau": 0.01}}


def _prepared(request: dict):
    return prepare_data(json.loads(json.dumps(request)), offline_limits())


def _cost(prep) -> int:
    return prep.graph.n + sum(len(nd.inputs) for nd in prep.graph.nodes)


# -- the engine's cooperative budget ---------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.01, 0.5, 3.0, 30.0, MAX_INPUT_SCALE])
def test_tanh_curvature_is_bounded_by_the_input_scale(alpha):
    """The premise of UNREACHABLE, on the moments the root search itself evaluates."""
    tanh = get_activation("tanh")
    for beta in np.linspace(-3.0, 3.0, 13):
        st = shaped_stats(tanh, alpha, beta, None)[2]
        assert st.c_curv_1 < 4.0 * alpha**2 * st.c_slope_1, (alpha, beta)
    kappa = 20.0  # one curvature unit per activation layer of the 20-layer MLP
    assert UNREACHABLE["targets"]["tau"] / kappa > 10 * 4.0 * MAX_INPUT_SCALE**2


def test_a_budget_stops_a_long_root_search_at_its_next_evaluation():
    prep = _prepared(UNREACHABLE)
    start = time.perf_counter()
    with pytest.raises(SigpropError):  # without a budget it runs to its refusal
        solve_canonical(prep)
    unbudgeted = time.perf_counter() - start
    assert unbudgeted > 0.03, unbudgeted  # long enough for a 5 ms budget to mean something
    # A full collection of this worker's heap (60-90 ms under xdist, measured with gc.callbacks) is
    # no evaluation, and no cooperative budget can cut it short; the API process keeps its start-up
    # heap frozen out of the collector for the same reason.
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        with pytest.raises(budget.OverBudget), budget.within(0.005):
            solve_canonical(prep)
        stopped = time.perf_counter() - start
    finally:
        gc.enable()
    assert stopped < 0.005 + 0.02, stopped  # the budget plus at most one evaluation
    budget.check()  # outside ``within`` nothing is left set


def test_a_stopped_solve_leaves_nothing_behind_in_the_process():
    """Stops at every depth of a solve (each budget stops it at another evaluation), then the same
    request again: the answer is byte-identical to the one solved before any stop."""
    prep = _prepared(SLOW_SMOOTH)
    before = solve_canonical(prep).to_json()
    stops = 0
    for ms in (0.2, 0.5, 1, 2, 3, 5, 8, 12):
        try:
            with budget.within(ms / 1000):
                solve_canonical(_prepared(SLOW_SMOOTH))
        except budget.OverBudget:
            stops += 1
    assert stops >= 4, stops  # the test stopped real solves, not only finished ones
    assert solve_canonical(_prepared(SLOW_SMOOTH)).to_json() == before


def test_budgets_nest_and_the_outer_one_comes_back():
    with budget.within(10):
        with budget.within(0.0):
            time.sleep(0.001)
            with pytest.raises(budget.OverBudget):
                budget.check()
        budget.check()  # the outer 10 s budget again
    budget.check()


def test_over_budget_is_not_an_ordinary_exception():
    """The engine's ``except Exception`` fallbacks (a failed start, a root that does not polish)
    must not take a spent budget for a failed step and go on."""
    assert not issubclass(budget.OverBudget, Exception)


# -- the inline lane --------------------------------------------------------------------------------


def test_the_lane_solves_small_requests_as_a_solver_process_would():
    prep = _prepared(EASY)
    lane = InlineLane(max_cost=10_000, budget_s=1.0)
    assert lane.takes(prep, _cost(prep))
    assert lane.try_solve(prep, _cost(prep)) == solve_canonical(prep).to_json()


def test_the_lane_leaves_large_and_sequence_requests_to_the_solver_processes():
    prep = _prepared(EASY)
    assert not InlineLane(max_cost=_cost(prep) - 1, budget_s=1.0).takes(prep, _cost(prep))
    seq = _prepared(
        {
            "graph": {"template": "transformer", "depth": 1, "seq_len": 4, "width": 8, "heads": 2},
            "method": "tat",
            "activation": "leaky_relu",
            "targets": {"eta": 0.5},
            "attention": {"shaping": "e-spa"},
        }
    )
    lane = InlineLane(max_cost=10**9, budget_s=1.0)
    assert not lane.takes(seq, _cost(seq))  # token kernels grow with T, not with the graph
    assert lane.try_solve(seq, _cost(seq)) is None


def test_a_busy_lane_answers_none_at_once():
    prep = _prepared(EASY)
    lane = InlineLane(max_cost=10_000, budget_s=1.0)
    lane._lock.acquire()  # another request's solve in the lane
    try:
        start = time.perf_counter()
        assert lane.try_solve(prep, _cost(prep)) is None
        assert time.perf_counter() - start < 0.05  # nothing waits for the lane
    finally:
        lane._lock.release()
    assert lane.try_solve(prep, _cost(prep)) is not None


def test_a_solve_past_the_budget_closes_the_lane_for_ten_times_what_it_spent():
    lane = InlineLane(max_cost=10_000, budget_s=0.01)
    slow, easy = _prepared(UNREACHABLE), _prepared(EASY)
    start = time.monotonic()
    assert lane.try_solve(slow, _cost(slow)) is None  # handed on, not refused
    end = time.monotonic()
    spent = end - start
    # closed from when the attempt gave up (it was measured from there: closed_until - start is 11x)
    closed_for = lane.closed_until - end
    assert 0.01 * COOLDOWN_FACTOR - 0.005 <= closed_for <= spent * COOLDOWN_FACTOR, (closed_for, spent)
    assert lane.try_solve(easy, _cost(easy)) is None  # closed: even an easy solve goes on
    time.sleep(max(0.0, lane.closed_until - time.monotonic()) + 0.01)
    assert lane.try_solve(easy, _cost(easy)) == solve_canonical(easy).to_json()


def test_engine_errors_come_out_of_the_lane_as_from_a_solver_process():
    lane = InlineLane(max_cost=10_000, budget_s=5.0)
    prep = _prepared(UNREACHABLE)
    with pytest.raises(SigpropError) as err:
        lane.try_solve(prep, _cost(prep))
    assert err.value.code == "unreachable_target"
    assert not lane._lock.locked()


# -- over HTTP: the fast path and the route answer alike ----------------------------------------------


def _app(tmp_path, **settings):
    from sigprop.api.app import create_app
    from sigprop.settings import Settings

    return create_app(Settings(data_dir=tmp_path / "data", **settings))


def _inline(client, outcome: str) -> float:
    return metric_value(client.get("/metrics").text, "sigprop_inline_solves_total", {"outcome": outcome}) or 0.0


def test_small_cold_solves_are_answered_inline_and_past_the_budget_by_a_solver_process(tmp_path):
    from fastapi.testclient import TestClient

    expected = json.loads(sigprop.solve(EASY).model_dump_json())
    with TestClient(_app(tmp_path / "a")) as c:
        done = _inline(c, "done")  # the counters are the process's: count this app's requests
        r = c.post("/v1/solve", json=EASY)
        assert r.status_code == 200 and r.json()["cached"] is False
        assert _inline(c, "done") == done + 1
        inline_answer = r.json()
    # a budget nothing fits in: every solve goes on to a solver process, with the same answer
    with TestClient(_app(tmp_path / "b", inline_solve_budget_ms=1e-6)) as c:
        done, over = _inline(c, "done"), _inline(c, "over_budget")
        r = c.post("/v1/solve", json=EASY)
        assert r.status_code == 200 and r.json()["cached"] is False
        assert _inline(c, "done") == done and _inline(c, "over_budget") == over + 1
        assert r.json() == inline_answer
        assert c.app.state.solutions.inline.closed_until > 0
    with TestClient(_app(tmp_path / "c", inline_solve_cost=0)) as c:
        assert c.app.state.solutions.inline is None
        assert c.post("/v1/solve", json=EASY).json() == inline_answer
    for key in ("negative_slope", "output_scale", "c_f_0"):
        assert inline_answer[key] == expected[key]


@pytest.mark.parametrize(
    "body",
    [
        json.dumps(EASY),
        "{not json",
        json.dumps({**EASY, "method": "tta"}),
        json.dumps({**EASY, "target": {"eta": 0.9}}),
        '{"method": "tat", "method": "dks"}',
        json.dumps({**EASY, "graph": {"template": "mlp", "depth": 10**6, "width": 8}}),
        json.dumps(UNREACHABLE),
    ],
    ids=["cold", "bad-json", "method-typo", "key-typo", "repeated-key", "too-large", "unreachable"],
)
def test_the_fast_path_answers_as_the_route(tmp_path, body):
    """The same body to an app that answers ``POST /v1/solve`` before routing and to one whose
    reads need a key (the route answers there): same status, body and headers."""
    from fastapi.testclient import TestClient

    key = "k3y-For-The-Route-0123456789abcdef"
    with (
        TestClient(_app(tmp_path / "fast", api_keys=key)) as fast,
        TestClient(_app(tmp_path / "route", api_keys=key, keys_for_reads=True)) as routed,
    ):
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        done = _inline(fast, "done")
        a = fast.post("/v1/solve", content=body, headers=auth)
        b = routed.post("/v1/solve", content=body, headers=auth)
        assert a.status_code == b.status_code, (a.text, b.text)
        assert a.content == b.content
        drop = {"x-request-id"}
        assert [(k, v) for k, v in a.headers.items() if k not in drop] == [
            (k, v) for k, v in b.headers.items() if k not in drop
        ]
        if a.status_code == 200:  # solved inline by one, in a solver process or inline by the other
            assert _inline(fast, "done") >= done + 1


@pytest.mark.parametrize("through", ["fast path", "route"])
def test_a_cold_answer_is_stored_even_when_sending_it_fails(tmp_path, through):
    """The store write (and the single-flight lock's release) runs after the answer is sent, and
    also when the send fails: the next request for the same key is a hit, not a 30 s lock wait.
    Both ways the endpoint answers (the route: when reads need a key) send through one function."""
    from fastapi.testclient import TestClient

    body = json.dumps({**EASY, "targets": {"eta": 0.8}}).encode()
    key = "k3y-For-The-Route-0123456789abcdef"
    app = _app(tmp_path, api_keys=key, keys_for_reads=through == "route")
    auth = [(b"authorization", f"Bearer {key}".encode())]
    with TestClient(app) as c:

        async def call_with_a_broken_client() -> None:
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                return messages.pop(0) if messages else {"type": "http.disconnect"}

            async def send(message):
                if message["type"] == "http.response.body":
                    raise OSError("the client went away")

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": "/v1/solve",
                "raw_path": b"/v1/solve",
                "root_path": "",
                "query_string": b"",
                "headers": [(b"content-type", b"application/json"), (b"host", b"testserver"), *auth],
                "client": ("127.0.0.1", 50000),
                "server": ("testserver", 80),
            }
            with pytest.raises(OSError):
                await app(scope, receive, send)

        c.portal.call(call_with_a_broken_client)
        start = time.perf_counter()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        again = c.post("/v1/solve", content=body, headers=headers)
        assert again.status_code == 200 and again.json()["cached"] is True
        assert time.perf_counter() - start < 5  # not a wait for the lock to expire
