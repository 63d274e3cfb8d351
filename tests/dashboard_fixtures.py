"""Helpers shared by the dashboard tests (tests/service/test_dashboard.py, tests/e2e/test_dashboard_browser.py)
and bench/dashboard_bench.py."""

from __future__ import annotations

import json
from pathlib import Path

from sigprop.engine.solve import prepare, solve_canonical
from sigprop.requests import parse_solve_request
from sigprop.storage import Record, new_record

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
EVIL = "<script>alert(1)</script>"
EVIL_KEY = "e" * 64


def evil_record(key: str = EVIL_KEY) -> Record:
    """A legacy or corrupted record, as if written past the API's rules: one node id and the
    activation are ``<script>alert(1)</script>``. The answer is a real one (TAT Leaky ReLU on a
    tiny MLP written node by node) with that activation put in, and a valid checksum, so every
    page shows it in full."""
    safe = {
        "graph": {
            "schema": "sigprop.graph/v1",
            "nodes": [
                {"id": "x", "op": "input", "shape": [8]},
                {"id": "d", "op": "dense", "inputs": ["x"], "units": 8},
                {"id": "act", "op": "activation", "inputs": ["d"]},
                {"id": "d2", "op": "dense", "inputs": ["act"], "units": 8},
                {"id": "out", "op": "output", "inputs": ["d2"]},
            ],
        },
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.3},
    }
    prep = prepare(parse_solve_request(safe))
    canonical = solve_canonical(prep).to_json()
    assert canonical.count('"activation":"leaky_relu"') == 1
    canonical = canonical.replace('"activation":"leaky_relu"', '"activation":' + json.dumps(EVIL))
    evil_nodes = [
        dict(
            nd, id=EVIL if nd["id"] == "d" else nd["id"], inputs=[EVIL if i == "d" else i for i in nd.get("inputs", [])]
        )
        for nd in safe["graph"]["nodes"]
    ]
    request = dict(safe, graph={"schema": "sigprop.graph/v1", "nodes": evil_nodes}, activation=EVIL)
    ids = [EVIL if i == "d" else i for i in prep.ids]
    return new_record(key, canonical, json.dumps(request), ids, "tat", EVIL)


def headless_chromium(console_log: bool = False):
    """Debian's chromium, headless, driven by selenium through the system chromedriver (named
    explicitly, so selenium-manager never looks for or downloads one). ``console_log`` keeps the
    page's console messages readable with ``driver.get_log("browser")``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--no-first-run",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
