"""One preparation per request (issue 25): the API admits, prices and prepares a request once, the
solver process receives the prepared form, limits travel as one ``Limits`` object built from the
settings, and the engine reads no settings."""

from __future__ import annotations

import ast
import dataclasses
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from sigprop import preparation
from sigprop.api import solutions
from sigprop.api.solutions import SolutionService
from sigprop.engine.limits import Limits
from sigprop.engine.solve import Prepared, prepare, solve_canonical
from sigprop.engine.templates import expand as templates
from sigprop.errors import SigpropError
from sigprop.requests import parse_solve_request
from sigprop.settings import Settings, offline_limits

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "service" / "engine"


def mlp(depth: int = 100, **targets) -> dict:
    return {
        "graph": {"template": "mlp", "depth": depth, "width": 512},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": targets or {"eta": 0.3},
    }


def raw_mlp(depth: int) -> dict:
    """The template's graph written node by node (ids of our own): a body of a few KB per layer."""
    template = templates.Template.model_validate({"template": "mlp", "depth": depth})
    graph = json.loads(templates.expand_template(template).model_dump_json(by_alias=True, exclude_none=True))
    return {**mlp(depth), "graph": graph}


class InThreadPool:
    """A ``SolverPool`` stand-in that runs each call here, through a pickle round trip as the
    pipe to a solver process would, and records what crossed."""

    def __init__(self):
        self.calls: list[tuple] = []

    def call(self, fn, args, wait_s, timeout_s=None, what="the solve", *, client=None, small=False):
        sent = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        self.calls.append((fn, args, len(sent)))
        fn, args = pickle.loads(sent)
        return pickle.loads(pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL))


class Store:
    """The solution cache as far as ``SolutionService`` uses it on a cold solve."""

    max_bytes = 0  # no byte bound

    def __init__(self):
        self.records = {}

    def get_answer(self, key):
        rec = self.records.get(key)
        return None if rec is None else rec.answer

    def acquire(self, key, ttl_s):
        return "token"

    def release(self, key, token):
        pass

    def put(self, rec):
        self.records[rec.key] = rec


def counting(monkeypatch, module, name: str) -> list:
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_no_engine_module_reads_the_settings():
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.split(".")[-1] in ("settings", "pydantic_settings") for n in names), (path.name, names)


def test_preparing_and_solving_loads_no_settings():
    code = (
        "import sys\n"
        "from sigprop.engine.solve import prepare, solve_canonical\n"
        "from sigprop.engine.limits import Limits\n"
        "from sigprop.requests import parse_solve_request\n"
        "r = parse_solve_request({'graph': {'template': 'mlp', 'depth': 5}, 'method': 'tat',"
        " 'activation': 'leaky_relu', 'targets': {'eta': 0.5}})\n"
        "solve_canonical(prepare(r, Limits(max_nodes=50)))\n"
        "print(sorted(m for m in sys.modules if m.endswith('settings')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_engine_takes_its_node_limit_from_the_limits_it_is_given(monkeypatch):
    monkeypatch.setenv("SIGPROP_MAX_NODES", "5")  # the engine never sees it
    request = parse_solve_request(mlp(3))  # 9 nodes
    assert prepare(request).graph.n == 9
    with pytest.raises(SigpropError) as info:
        prepare(request, Limits(max_nodes=8))
    assert info.value.code == "graph_too_large" and "at most 8 nodes" in info.value.hint


def test_offline_and_service_limits_come_from_the_settings(monkeypatch):
    from sigprop import settings

    monkeypatch.setenv("SIGPROP_MAX_NODES", "8")
    settings.get_node_limit.cache_clear()
    try:
        assert offline_limits() == Limits(max_nodes=8)
        with pytest.raises(SigpropError) as info:
            preparation.prepare_data(mlp(3), offline_limits())
        assert info.value.code == "graph_too_large" and "9 nodes" in info.value.message
        monkeypatch.setenv("SIGPROP_MAX_NODES", "zero")
        settings.get_node_limit.cache_clear()
        with pytest.raises(SigpropError) as info:
            offline_limits()
        assert info.value.code == "invalid_request" and "SIGPROP_MAX_NODES" in info.value.message
    finally:
        settings.get_node_limit.cache_clear()
    s = Settings(max_nodes=7, max_depth=6, max_fan_in=5, max_solve_cost=4)
    assert s.limits() == Limits(7, 6, 5, 4)


def test_a_prepared_request_pickles_to_an_equal_one():
    prep = prepare(parse_solve_request(raw_mlp(4)))
    back = pickle.loads(pickle.dumps(prep, protocol=pickle.HIGHEST_PROTOCOL))
    assert isinstance(back, Prepared) and back.key == prep.key
    # the wire graph stays behind (its built form crossed); the rest of the request crosses
    assert back.request.graph is None and back.request.model_dump(exclude={"graph"}) == prep.request.model_dump(
        exclude={"graph"}
    )
    assert back.graph == prep.graph and back.ids == prep.ids
    assert solve_canonical(back).to_json() == solve_canonical(prep).to_json()


def test_a_cold_request_is_prepared_once_and_the_solver_gets_the_prepared_form(monkeypatch):
    pool = InThreadPool()
    service = SolutionService(Store(), 60.0, 30.0, solver=pool, small_cost=2000, limits=Settings().limits())
    spec = templates.TEMPLATES["mlp"]
    sizes = counting(monkeypatch, spec, "size") if not dataclasses.is_dataclass(spec) else []
    if dataclasses.is_dataclass(spec):  # a frozen dataclass: replace the entry with a counting copy
        calls = sizes

        def size(t, _size=spec.size):
            calls.append(t)
            return _size(t)

        monkeypatch.setitem(templates.TEMPLATES, "mlp", dataclasses.replace(spec, size=size))
    parses = counting(monkeypatch, preparation, "parse_solve_request")
    builds = counting(monkeypatch, preparation, "prepare")
    body = json.dumps(mlp(100, eta=0.91)).encode()
    step = service.begin(body)
    assert isinstance(step, solutions.ColdSolve)
    outcome = service.finish(step)
    assert not outcome.cached and json.loads(outcome.body)["key"] == step.parsed.key
    assert (len(sizes), len(parses), len(builds)) == (1, 1, 1)
    [(fn, args, _)] = pool.calls  # the solve alone crossed: the request was prepared here
    assert fn is solutions.solve_prepared and isinstance(args[0], Prepared) and args[0].key == step.parsed.key
    # the same answer as solving the body from scratch
    assert json.loads(outcome.body) == json.loads(SolutionService(Store(), 60.0, 30.0).solve(body).body)


def test_a_large_body_crosses_to_a_solver_process_once(monkeypatch):
    pool = InThreadPool()
    service = SolutionService(Store(), 60.0, 30.0, solver=pool, small_cost=2000, limits=Settings().limits())
    body = json.dumps(raw_mlp(300)).encode()
    assert len(body) > solutions._IN_THREAD_BYTES
    parses = counting(monkeypatch, solutions, "load_json")  # the API process's own parse: none
    outcome = service.solve(body)
    assert not outcome.cached and not parses
    (prep_fn, prep_args, _), (solve_fn, solve_args, solve_bytes) = pool.calls
    assert prep_fn is preparation.prepare_payload and prep_args[0] == body
    assert solve_fn is solutions.solve_prepared and isinstance(solve_args[0], Prepared)
    assert solve_bytes < len(body)  # the prepared form, not the body again


def test_a_small_body_naming_a_large_template_is_prepared_in_a_solver_process_once(monkeypatch):
    pool = InThreadPool()
    service = SolutionService(Store(), 60.0, 30.0, solver=pool, small_cost=2000, limits=Settings().limits())
    builds = counting(monkeypatch, preparation, "prepare")
    outcome = service.solve(json.dumps(mlp(2000)).encode())
    assert not outcome.cached
    (prep_fn, prep_args, _), (solve_fn, solve_args, _) = pool.calls
    assert prep_fn is preparation.prepare_payload and isinstance(prep_args[0], preparation.Admitted)
    assert prep_args[0].template is not None  # its size crossed with it: not computed again there
    assert solve_fn is solutions.solve_prepared and solve_args[0].graph.n == 4003
    assert len(builds) == 1


@pytest.mark.parametrize(
    "limits, graph, words",
    [
        (Limits(max_nodes=10), {"template": "mlp", "depth": 5}, "expands to 13 nodes"),
        (Limits(max_depth=4), {"template": "mlp", "depth": 5}, "5 nonlinear layers"),
        (Limits(max_cost=20), {"template": "mlp", "depth": 5}, "a cost of 25"),
        (Limits(max_fan_in=2), {"template": "densenet", "depth": 121}, "inputs, more than"),
        (Limits(max_nodes=2), {"nodes": [{"id": "a", "op": "input", "shape": [4]}] * 3}, "3 nodes"),
        (
            Limits(max_fan_in=2),
            {"nodes": [{"id": "s", "op": "sum", "inputs": ["a", "b", "c"]}]},
            "sum node 's' has 3 inputs",
        ),
    ],
)
def test_admission_refuses_from_the_json_before_anything_is_built(monkeypatch, limits, graph, words):
    def never(*_args, **_kwargs):
        raise AssertionError("built or validated before admission refused it")

    monkeypatch.setattr(preparation, "parse_solve_request", never)
    with pytest.raises(SigpropError) as info:
        preparation.prepare_data({**mlp(), "graph": graph}, limits)
    assert info.value.code == "graph_too_large" and info.value.status == 413
    assert words in info.value.message


class LockingStore(Store):
    """``Store`` with a real single-flight lock and a count of writes."""

    def __init__(self):
        super().__init__()
        self.held: set[str] = set()
        self.puts = 0
        self.health = None

    def acquire(self, key, ttl_s):
        if key in self.held:
            return None
        self.held.add(key)
        return "token"

    def release(self, key, token):
        self.held.discard(key)

    def put(self, rec):
        self.puts += 1
        super().put(rec)


def test_a_cold_answer_is_stored_inside_the_single_flight():
    store = LockingStore()
    service = SolutionService(store, 60.0, 30.0)
    body = json.dumps(mlp(20)).encode()
    first = service.finish(service.begin(body))
    assert not first.cached and store.puts == 1 and not store.held  # stored, then the lock released
    second = service.solve(body)
    assert second.cached and store.puts == 1


def test_a_store_refusing_writes_is_written_before_the_answer_goes():
    class Refusing(LockingStore):
        def put(self, rec):
            from sigprop.storage import StorageFull

            raise StorageFull("the solution cache refuses writes (full or read-only): not stored")

    class Degraded:
        degraded = True

        def listen(self, fn):
            pass

    store = Refusing()
    store.health = Degraded()
    service = SolutionService(store, 60.0, 30.0)
    outcome = service.finish(service.begin(json.dumps(mlp(20)).encode()))
    assert not store.held
    assert any("not stored" in w for w in json.loads(outcome.body)["warnings"])


def test_a_cold_solve_whose_wait_gave_up_runs_on_to_its_store():
    import asyncio
    import threading
    import time

    from sigprop.api.deps import Offload
    from sigprop.api.solutions import SolveOutcome

    stored = threading.Event()

    def late_answer():  # SolutionService.finish: the solve, then its store write, then the answer
        time.sleep(0.2)
        stored.set()
        return SolveOutcome("{}", False, "k")

    offload = Offload(0.05)
    try:
        with pytest.raises(SigpropError) as info:
            asyncio.run(offload._timed(0.05, offload.cold, late_answer))
        assert info.value.code == "solve_timeout"
        assert stored.wait(5)  # the thread ran on: the answer's store write (and lock release) still ran
    finally:
        offload.shutdown()
