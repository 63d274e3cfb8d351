"""How fast the dashboard's pages are with 10,000 cached solutions (goal: under 300 ms).

Run from the repository root (needs redis-server; the browser table needs Debian's chromium and
chromium-driver):

    .venv/bin/python bench/dashboard_bench.py              # about a minute
    .venv/bin/python bench/dashboard_bench.py --solutions 2000 --repeats 10 --no-browser

It starts a private ``redis-server`` on a spare loopback port and fills it with ``--solutions``
records written straight through ``RedisSolutionCache.put`` (a real solve per record would take
an hour): copies of real answers of ~30 different requests (every method, MLPs, CNNs, ResNets,
DenseNets), each under a key and a creation time of its own, plus one ResNet-152 and one
1,000-block residual network written node by node (5,003 nodes; its answer is 360 KB) near the
newest end, and one finished validation with the results of a real (tiny) training run. Then it
starts ``sigprop serve`` (one worker) on that Redis and measures:

Table 1, server response: the time of ``GET`` over a kept-alive loopback connection (what the
server takes, plus ~0.3 ms of loopback and client), median and worst of ``--repeats`` requests
after one warm-up request (the warm-up is reported too: it includes the first computation of a
solution page's untransformed C map, which is then kept in memory).

Table 2, browser page load (headless chromium): Navigation Timing's ``responseEnd`` and
``loadEventEnd`` (from the navigation's start) of each page, cold (a fresh browser: empty HTTP
cache, nothing compiled) and warm (the same page again in that browser: plotly.min.js comes from
the cache, its URL is immutable), and dashboard.js's marks: plotly ready (the library fetched
after the load event and run) and plots drawn. Medians of ``--browser-repeats`` loads. The pages
are complete without plotly (server-rendered tables, parameters and SVG graph diagram), which is
why plotly.min.js (4.8 MB, 1.5 MB gzipped; a fresh browser spends most of a second compiling it)
is fetched after the load event rather than holding it back.

Both tables go to stdout and to bench/results/dashboard_bench.md (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import fmt_t, machine, sigprop_state, table  # noqa: E402  (bench/ is the script's folder on sys.path)

from sigprop.engine.solve import prepare, solve_canonical  # noqa: E402
from sigprop.requests import parse_solve_request  # noqa: E402
from sigprop.storage import RedisSolutionCache, RedisValidationStore, new_record  # noqa: E402
from tests.dashboard_fixtures import CHROMEDRIVER, CHROMIUM, headless_chromium  # noqa: E402
from tests.service_fixtures import start_redis, start_service  # noqa: E402

GOAL_S = 0.300


def mlp(depth, width=256, method="tat", activation="leaky_relu", targets=None):
    return {
        "graph": {"template": "mlp", "depth": depth, "width": width},
        "method": method,
        "activation": activation,
        "targets": targets if targets is not None else {"eta": 0.9},
    }


def template(graph, method, activation, targets=None):
    return {"graph": graph, "method": method, "activation": activation, "targets": targets or {}}


def residual_blocks(blocks: int, width: int = 64) -> dict:
    """input -> dense -> blocks x [act -> dense -> act -> dense, sum(0.8 shortcut, 0.6 branch)] -> output."""
    nodes = [{"id": "x", "op": "input", "shape": [width]}, {"id": "d0", "op": "dense", "inputs": ["x"], "units": width}]
    prev = "d0"
    for i in range(blocks):
        nodes += [
            {"id": f"a{i}", "op": "activation", "inputs": [prev]},
            {"id": f"f{i}", "op": "dense", "inputs": [f"a{i}"], "units": width},
            {"id": f"b{i}", "op": "activation", "inputs": [f"f{i}"]},
            {"id": f"g{i}", "op": "dense", "inputs": [f"b{i}"], "units": width},
            {"id": f"s{i}", "op": "sum", "inputs": [prev, f"g{i}"], "weights": [0.8, 0.6]},
        ]
        prev = f"s{i}"
    nodes.append({"id": "out", "op": "output", "inputs": [prev]})
    return {"schema": "sigprop.graph/v1", "nodes": nodes}


# ~30 varied requests whose answers are copied into the 10,000 records
VARIED = (
    [mlp(d) for d in (40, 50, 100, 200)]
    + [mlp(50, activation=a, targets={"tau": 0.3}) for a in ("softplus", "tanh", "gelu", "swish")]
    + [mlp(30, method="dks", activation=a, targets={"zeta": 1.5}) for a in ("softplus", "tanh", "elu")]
    + [mlp(40, method="eoc", activation=a, targets={}) for a in ("tanh", "relu", "erf", "selu")]
    + [
        mlp(20, method="sparse_eoc", activation="relu_tau", targets={"sparsity": 0.7}),
        mlp(20, method="sparse_eoc", activation="soft_threshold", targets={"sparsity": 0.8}),
        mlp(20, method="sparse_eoc", activation="crelu", targets={"sparsity": 0.7, "v_slope": 0.7}),
        mlp(20, method="sparse_eoc", activation="cst", targets={"sparsity": 0.6, "v_slope": 0.8}),
        mlp(30, method="geometric", activation="relu", targets={}),
        template({"template": "cnn", "depth": 20, "width": 64}, "geometric", "relu"),
        template({"template": "cnn", "depth": 60, "width": 64}, "tat", "leaky_relu", {"eta": 0.9}),
        template({"template": "resnet", "depth": 50, "shortcut_weight": 0.8}, "tat", "leaky_relu", {"eta": 0.9}),
        template({"template": "resnet", "depth": 101, "shortcut_weight": 0.5}, "tat", "softplus", {"tau": 0.3}),
        template({"template": "resnet", "depth": 18}, "dks", "tanh", {"zeta": 1.5}),
        template({"template": "densenet", "depth": 121}, "tat", "leaky_relu", {"eta": 0.85}),
        template({"template": "densenet", "depth": 40}, "eoc", "relu"),
    ]
)
SMALL = 1  # VARIED[1]: TAT Leaky ReLU on an MLP of depth 50
RESNET152 = template({"template": "resnet", "depth": 152, "shortcut_weight": 0.8}, "tat", "softplus", {"tau": 0.3})
BLOCKS1000 = template(residual_blocks(1000), "tat", "leaky_relu", {"eta": 0.9})


def solved(request: dict) -> tuple[str, str, list[str]]:
    """(canonical answer JSON, its key, ids) of a request, solved in this process."""
    prep = prepare(parse_solve_request(request))
    return solve_canonical(prep).to_json(), prep.key, prep.ids


def fill(cache: RedisSolutionCache, n: int, seed: int = 0) -> dict[str, str]:
    """``n`` records (copies of real answers under keys of their own, one a minute back in time);
    returns the keys the tables name."""
    rng = random.Random(seed)
    base = [(req, *solved(req)) for req in VARIED]
    now = time.time()
    named = {}
    for i in range(n):
        req, answer, key, ids = base[i % len(base)]
        new_key = f"{rng.getrandbits(256):064x}"
        rec = new_record(new_key, answer.replace(key, new_key), json.dumps(req), ids, req["method"], req["activation"])
        rec.created = now - 60.0 * (n - i)
        rec.hits = rng.randrange(0, 50)
        cache.put(rec)
        if i % len(base) == SMALL:
            named["small"] = new_key  # the newest copy of the MLP-50
    for name, req in (("resnet152", RESNET152), ("blocks1000", BLOCKS1000)):
        answer, key, ids = solved(req)
        rec = new_record(key, answer, json.dumps(req), ids, req["method"], req["activation"])
        rec.created = now - 30.0
        cache.put(rec)
        named[name] = key
    return named


def plant_validation(redis_url: str, key: str) -> str:
    """A finished validation of ``key`` with the results of a real tiny training run."""
    import redis

    from sigprop.engine.solve import solve
    from sigprop.schemas.solve import SolveRequest
    from sigprop.worker.training import run_validation

    req = {
        "graph": {"template": "mlp", "depth": 4, "width": 16, "input_shape": [64], "classes": 10},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.5},
    }
    request = {"dataset": "digits", "steps": 100, "batch_size": 32, "baselines": ["he", "eoc"]}
    results = run_validation(request, req["graph"], solve(SolveRequest.model_validate(req)), device="cpu")
    store = RedisValidationStore(redis.Redis.from_url(redis_url))
    vid = "bench" + "0" * 27
    store.create(vid, key, {"key": key, **request}, time.time())
    store.start(vid, "cpu")
    store.finish(vid, results)
    store.close()
    return vid


def _kb(n: int) -> str:
    return f"{n / 1024:,.0f} KB" if n >= 1024 else f"{n} B"


def server_table(base: str, cases: list[tuple[str, str]], repeats: int) -> tuple[list[list[str]], list[str]]:
    rows, slow = [], []
    with httpx.Client(base_url=base, timeout=60.0, headers={"Accept-Encoding": "gzip"}) as c:
        for name, path in cases:
            t0 = time.perf_counter()
            first = c.get(path)
            first_s = time.perf_counter() - t0
            assert first.status_code == 200, (path, first.status_code, first.text[:300])
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = c.get(path)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200
            med, worst = statistics.median(times), max(times)
            ok = med < GOAL_S and first_s < GOAL_S
            if not ok:
                slow.append(name)
            rows.append(
                [
                    name,
                    path if len(path) < 60 else path[:57] + "...",
                    _kb(len(r.content)),
                    _kb(r.num_bytes_downloaded),
                    fmt_t(first_s),
                    fmt_t(med),
                    fmt_t(worst),
                    "yes" if ok else "NO",
                ]
            )
    return rows, slow


# responseEnd, loadEventEnd, and the marks dashboard.js sets when plotly has run and the plots are drawn
TIMING = (
    "const n = performance.getEntriesByType('navigation')[0];"
    "const m = name => { const e = performance.getEntriesByName(name)[0]; return e ? e.startTime : null; };"
    "return [n.responseEnd - n.startTime, n.loadEventEnd - n.startTime, m('sigprop-plotly'), m('sigprop-drawn'),"
    " document.body.dataset.plotly ? 1 : 0];"
)


def _load(driver, url: str) -> list[float | None]:
    driver.get(url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # loadEventEnd is set once the load handlers return
        t = driver.execute_script(TIMING)
        if t[1] > 0 and (not t[4] or t[3] is not None):
            return t[:4]
        time.sleep(0.01)
    raise RuntimeError(f"{url}: not loaded and drawn in 30 s")


def browser_table(base: str, pages: list[tuple[str, str]], repeats: int) -> tuple[list[list[str]], list[str]]:
    """Cold: a fresh browser (empty HTTP cache and no compiled scripts), first load of the page;
    warm: the same page loaded again in that browser."""
    rows, slow = [], []
    for name, path in pages:
        cold, warm = [], []
        for _ in range(repeats):
            driver = headless_chromium()
            try:
                cold.append(_load(driver, base + path))
                warm.append(_load(driver, base + path))
            finally:
                driver.quit()

        def med(runs, i):
            vals = [r[i] for r in runs if r[i] is not None]
            return statistics.median(vals) / 1e3 if vals else None

        ok = med(cold, 1) < GOAL_S and med(warm, 1) < GOAL_S
        if not ok:
            slow.append(name)
        rows.append(
            [name] + [fmt_t(med(runs, i)) for runs in (cold, warm) for i in (0, 1, 2, 3)] + ["yes" if ok else "NO"]
        )
    return rows, slow


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--solutions", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--browser-repeats", type=int, default=3)
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "dashboard_bench.md")
    return ap.parse_args(argv)


def server_cases(keys: dict, vid: str, solutions: int, plotly_url: str) -> list[tuple[str, str]]:
    """(page, path) of every GET the server table times."""
    prefix = keys["small"][:3]
    return [
        ("list, first page", "/dashboard"),
        ("list, method filter", "/dashboard?method=tat"),
        ("list, method + activation", "/dashboard?method=tat&activation=softplus"),
        (
            "list, deep page",
            "/dashboard?offset=9950" if solutions >= 10_000 else f"/dashboard?offset={solutions - 50}",
        ),
        ("list, key prefix search", f"/dashboard?q={prefix}"),
        ("list, activation search", "/dashboard?q=gelu"),
        ("solution, MLP-50 (small)", f"/dashboard/solutions/{keys['small']}"),
        ("solution, ResNet-152 (361 nodes)", f"/dashboard/solutions/{keys['resnet152']}"),
        ("solution, 1000 blocks (5,003 nodes)", f"/dashboard/solutions/{keys['blocks1000']}"),
        ("validation page", f"/dashboard/validations/{vid}"),
        ("validation progress JSON", f"/dashboard/validations/{vid}.json"),
        ("solve form", "/dashboard/new"),
        ("plotly.min.js (first: gzipped once)", plotly_url),
    ]


def browser_section(base_url: str, keys: dict, vid: str, repeats: int, slow: list[str]) -> list[str]:
    """The browser table's lines (headless chromium); its pages over 300 ms are added to ``slow``."""
    pages = [
        ("list, first page", "/dashboard"),
        ("list, deep page", "/dashboard?offset=9950"),
        ("solution, MLP-50", f"/dashboard/solutions/{keys['small']}"),
        ("solution, ResNet-152", f"/dashboard/solutions/{keys['resnet152']}"),
        ("solution, 1000 blocks", f"/dashboard/solutions/{keys['blocks1000']}"),
        ("validation page", f"/dashboard/validations/{vid}"),
        ("solve form", "/dashboard/new"),
    ]
    brows, bslow = browser_table(base_url, pages, repeats)
    slow += [f"browser: {s}" for s in bslow]
    return [
        "",
        "Browser page load, headless chromium (Navigation Timing from navigation start, medians of "
        f"{repeats}; goal: load < 300 ms). Cold: a fresh browser; warm: the page again in it.",
        "plotly.js is fetched after the load event; 'plotly ready' and 'plots drawn' are dashboard.js's marks.",
        "",
        table(
            [
                "page",
                "cold: response",
                "cold: load",
                "cold: plotly ready",
                "cold: plots drawn",
                "warm: response",
                "warm: load",
                "warm: plotly ready",
                "warm: plots drawn",
                "load < 300 ms",
            ],
            brows,
            set(range(1, 9)),
        ),
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="sigprop-dashboard-bench-"))
    redis_server = start_redis(tmp / "redis")
    svc = None
    try:
        cache = RedisSolutionCache(redis_server.url, timeout_s=30)
        t0 = time.perf_counter()
        keys = fill(cache, args.solutions)
        fill_s = time.perf_counter() - t0
        vid = plant_validation(redis_server.url, keys["small"])
        cache.close()
        svc = start_service(tmp / "svc", {"SIGPROP_REDIS_URL": redis_server.url, "SIGPROP_DATA_DIR": str(tmp / "data")})
        with httpx.Client(base_url=svc.base_url) as c:
            plotly_url = re.search(r'data-plotly="([^"]+)"', c.get(f"/dashboard/solutions/{keys['small']}").text).group(
                1
            )
        cases = server_cases(keys, vid, args.solutions, plotly_url)
        rows, slow = server_table(svc.base_url, cases, args.repeats)
        out = [
            f"sigprop dashboard bench: {args.solutions:,} cached solutions in a private Redis (filled in "
            f"{fill_s:.1f} s), sigprop serve --workers 1; {machine()}; {sigprop_state(ROOT)}",
            "",
            "Server response (GET over a kept-alive loopback connection, gzip accepted; goal < 300 ms):",
            "",
            table(
                ["page", "path", "size", "sent (gzip)", "first", "median", "worst", "< 300 ms"], rows, {2, 3, 4, 5, 6}
            ),
        ]
        if not args.no_browser and CHROMIUM.exists() and CHROMEDRIVER.exists():
            out += browser_section(svc.base_url, keys, vid, args.browser_repeats, slow)
        elif not args.no_browser:
            out += ["", "(no browser table: /usr/bin/chromium and /usr/bin/chromedriver are needed)"]
        out += ["", "All under 300 ms." if not slow else f"Over 300 ms: {', '.join(slow)}"]
        text = "\n".join(out)
        print(text)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        return 0 if not slow else 1
    finally:
        if svc is not None:
            svc.stop()
        redis_server.stop()


if __name__ == "__main__":
    sys.exit(main())
