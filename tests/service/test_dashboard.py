"""The dashboard without a browser: every page over HTTP, with the app in this process
(httpx through Starlette's TestClient) on both cache backends (the embedded SQLite file and a
private redis-server), solutions made by POST /v1/solve plus records written straight into the
cache (many, for paging; one with a script tag in its ids and activation, for escaping), and
validations written straight into the validation store (results of a real tiny training run).
"""

from __future__ import annotations

import html
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from sigprop.api.app import create_app
from sigprop.api.auth import digest, tenant_of
from sigprop.api.validations import OWNER
from sigprop.dashboard import views
from sigprop.dashboard.router import form_catalog
from sigprop.dashboard.router import router as dashboard_router
from sigprop.engine.solve import METHOD_TARGETS
from sigprop.engine.templates.expand import describe_templates
from sigprop.settings import Settings
from sigprop.storage import RedisValidationStore, SqliteValidationStore, new_record

from ..dashboard_fixtures import EVIL, EVIL_KEY, evil_record
from ..inprocess import basic
from ..service_fixtures import assert_error, start_redis

API_KEY = "dashboard-test-key"
# the dashboard shows stored submissions: with keys configured it needs one (issue 35), sent as
# a browser does (HTTP Basic, the key as the password); validations are their submitter's only
SIGNED_IN = basic(API_KEY)
TENANT = tenant_of(digest(API_KEY).hex())


def owned(request: dict) -> dict:
    """A stored validation request as one submitted with ``API_KEY`` stores it."""
    return {**request, OWNER: TENANT}


SOLVES = {
    "tat_lrelu": {
        "graph": {"template": "mlp", "depth": 12, "width": 16},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.8},
    },
    "tat_softplus": {
        "graph": {"template": "resnet", "depth": 18, "shortcut_weight": 0.8},
        "method": "tat",
        "activation": "softplus",
        "targets": {"tau": 0.3},
    },
    "dks": {
        "graph": {"template": "mlp", "depth": 8, "width": 16},
        "method": "dks",
        "activation": "tanh",
        "targets": {"zeta": 1.5},
    },
    "eoc": {"graph": {"template": "cnn", "depth": 6, "width": 8}, "method": "eoc", "activation": "tanh"},
    "sparse": {
        "graph": {"template": "mlp", "depth": 6, "width": 16},
        "method": "sparse_eoc",
        "activation": "crelu",
        "targets": {"sparsity": 0.7, "v_slope": 0.7},
    },
    "geometric": {"graph": {"template": "cnn", "depth": 6, "width": 8}, "method": "geometric", "activation": "relu"},
}
FILLERS = 60  # extra records, so that listing pages through several pages


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("dash-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_results():
    """Results of a real (tiny) validation run: what a finished validation holds."""
    pytest.importorskip("torch")
    from sigprop.engine.solve import solve
    from sigprop.schemas.solve import SolveRequest
    from sigprop.worker.training import run_validation

    req = {
        "graph": {"template": "mlp", "depth": 3, "width": 8, "input_shape": [64], "classes": 10},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.5},
    }
    return run_validation(
        {"dataset": "digits", "steps": 12, "batch_size": 16, "baselines": ["he"]},
        req["graph"],
        solve(SolveRequest.model_validate(req)),
        device="cpu",
    )


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def dash(request, tmp_path_factory, redis_server, tiny_results):
    """A running app with real solutions, fillers, the planted record and two validations."""
    tmp = tmp_path_factory.mktemp(f"dash-{request.param}")
    url = redis_server.url if request.param == "redis" else None
    app = create_app(Settings(data_dir=tmp, redis_url=url, api_keys=API_KEY))
    with TestClient(app, headers=SIGNED_IN) as client:
        keys = {}
        for name, body in SOLVES.items():
            r = client.post("/v1/solve", json=body)
            assert r.status_code == 200, r.text
            keys[name] = r.json()["key"]
        cache = app.state.cache
        fillers = plant_fillers(cache, keys)
        cache.put(evil_record())
        store = (
            RedisValidationStore(redis.Redis.from_url(url))
            if url
            else SqliteValidationStore(Path(tmp) / "solutions.sqlite3")
        )
        finished, running = plant_validations(store, keys["tat_lrelu"], tiny_results)
        yield SimpleNamespace(
            client=client,
            keys=keys,
            cache=cache,
            store=store,
            backend=request.param,
            fillers=fillers,
            finished=finished,
            running=running,
            app=app,
        )
        store.close()


def plant_fillers(cache, keys: dict) -> list[str]:
    """Copies of the real answers under new keys, one a second back in time (older than the solves)."""
    out = []
    sources = []
    for name in ("tat_lrelu", "eoc", "dks"):
        rec = cache.get(keys[name], count_hit=False)
        sources.append(rec)
    now = time.time()
    for i in range(FILLERS):
        src = sources[i % len(sources)]
        key = f"{i:04x}" + "f" * 60
        rec = new_record(key, src.answer.replace(src.key, key), src.request, src.ids, src.method, src.activation)
        rec.created = now - 1000 - i
        cache.put(rec)
        out.append(key)
    return out


def plant_validations(store, key: str, results: dict) -> tuple[str, str]:
    request = owned({"key": key, "dataset": "digits", "steps": 12, "batch_size": 16, "baselines": ["he"]})
    finished, running = "a" * 32, "b" * 32
    store.create(finished, key, request, time.time() - 5)
    assert store.start(finished, "cpu") == 1
    assert store.finish(finished, results)
    store.create(running, key, request, time.time())
    assert store.start(running, "cpu") == 1
    store.set_progress(running, {"step": 3, "total": 12, "run": "solved"})
    return finished, running


# -- helpers ------------------------------------------------------------------------------------


def page(client, path: str, status: int = 200) -> str:
    r = client.get(path)
    assert r.status_code == status, (path, r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("text/html"), r.headers["content-type"]
    return r.text


def listed_keys(text: str) -> list[str]:
    return re.findall(r'href="/dashboard/solutions/([0-9a-f]{64})"', text)


def page_data(text: str):
    m = re.search(r'<script type="application/json" id="page-data">(.*?)</script>', text, re.S)
    assert m, "no page data"
    return json.loads(m.group(1))


def all_summaries(cache) -> list[dict]:
    """Every stored solution's summary, newest first, the slow way (whole records)."""
    total, records = cache.list(0, 500, None, None)
    assert total == len(records)
    return [r.summary() for r in records]


# -- the list page --------------------------------------------------------------------------------


def test_list_page_newest_first_with_summaries(dash):
    text = page(dash.client, "/dashboard")
    expected = [s["key"] for s in all_summaries(dash.cache)]
    assert listed_keys(text) == expected[:50]
    assert f"1–50 of {len(expected)} solutions" in text
    row = re.search(rf"{dash.keys['tat_softplus'][:12]}….*?</tr>", text, re.S).group(0)
    cells = [html.unescape(c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
    summary = next(s for s in all_summaries(dash.cache) if s["key"] == dash.keys["tat_softplus"])
    g = summary["graph_summary"]
    # the cells after the key's: method, activation, targets, depth, nodes, sums, created, hits
    assert cells[:6] == ["tat", "softplus", "tau = 0.3", str(g["depth"]), str(g["nodes"]), str(g["sums"])]
    assert cells[6].endswith("UTC") and cells[7] == "0"


def test_pages_through_every_solution_once(dash):
    expected = [s["key"] for s in all_summaries(dash.cache)]
    seen, offset = [], 0
    while True:
        text = page(dash.client, f"/dashboard?limit=25&offset={offset}")
        seen += listed_keys(text)
        nxt = re.search(r'rel="next" href="([^"]+)"', text)
        if not nxt:
            break
        assert f"offset={offset + 25}" in html.unescape(nxt.group(1))
        offset += 25
    assert seen == expected
    last = page(dash.client, "/dashboard?limit=25&offset=25")
    assert 'rel="prev"' in last and 'rel="first"' in last and f"26–50 of {len(expected)}" in last
    past = page(dash.client, "/dashboard?offset=100000")
    assert "past the end" in past and not listed_keys(past)


@pytest.mark.parametrize(
    "query, keep",
    [
        ("method=eoc", lambda s: s["method"] == "eoc"),
        ("activation=tanh", lambda s: s["activation"] == "tanh"),
        ("method=dks&activation=tanh", lambda s: s["method"] == "dks" and s["activation"] == "tanh"),
        ("method=tat&activation=tanh", lambda s: False),
        ("q=sparse_eoc", lambda s: s["method"] == "sparse_eoc"),
        ("q=SOFTPLUS", lambda s: s["activation"] == "softplus"),
        ("q=000", lambda s: s["key"].startswith("000")),
        ("q=00&method=eoc", lambda s: s["key"].startswith("00") and s["method"] == "eoc"),
        ("q=00&method=dks&activation=tanh", lambda s: s["key"].startswith("00") and s["method"] == "dks"),
        ("q=not-a-thing", lambda s: False),
    ],
)
def test_filters_and_search(dash, query, keep):
    expected = [s["key"] for s in all_summaries(dash.cache) if keep(s)]
    text = page(dash.client, f"/dashboard?limit=200&{query}")
    assert listed_keys(text) == expected
    if not expected:
        assert "No solutions match" in text
    if query == "q=not-a-thing":
        assert "neither a key prefix" in text


def test_search_by_whole_key(dash):
    key = dash.keys["sparse"]
    assert listed_keys(page(dash.client, f"/dashboard?q={key}")) == [key]
    assert listed_keys(page(dash.client, f"/dashboard?q={key}0")) == []


def test_filter_choices_count_what_is_stored(dash):
    text = page(dash.client, "/dashboard")
    summaries = all_summaries(dash.cache)
    for method in {s["method"] for s in summaries}:
        n = sum(s["method"] == method for s in summaries)
        assert f'<option value="{method}">{method} ({n})</option>' in text
    assert '<option value="eoc">eoc (21)</option>' in text  # 1 solve + 20 fillers


def test_fast_summaries_equal_the_records(dash):
    """``list_summaries`` (fields cut out of the answer without parsing it) gives what
    ``Record.summary()`` gives, for every filter and prefix."""
    slow = all_summaries(dash.cache)
    total, fast = dash.cache.list_summaries(0, 500)
    assert total == len(slow) and fast == slow
    for method, activation, prefix in [
        ("tat", None, None),
        (None, "tanh", None),
        ("dks", "tanh", None),
        (None, None, "0"),
        ("eoc", None, "00"),
        (None, None, EVIL_KEY[:5]),
    ]:
        want = [
            s
            for s in slow
            if (not method or s["method"] == method)
            and (not activation or s["activation"] == activation)
            and (not prefix or s["key"].startswith(prefix))
        ]
        total, got = dash.cache.list_summaries(0, 500, method, activation, prefix)
        assert (total, got) == (len(want), want), (method, activation, prefix)
        total, page_ = dash.cache.list_summaries(1, 2, method, activation, prefix)
        assert (total, page_) == (len(want), want[1:3])
    counts = dash.cache.counts("method", views.METHODS)
    assert counts == {m: sum(s["method"] == m for s in slow) for m in {s["method"] for s in slow} if m in views.METHODS}


def test_summary_part_reads_flat_objects():
    answer = json.dumps(
        {
            "key": "k",
            "activation": 'x"targets":{"eta":1}',
            "targets": {"eta": 0.9},
            "graph_summary": {"nodes": 3, "depth": 1},
            "c_map": {"c": [0]},
        },
        separators=(",", ":"),
    )
    from sigprop.storage.records import summary_part

    assert summary_part(answer, "targets") == {"eta": 0.9}
    assert summary_part(answer, "graph_summary") == {"nodes": 3, "depth": 1}
    assert summary_part(answer, "missing") is None
    assert summary_part('{"targets":{"eta":', "targets") is None


# -- the solution page ----------------------------------------------------------------------------


def test_solution_page_tat_leaky_relu(dash):
    key = dash.keys["tat_lrelu"]
    text = page(dash.client, f"/dashboard/solutions/{key}")
    answer = dash.client.get(f"/v1/solutions/{key}").json()["answer"]
    assert "<h1>tat · leaky_relu</h1>" in text
    assert f"{answer['negative_slope']:.8g}" in text and "negative_slope" in text
    plots = page_data(text)
    names = [s["name"] for s in plots["c_map"]["series"]]
    assert names[:2] == ["identity (C(c) = c)", "solved network (global C map)"] and "untransformed network" in names
    series = {s["name"]: s["y"] for s in plots["c_map"]["series"]}
    assert series["untransformed network"] == answer["c_map"]["untransformed"]
    assert series["solved network (global C map)"] == answer["c_map"]["global"]
    assert plots["c_map"]["c"] == answer["c_map"]["c"]
    assert "the answer&#39;s own" in text
    # the diagram: one node per graph node, one tooltip naming each weighted layer
    svg = text[text.index('<svg id="graph-svg"') :]
    nodes_svg = svg[svg.index('<g class="nodes">') : svg.index("</g>")]
    assert nodes_svg.count("<path ") == answer["graph_summary"]["nodes"]
    for layer in answer["layers"]:
        assert f"<title>{layer['id']}\nop: dense" in text
    # the validations of this solution, newest first
    assert text.index(f'/dashboard/validations/{dash.running}"') < text.index(
        f'/dashboard/validations/{dash.finished}"'
    )


def test_solution_page_computes_the_untransformed_map(dash):
    """TAT smooth answers carry no untransformed map: the page computes it with the engine."""
    key = dash.keys["tat_softplus"]
    text = page(dash.client, f"/dashboard/solutions/{key}")
    series = {s["name"]: s["y"] for s in page_data(text)["c_map"]["series"]}
    assert "computed here with the engine" in text
    untransformed = series["untransformed network"]
    assert untransformed[-1] == pytest.approx(1.0)
    # plain softplus has a large mean, so deep networks of it map every correlation close to 1
    assert min(untransformed) > 0.9 > min(series["solved network (global C map)"])
    assert "<li>" in text and "max_pool" in text  # the answer's warnings


def test_untransformed_map_is_skipped_for_huge_graphs(dash):
    record = dash.client.get(f"/v1/solutions/{dash.keys['dks']}").json()
    panel = views.c_map_panel("not-memoized", record["answer"], record["request"], max_nodes=5)
    assert "not computed here" in panel["notes"][0]
    assert [s["name"] for s in panel["series"]] == [
        "identity (C(c) = c)",
        "solved network (global C map)",
        "one layer (local C map)",
    ]


def test_solution_page_eoc_sparse_geometric(dash):
    eoc = page(dash.client, f"/dashboard/solutions/{dash.keys['eoc']}")
    assert "does not transform the activation" in eoc and "sigma_w2" in eoc

    sparse = page(dash.client, f"/dashboard/solutions/{dash.keys['sparse']}")
    answer = dash.client.get(f"/v1/solutions/{dash.keys['sparse']}").json()["answer"]
    vm = page_data(sparse)["v_map"]
    assert vm["q"] == answer["v_map"]["q"] and vm["v"] == answer["v_map"]["v"]
    assert vm["fixed_points"] == answer["fixed_points"]
    assert vm["stable"] == [fp["q"] for fp in answer["fixed_points"] if fp["stable"] and fp["q"] <= max(vm["q"])]
    assert 'id="v-map"' in sparse and "Fixed points of V" in sparse

    geometric = page(dash.client, f"/dashboard/solutions/{dash.keys['geometric']}")
    answer = dash.client.get(f"/v1/solutions/{dash.keys['geometric']}").json()["answer"]
    gr = page_data(geometric)["gr"]
    assert gr["gamma"] == [la["gamma"] for la in answer["layers"]] and gr["alpha"] == [
        la["alpha"] for la in answer["layers"]
    ]
    assert "This answer has no C map" in geometric and 'id="gr-plot"' in geometric


def test_diagram_layout():
    nodes = [
        {"id": "x", "op": "input", "shape": [4]},
        {"id": "d", "op": "dense", "inputs": ["x"]},
        {"id": "a", "op": "activation", "inputs": ["d"]},
        {"id": "e", "op": "dense", "inputs": ["a"]},
        {"id": "s", "op": "sum", "inputs": ["d", "e"]},
        {"id": "o", "op": "output", "inputs": ["s"]},
    ]
    g = views.diagram(nodes)
    assert [n["x"] for n in g["nodes"]] == sorted(n["x"] for n in g["nodes"])  # one level per step of depth
    assert len({n["x"] for n in g["nodes"]}) == 6 and g["levels"] == 6
    assert g["arcs"].count("Q") == 1  # d -> s skips two levels: drawn as an arc
    assert g["lines"].count("M") == 5
    assert g["nodes"][4]["shape"] == "sum" and g["nodes"][0]["shape"] == "diamond"
    assert all(re.fullmatch(r"[MmLlHhVvAaZz0-9., -]+", n["d"]) for n in g["nodes"])  # numbers only
    # a cycle (never valid, but a stored record may be anything) is left out, not looped on
    cyclic = nodes + [{"id": "p", "op": "dense", "inputs": ["q"]}, {"id": "q", "op": "dense", "inputs": ["p"]}]
    g = views.diagram(cyclic)
    assert g["shown"] == 6 and "cycle" in g["notes"][0]
    # a graph over the cap: the first levels, whole
    chain = [{"id": "n0", "op": "input"}] + [
        {"id": f"n{i}", "op": "dense", "inputs": [f"n{i - 1}"]} for i in range(1, 50)
    ]
    g = views.diagram(chain, max_nodes=20)
    assert g["shown"] == 20 and g["count"] == 50 and "(levels 0 to 19 of 50)" in g["notes"][0]
    wide = [{"id": "i", "op": "input"}] + [{"id": f"d{k}", "op": "dense", "inputs": ["i"]} for k in range(3000)]
    g = views.diagram(wide, max_nodes=2000)  # one level too wide for the cap: part of it
    assert g["shown"] == 2000 and "(levels 0 to 1 of 2)" in g["notes"][0]


# -- escaping ----------------------------------------------------------------------------------


def assert_escaped(text: str) -> None:
    assert EVIL not in text and "alert(1)</script>" not in text
    assert html.escape(EVIL, quote=False) in text  # shown, as text
    scripts = re.findall(r"<script\b[^>]*>(.*?)</script>", text, re.S)
    assert len(scripts) == text.count("<script")  # every script element closes where it should
    for body in scripts:
        assert "<" not in body  # embedded JSON has < > & escaped (\u003c ...)


def test_a_record_with_a_script_tag_is_shown_as_text(dash):
    listing = page(dash.client, f"/dashboard?q={EVIL_KEY[:6]}")
    assert listed_keys(listing) == [EVIL_KEY]
    assert_escaped(listing)
    solution = page(dash.client, f"/dashboard/solutions/{EVIL_KEY}")
    assert_escaped(solution)
    assert f"<title>{html.escape(EVIL, quote=False)}\nop: dense" in solution  # the node's tooltip
    data = page_data(solution)  # the JSON still reads back to the real values
    assert data["c_map"]["series"][1]["name"] == "solved network (global C map)"
    assert_escaped(page(dash.client, "/dashboard?limit=200"))


def test_records_of_another_shape_never_fail_a_page(dash):
    """Stored records are not trusted to have the shape sigprop writes: odd fields show what they
    can, and whatever still cannot be drawn answers a page that says so (never a 500)."""
    rec = evil_record("d" * 64)
    answer = json.loads(rec.answer)
    answer.update(
        graph_summary="three nodes",
        jacobian=[1],
        layers=[{"id": "x", "kernel": 3}, "junk"],
        c_map={"c": [0.0, 1.0], "global": [0.1, 1.0]},
        fixed_points="none",
        v_map={"q": [1.0], "v": [1.0]},
    )
    rec2 = new_record("d" * 64, json.dumps(answer), rec.request, rec.ids, "tat", "leaky_relu")
    dash.cache.put(rec2)
    text = page(dash.client, "/dashboard/solutions/" + "d" * 64)
    assert "cannot be shown" not in text and 'id="c-map"' in text
    answer["c_map"] = {"c": "not a list"}
    answer["layers"] = 7
    dash.cache.put(new_record("d" * 64, json.dumps(answer), "[]", rec.ids, "tat", "leaky_relu"))
    text = page(dash.client, "/dashboard/solutions/" + "d" * 64)
    assert "No diagram" in text and "No weighted layers" in text

    def broken(*_args, **_kwargs):
        raise KeyError("a shape nobody foresaw")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(views, "solution_view", broken)
        text = page(dash.client, "/dashboard/solutions/" + "d" * 64)
    assert "This solution cannot be shown" in text and 'href="/v1/solutions/' + "d" * 64 in text
    dash.cache.delete("d" * 64)
    weird = "c" * 32
    dash.store.create(weird, "k", owned({"steps": "many"}), time.time())
    dash.store.start(weird, "cpu")
    dash.store.finish(
        weird, {"runs": {"solved": {"loss": {"steps": 3, "values": None}, "grad_norms": [7]}}, "summary": "text"}
    )
    text = page(dash.client, f"/dashboard/validations/{weird}")
    assert "No loss curves" in text


def test_validation_names_are_escaped_for_plotly():
    job = {
        "id": "x",
        "status": "finished",
        "key": "k",
        "results": {
            "runs": {
                EVIL: {
                    "loss": {"steps": [1], "values": [2.0]},
                    "grad_norms": [{"step": 0, "norms": {EVIL: 1.0}}],
                    "c_values": {"layers": {EVIL: 0.1}, "output": 0.1, "predicted_output": 0.2},
                }
            }
        },
    }
    view = views.validation_view(job)
    escaped = html.escape(EVIL, quote=False)
    assert view["plots"]["loss"][0]["name"] == escaped
    assert view["plots"]["grad_norms"][0]["layers"] == [escaped]
    assert view["plots"]["c_values"][0]["name"] == escaped and view["plots"]["c_values"][0]["label"] == EVIL
    assert view["runs"][0]["name"] == EVIL  # table cells: Jinja escapes them


# -- validations -------------------------------------------------------------------------------


def test_validation_page_finished(dash, tiny_results):
    text = page(dash.client, f"/dashboard/validations/{dash.finished}")
    assert 'class="status finished"' in text and f'/dashboard/solutions/{dash.keys["tat_lrelu"]}"' in text
    data = page_data(text)
    plots, solved = data["plots"], tiny_results["runs"]["solved"]
    assert data["active"] is False and data["status"]["percent"] == 100.0
    assert {s["name"] for s in plots["loss"]} == {"solved", "he"}
    loss = next(s for s in plots["loss"] if s["name"] == "solved")
    assert loss["steps"] == solved["loss"]["steps"] and loss["values"] == pytest.approx(solved["loss"]["values"])
    acc = next(s for s in plots["accuracy"] if s["name"] == "solved")
    assert acc["values"] == pytest.approx(solved["test_accuracy"]["values"])
    first = next(s for s in plots["grad_norms"] if s["run"] == "solved" and not s["last"])
    assert first["layers"] == list(solved["grad_norms"][0]["norms"])
    assert first["y"] == pytest.approx(list(solved["grad_norms"][0]["norms"].values()))
    cv = next(s for s in plots["c_values"] if s["name"] == "solved")
    assert cv["predicted"] == pytest.approx(solved["c_values"]["predicted_output"])
    assert cv["y"] == pytest.approx(list(solved["c_values"]["layers"].values()))
    assert tiny_results["summary"]["text"] in html.unescape(text)
    assert "<progress" not in text


def test_validation_page_running_and_its_progress_endpoint(dash):
    text = page(dash.client, f"/dashboard/validations/{dash.running}")
    assert '<progress id="progress" max="100" value="25.0">' in text and "step 3 of 12 (solved)" in text
    assert page_data(text)["active"] is True
    r = dash.client.get(f"/dashboard/validations/{dash.running}.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["status"] == "running" and body["percent"] == 25.0 and body["progress"]["step"] == 3
    done = dash.client.get(f"/dashboard/validations/{dash.finished}.json").json()
    assert done["status"] == "finished" and done["percent"] == 100.0


def test_validations_by_solution_key(dash):
    total, items = dash.store.list_for_key(dash.keys["tat_lrelu"], 10)
    assert total == 2 and [v["id"] for v in items] == [dash.running, dash.finished]  # newest first
    assert items[0]["progress"] == {"step": 3, "total": 12, "run": "solved"} and "results" not in items[0]
    total, items = dash.store.list_for_key(dash.keys["tat_lrelu"], 1)
    assert total == 2 and [v["id"] for v in items] == [dash.running]
    assert dash.store.list_for_key(dash.keys["eoc"], 10) == (0, [])


def test_redis_key_index_covers_older_validations(redis_server):
    """Validations stored before the per-solution index existed are found too (indexed once)."""
    conn = redis.Redis.from_url(redis_server.url)
    store = RedisValidationStore(conn)
    store.create("old" * 8, "k" * 64, {}, 1.0)
    conn.delete(RedisValidationStore.KEY_INDEX + "k" * 64)  # as an older sigprop wrote it
    total, items = RedisValidationStore(conn).list_for_key("k" * 64, 10)
    assert total == 1 and items[0]["id"] == "old" * 8
    store.close()


# -- errors, assets, wiring ------------------------------------------------------------------------


def test_unknown_keys_and_ids_answer_404(dash):
    for path in (
        "/dashboard/solutions/" + "0" * 64,
        "/dashboard/solutions/no%3Cscript%3E",
        "/dashboard/solutions/" + "x" * 200,
        "/dashboard/validations/" + "0" * 32,
        "/dashboard/validations/bad%20id",
    ):
        text = page(dash.client, path, 404)
        assert "No such" in text and "no<script" not in text and "no%3Cscript" not in text
    assert_error(dash.client.get("/dashboard/validations/" + "0" * 32 + ".json"), 404, "not_found")
    assert_error(dash.client.get("/dashboard/validations/bad%20id.json"), 404, "not_found")
    assert_error(dash.client.get("/dashboard/static/0000/dashboard.js"), 404, "not_found")
    assert_error(dash.client.get("/dashboard/static/0000/secrets.txt"), 404, "not_found")
    assert_error(dash.client.get("/dashboard/nowhere"), 404, "not_found")
    assert_error(dash.client.get("/dashboard?offset=-1"), 422, "invalid_request")


def test_static_files_are_versioned_cached_and_local(dash):
    text = page(dash.client, f"/dashboard/solutions/{dash.keys['tat_lrelu']}")
    urls = [u for u in re.findall(r'(?:src|href|data-plotly)="([^"]+)"', text) if not u.startswith("#")]
    assert all(u.startswith("/") and not u.startswith("//") for u in urls), urls  # nothing from other origins
    static = [u for u in urls if u.startswith("/dashboard/static/")]
    assert {u.rsplit("/", 1)[1] for u in static} >= {"dashboard.js", "dashboard.css", "favicon.svg"}
    plotly_url = re.search(r'data-plotly="(/dashboard/static/[0-9a-f]{16}/plotly-[^"]+\.min\.js)"', text).group(1)
    import plotly

    bundled = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    r = dash.client.get(plotly_url, headers={"Accept-Encoding": "gzip"})
    assert r.status_code == 200 and r.content == bundled
    assert r.headers["content-encoding"] == "gzip" and int(r.headers["content-length"]) < len(bundled) / 2
    assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert r.headers["content-type"].startswith("text/javascript")
    plain = dash.client.get(plotly_url, headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.content == bundled
    for u in static:
        assert dash.client.get(u).headers["cache-control"].endswith("immutable")
    csp = dash.client.get("/dashboard").headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'self'" in csp


def test_solve_form_offers_the_templates_and_methods(dash):
    text = page(dash.client, "/dashboard/new")
    catalog = page_data(text)
    assert catalog["templates"] == describe_templates() == dash.client.get("/v1/templates").json()
    assert set(catalog["methods"]) == set(METHOD_TARGETS)
    assert catalog["methods"]["tat"]["targets"]["leaky_relu"][0]["name"] == "eta"
    assert [t["name"] for t in catalog["methods"]["sparse_eoc"]["targets"]["crelu"]] == [
        "sparsity",
        "v_slope",
        "q_star",
    ]
    assert 'id="api-key"' in text and 'type="password"' in text


def test_root_redirects_and_dashboard_is_not_in_openapi(dash):
    r = dash.client.get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/dashboard"
    paths = dash.app.openapi()["paths"]
    assert not [p for p in paths if p == "/" or p.startswith("/dashboard")]


def test_every_route_takes_the_given_dependencies(tmp_path):
    def read_key():
        return None

    # The dashboard's router is a module-level APIRouter: the dependencies are given where it is
    # included (as create_app includes it behind the read-access check), and every route gets them.
    app = FastAPI()
    app.include_router(dashboard_router, dependencies=[Depends(read_key)])
    (included,) = [r for r in app.routes if getattr(r, "original_router", None) is dashboard_router]
    router = included.original_router
    assert router.routes
    for route in router.routes:
        dependencies = [*included.include_context.dependencies, *route.dependencies]  # what FastAPI runs
        assert [d.dependency for d in dependencies] == [read_key], route.path
        assert route.include_in_schema is False
    assert form_catalog()["methods"].keys() == METHOD_TARGETS.keys()


def test_the_dashboard_needs_a_key_unless_anonymous_stored_reads(dash, tmp_path):
    """Stored submissions are closed to requests without a key while keys are configured (the
    browser is asked for Basic credentials); ``anonymous_stored_reads`` opens the solutions, never
    the validations of a key."""
    anonymous = TestClient(dash.app)  # the same running app, no credentials
    for path in ("/dashboard", f"/dashboard/solutions/{dash.keys['eoc']}", f"/dashboard/validations/{dash.finished}"):
        r = anonymous.get(path)
        assert_error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"].startswith("Basic")
    with TestClient(create_app(Settings(data_dir=tmp_path, api_keys=API_KEY, anonymous_stored_reads=True))) as c:
        key = c.post("/v1/solve", json=SOLVES["eoc"]).json()["key"]
        assert listed_keys(page(c, "/dashboard")) == [key]
        page(c, f"/dashboard/solutions/{key}")
        store = SqliteValidationStore(tmp_path / "solutions.sqlite3")
        store.create("e" * 32, key, owned({"key": key, "steps": 2}), time.time())
        page(c, "/dashboard/validations/" + "e" * 32, 404)  # someone's validation: not for anonymous eyes
        store.close()
