"""One cost model for every method, and fair cold solves (issue 26).

- Every method's work is linear in nodes + edges on the adversarial graphs
  (``tests/adversarial_graphs.py``): the geometric pass through dominator segments, the dominator
  walk by jump pointers. The default suite times the two passes that were quadratic; the whole
  method x graph matrix runs under ``-m slow`` (and as ``bench/cost_bench.py``).
- Cold solves are scheduled by lane and by client (``coldlanes.Lanes``): a small solve never
  waits behind large ones, and one client's large solves never hold every general slot.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest

from sigprop.api import solutions
from sigprop.api.coldlanes import GENERAL, SMALL, Lanes
from sigprop.api.coldpool import SolverPool, solve_request
from sigprop.api.solutions import SolutionService, graph_size
from sigprop.engine.graph.build import build_graph
from sigprop.engine.limits import Limits
from sigprop.engine.methods.geometric import solve_geometric
from sigprop.engine.network.subnetworks import _dominators
from sigprop.engine.solve import prepare, solve_canonical
from sigprop.errors import SigpropError
from sigprop.schemas import Graph
from sigprop.schemas.solve import SolveRequest
from sigprop.settings import Settings

from ..adversarial_graphs import (
    METHOD_REQUESTS,
    deep_chain,
    fan_in,
    input_ladder,
    ladder,
    late_sums,
    mirrored_skips,
    pool_chain,
    request,
    sums_after_identities,
)
from ..inprocess import mlp
from ..service_fixtures import start_service
from .test_availability import ladder_request

SOLVE = "/v1/solve"


# -- the passes that were quadratic ------------------------------------------------------------------


def test_geometric_solves_the_issues_3000_block_ladder_in_well_under_3_s():
    graph = build_graph(Graph.model_validate(ladder(3000)), "relu")
    t0 = time.perf_counter()
    sol = solve_geometric(graph, "relu")
    elapsed = time.perf_counter() - t0
    print(f"\ngeometric, 3,000-block ladder: {elapsed * 1000:.0f} ms (was 18-27 s)")
    assert len(sol.layers) == 3001
    assert elapsed < 3.0


def test_geometric_branch_gains_match_the_pass_per_layer_they_replace():
    # the old definition, one forward and one backward pass per layer between it and its
    # dominator, on a graph small enough for it: the segment pass must give the same ratios
    from sigprop.engine.methods import geometric as geo

    graph = build_graph(Graph.model_validate(ladder(12)), "relu")
    gains = geo._activation_gains(graph, geo._resolve("relu"), 0.5, [])
    layers = [nd for nd in graph.nodes if nd.kind == "affine"]
    w2, _ = geo._layer_weights(graph.nodes, layers, 2.0)
    rules = geo._rules(graph, gains, w2)
    cuts = geo._output_dominators(graph)
    for nd in layers:
        y = nd.index
        z = next(t for t in cuts if t >= y)
        if z == y:
            continue
        fwd, bwd = geo._segment_gains(graph, rules, y, z)
        m = [0.0] * graph.n
        m[y] = 1.0
        for v in graph.nodes[y + 1 : z + 1]:
            m[v.index] = sum(f * m[i] for i, (f, _) in zip(v.inputs, rules[v.index], strict=False) if i >= y)
        d = [0.0] * graph.n
        d[z] = 1.0
        for v in reversed(graph.nodes[y : z + 1]):
            for i, (_, b) in zip(v.inputs, rules[v.index], strict=False):
                if i >= y:
                    d[i] += b * d[v.index]
        assert fwd[0] == pytest.approx(m[z], rel=1e-14) and bwd[0] == pytest.approx(d[y], rel=1e-14)
        assert fwd[0] > 0 and bwd[0] > 0


def test_the_dominator_walk_is_not_quadratic_on_a_long_chain_meeting_its_start():
    chain, sums = 12_000, 4_000  # a walk one level at a time: 48 M steps, about 10 s
    preds = [[]] + [[i - 1] for i in range(1, chain)] + [[chain - 1, 0] for _ in range(sums)]
    t0 = time.perf_counter()
    idom, depth = _dominators(preds, len(preds))
    elapsed = time.perf_counter() - t0
    assert idom[chain:] == [0] * sums and depth[chain - 1] == chain - 1 and depth[chain] == 1
    assert elapsed < 1.0, elapsed


def test_dominators_agree_with_the_definition_on_random_dags():
    import random

    rng = random.Random(26)
    for _ in range(300):
        n = rng.randint(1, 40)
        preds = [sorted(rng.sample(range(v), min(v, rng.choice([1, 1, 2, 3])))) if v else [] for v in range(n)]
        idom, _ = _dominators(preds, n)
        for v in range(n):
            # d dominates v iff removing d disconnects v from the root (the sources)
            doms = {d for d in range(v) if not _reachable_without(preds, v, d)}
            expected = max(doms) if doms else n  # the nearest (latest in topological order) dominator
            assert idom[v] == expected, (preds, v)


def _reachable_without(preds: list[list[int]], v: int, cut: int) -> bool:
    stack, seen = [v], {v}
    while stack:
        u = stack.pop()
        if not preds[u]:
            return True
        for p in preds[u]:
            if p != cut and p not in seen:
                seen.add(p)
                stack.append(p)
    return False


def test_pass_through_sources_in_one_pass_agree_with_the_walk():
    from types import SimpleNamespace

    from sigprop.engine.graph.build import pass_sources
    from sigprop.schemas.ops import AFFINE, PASS, SUM

    kinds = [PASS, PASS, AFFINE, SUM]
    rng = np.random.default_rng(26)
    nodes = []
    for v in range(400):
        ins = [] if v == 0 else sorted(rng.choice(v, size=min(v, 2), replace=False).tolist())
        nodes.append(SimpleNamespace(index=v, kind=kinds[rng.integers(4)] if v else "source", inputs=ins))
    source = pass_sources(nodes)
    for v in range(len(nodes)):
        j = v
        while nodes[j].kind == PASS and nodes[j].inputs:
            j = nodes[j].inputs[0]
        assert source[v] == j
    chain = [SimpleNamespace(index=0, kind="source", inputs=[])]
    chain += [SimpleNamespace(index=v, kind=PASS, inputs=[v - 1]) for v in range(1, 100_000)]
    t0 = time.perf_counter()
    assert pass_sources(chain)[-1] == 0
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("method", ["tat", "dks"])
def test_deeply_nested_subnetworks_are_refused_by_their_price_not_maximized_for_minutes(method):
    # 1,000 mirrored skips: 1.5 M steps per subnetwork pass (tat took 16 s; 7,000 levels, under the
    # cost budget, would take about 15 minutes); refused after at most the step budget
    req = SolveRequest.model_validate(request(mirrored_skips(1000), method))
    t0 = time.perf_counter()
    with pytest.raises(SigpropError) as info:
        solve_canonical(prepare(req))
    elapsed = time.perf_counter() - t0
    assert info.value.code == "graph_too_large" and info.value.status == 413
    assert "nests" in info.value.message and "U-Net" in info.value.hint and "'eoc'" in info.value.hint
    assert elapsed < 3.0, elapsed


def test_methods_that_need_only_the_whole_network_solve_deeply_nested_graphs():
    graph = mirrored_skips(1000)
    for method in ("eoc", "geometric", "sparse_eoc"):
        answer = solve_canonical(prepare(SolveRequest.model_validate(request(graph, method))))
        assert answer.graph_summary.subnetworks_considered > 1000


def test_real_architectures_stay_far_under_the_step_budget():
    from sigprop.engine.network.subnetworks import STEPS_PER_COST, compile_subnetworks

    for graph in (ladder(3000), {"template": "resnet", "depth": 152}, {"template": "densenet", "depth": 201}):
        prep = prepare(SolveRequest.model_validate(request(graph, "tat")))
        program = compile_subnetworks(prep.graph)
        steps = sum(len(g.steps) for g in program.groups)
        cost = prep.graph.n + sum(len(nd.inputs) for nd in prep.graph.nodes)
        # 0.3-0.9 steps per node + edge: the budget (STEPS_PER_COST per node + edge) leaves room
        assert steps <= cost, (graph.get("template"), steps, cost)
        assert steps < STEPS_PER_COST * cost


def test_a_sum_of_3000_branches_is_refused_from_its_bytes_before_it_is_parsed():
    service = SolutionService(None, 1.0, 1.0, limits=Limits(max_depth=10_000, max_fan_in=1024, max_cost=50_000))
    body = json.dumps(request(fan_in(3000), "tat")).encode()  # 383 KB, cost 15,006: under the budget
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        with pytest.raises(SigpropError) as info:
            service.begin(body)
        times.append(time.perf_counter() - t0)
    assert info.value.code == "graph_too_large" and info.value.status == 413
    assert "at least 3000 inputs" in info.value.message and "SIGPROP_MAX_FAN_IN" in info.value.hint
    assert min(times) < 0.05, times


def refusal_time(service: SolutionService, body: bytes) -> float:
    t0 = time.perf_counter()
    with pytest.raises(SigpropError):
        service.begin(body)
    return time.perf_counter() - t0


def test_a_cold_solve_carries_its_exact_cost():
    graph = build_graph(Graph.model_validate(ladder(3)), "relu")
    assert graph_size(graph) == graph.n + sum(len(nd.inputs) for nd in graph.nodes) == 12 + 14


@pytest.mark.slow  # every method on every adversarial graph: about a minute (bench/cost_bench.py prints it)
@pytest.mark.parametrize("method", list(METHOD_REQUESTS))
def test_every_method_solves_the_adversarial_graphs_in_3_s_or_refuses_them_by_price_in_50_ms(method):
    settings = Settings()
    service = SolutionService(None, 1.0, 1.0, limits=settings.limits())
    cases = {
        "ladder 3000": ladder(3000),
        "ladder 6000": ladder(6000),
        "input ladder 3000": input_ladder(3000),
        "input ladder 10000": input_ladder(10_000),
        "sum of 1024": fan_in(1024),
        "concat of 1024": fan_in(1024, "concat"),
        "sum of 3000": fan_in(3000),
        "chain 10000": deep_chain(10_000),
        "late sums": late_sums(8000, 3000),
        "sums after identities": sums_after_identities(8000, 4000),
        "pool chain": pool_chain(12_000),
        "mirrored skips": mirrored_skips(7000),
    }
    report = []
    for label, graph in cases.items():
        body = json.dumps(request(graph, method)).encode()
        t0 = time.perf_counter()
        try:
            service.begin(body)
        except SigpropError as exc:
            elapsed = min(time.perf_counter() - t0, refusal_time(service, body))  # best of two: one hiccup is not cost
            report.append(f"{label}: refused in {elapsed * 1000:.1f} ms ({exc.code})")
            assert exc.status == 413 and elapsed < 0.05, (label, exc.code, elapsed)
            continue
        except AttributeError:  # admitted: it reached the (absent) cache
            pass
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            solve_request(request(graph, method))
            outcome = "ok"
        except SigpropError as exc:  # an answer too (e.g. an unreachable target), as long as it is a 4xx
            assert 400 <= exc.status < 500, exc
            outcome = exc.code
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        report.append(f"{label}: {elapsed:.2f} s, CPU {cpu:.2f} s ({outcome})")
        # the CPU time: on a shared machine the wall clock measures the neighbours (bench/README.md)
        assert cpu < 3.0, (label, elapsed, cpu)
    print(f"\n{method}: " + "; ".join(report))


# -- fair cold solves: lanes ----------------------------------------------------------------------


def _acquire_in_thread(lanes: Lanes, client, small: bool, out: list, timeout_s: float = 5.0) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(lanes.acquire(client, small, timeout_s)))
    t.start()
    return t


def _wait_for_waiters(lanes: Lanes, n: int) -> None:
    deadline = time.monotonic() + 5
    while lanes.waiting() < n and time.monotonic() < deadline:
        time.sleep(0.001)
    assert lanes.waiting() == n


def test_a_small_solve_takes_the_small_lane_while_large_ones_hold_and_queue_for_every_general_slot():
    lanes = Lanes(general=2, small=1, per_client=0)
    held = [lanes.acquire("a", False, 1) for _ in range(2)]
    assert [t.lane for t in held] == [GENERAL, GENERAL]
    queued: list = []
    threads = [_acquire_in_thread(lanes, "a", False, queued) for _ in range(4)]
    _wait_for_waiters(lanes, 4)
    small = lanes.acquire("b", True, 0.5)
    assert small is not None and small.lane == SMALL  # behind four queued large solves, at once
    assert lanes.acquire("c", False, 0.05) is None  # a large one from elsewhere waits its turn
    lanes.release(small)
    for t in held:
        lanes.release(t)
    for _ in range(2):  # the queue drains as slots are released
        deadline = time.monotonic() + 5
        while len(queued) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert len(queued) == 2 and all(t.lane == GENERAL for t in queued)
    for t in list(queued):
        lanes.release(t)
    for t in threads:
        t.join(5)
    for t in queued[2:]:
        lanes.release(t)
    assert lanes.free == {GENERAL: 2, SMALL: 1} and lanes.waiting() == 0


def test_one_clients_queue_of_large_solves_never_holds_every_general_slot():
    lanes = Lanes(general=2, small=0, per_client=1)
    first = lanes.acquire("a", False, 1)
    queued_a: list = []
    threads = [_acquire_in_thread(lanes, "a", False, queued_a) for _ in range(5)]
    _wait_for_waiters(lanes, 5)
    b = lanes.acquire("b", False, 0.5)  # a's five queued before b, but a is at its cap
    assert b is not None and b.lane == GENERAL
    assert queued_a == []
    lanes.release(first)  # a's next starts (first come, first served among a's)
    deadline = time.monotonic() + 5
    while not queued_a and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(queued_a) == 1
    lanes.release(b)
    time.sleep(0.05)
    assert len(queued_a) == 1, "a free slot must not go to a client at its cap"
    for _ in range(5):
        deadline = time.monotonic() + 5
        n = len(queued_a)
        lanes.release(queued_a[n - 1])
        while len(queued_a) == n and n < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
    for t in threads:
        t.join(5)
    assert len(queued_a) == 5 and lanes.waiting() == 0 and lanes.free[GENERAL] == 2


def test_small_solves_are_not_capped_per_client_and_unnamed_clients_are_not_capped():
    lanes = Lanes(general=2, small=1, per_client=1)
    tickets = [lanes.acquire("a", True, 0.5) for _ in range(3)]  # small lane, then both general slots
    assert sorted(t.lane for t in tickets) == [GENERAL, GENERAL, SMALL]
    for t in tickets:
        lanes.release(t)
    offline = [lanes.acquire(None, False, 0.5) for _ in range(2)]
    assert all(t is not None for t in offline)
    for t in offline:
        lanes.release(t)


def test_a_waiter_that_times_out_leaves_no_trace():
    lanes = Lanes(general=1)
    held = lanes.acquire("a", False, 1)
    assert lanes.acquire("b", False, 0.02) is None
    assert lanes.waiting() == 0
    lanes.release(held)
    assert lanes.free[GENERAL] == 1 and lanes.acquire("b", False, 0.1) is not None


def test_a_small_cold_solve_answers_at_once_while_another_clients_large_solves_hold_the_pool():
    pool = SolverPool(1, small=1, per_client=1)
    try:
        pool.warm()
        heavy = ladder_request(10_000)  # seconds of work: killed at its deadline below
        codes: list[str] = []

        def large() -> None:
            try:
                pool.call(solve_request, (heavy,), 2.5, client="a")
                codes.append("200")
            except SigpropError as exc:
                codes.append(exc.code)

        threads = [threading.Thread(target=large) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while pool.lanes.waiting() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pool.lanes.waiting() == 2 and pool.lanes.free[GENERAL] == 0  # one runs, two queue
        small = mlp(5, eta=0.37)
        t0 = time.perf_counter()
        answer = json.loads(pool.call(solve_request, (small,), 10, client="b", small=True))
        elapsed = time.perf_counter() - t0
        assert answer["method"] == "tat"
        print(f"\nsmall solve beside 3 large ones from another client: {elapsed * 1000:.0f} ms")
        assert elapsed < 1.0, elapsed
        for t in threads:
            t.join(10)
        # each large one answers or is stopped at its deadline (running, or still queued behind a's cap)
        assert len(codes) == 3 and set(codes) <= {"200", "solve_timeout"}, codes
    finally:
        pool.shutdown()


# -- over HTTP: the issue's "done when" ------------------------------------------------------------


@pytest.mark.slow  # a latency measurement over HTTP while six large solves run: about 20 s
def test_a_5_layer_mlp_cold_solve_answers_in_1_s_while_another_client_runs_six_large_solves(tmp_path):
    svc = start_service(
        tmp_path,
        {
            "SIGPROP_DATA_DIR": str(tmp_path / "d"),
            "SIGPROP_TRUSTED_PROXIES": "127.0.0.1",  # X-Forwarded-For names the two clients
            "SIGPROP_RATE_LIMIT_COLD_SOLVES": "0",
            "SIGPROP_SOLVE_TIMEOUT_S": "20",
            # large enough for the 10,000-block ladders, which take seconds each: the queue is long
            "SIGPROP_MAX_SOLVE_COST": "80000",
        },
    )
    try:
        rounds = {
            "six 3,000-block geometric ladders": [
                json.dumps(request(ladder(3000, width=8 + i), "geometric")).encode() for i in range(6)
            ],
            "six 10,000-block TAT ladders": [
                json.dumps(ladder_request(10_000, eta=0.2 + 0.01 * i)).encode() for i in range(6)
            ],
        }
        for r, (what, bodies) in enumerate(rounds.items()):
            codes: list[int] = []

            def heavy(body: bytes) -> None:
                with httpx.Client(base_url=svc.base_url, timeout=60) as c:
                    headers = {"content-type": "application/json", "X-Forwarded-For": "10.0.0.1"}
                    codes.append(c.post(SOLVE, content=body, headers=headers).status_code)

            threads = [threading.Thread(target=heavy, args=(b,)) for b in bodies]
            for t in threads:
                t.start()
            time.sleep(0.5)  # the large solves are in flight and queued
            with svc.client(timeout=30) as c:
                t0 = time.perf_counter()
                resp = c.post(SOLVE, json=mlp(5, eta=0.31 + 0.01 * r), headers={"X-Forwarded-For": "10.0.0.2"})
                elapsed = time.perf_counter() - t0
            busy = sum(t.is_alive() for t in threads)
            for t in threads:
                t.join(120)
            print(
                f"\n{what}: 5-layer MLP cold solve from another client {elapsed * 1000:.0f} ms "
                f"({busy} of 6 still running after it); their answers {sorted(codes)}"
            )
            assert resp.status_code == 200 and resp.json()["cached"] is False, resp.text[:300]
            assert elapsed < 1.0, elapsed
            assert set(codes) <= {200, 503}, codes  # 503: queued behind its own client past the timeout
    finally:
        svc.stop()


def test_geometric_names_moments_past_a_doubles_range_instead_of_blaming_the_input_moment():
    # 2,000 dense layers with no activation between them: the second moment doubles at each (c = 2),
    # past 1e308 by layer 1,024, so the multipliers cannot balance the gammas
    nodes = [{"id": "x", "op": "input", "shape": [8]}]
    for i in range(2000):
        nodes.append({"id": f"d{i}", "op": "dense", "inputs": [nodes[-1]["id"]], "units": 8})
    nodes.append({"id": "out", "op": "output", "inputs": ["d1999"]})
    with pytest.raises(SigpropError) as info:
        solve_geometric(build_graph(Graph.model_validate({"nodes": nodes}), "relu"), "relu")
    assert info.value.code == "invalid_graph" and info.value.status == 422
    assert "double's range" in info.value.message and "[0.8, 0.6]" in info.value.hint


def test_a_small_body_naming_a_large_template_is_built_in_a_solver_process():
    # six 10,000-layer MLP templates built in the API process held another client's MLP-5 cold
    # solve for 1.1-1.4 s (GIL); sized from their parameters, they go to the solver processes
    from sigprop.preparation import prepare_payload

    from .test_preparation import InThreadPool, Store

    pool = InThreadPool()
    service = SolutionService(Store(), 1.0, 1.0, solver=pool, small_cost=2000)
    deep = json.dumps({"graph": {"template": "mlp", "depth": 10_000}, "method": "eoc", "activation": "tanh"})
    assert isinstance(service.begin(deep.encode()), solutions.ColdSolve)
    assert [fn for fn, _, _ in pool.calls] == [prepare_payload]
    pool.calls.clear()
    service.begin(json.dumps(mlp(5)).encode())
    assert not pool.calls  # small: built here
    for junk in (b'{"graph": {"template": "nope"}, "method": "eoc"}', b'[{"template"}'):
        with pytest.raises(SigpropError):  # the thread says why
            service.begin(junk)
    assert not pool.calls
