"""Helpers shared by the dashboard tests (tests/test_dashboard.py, tests/test_dashboard_browser.py)."""

from __future__ import annotations

import json

from sigprop.cache import Record, new_record
from sigprop.engine.solve import prepare, solve_canonical
from sigprop.requests import parse_solve_request

EVIL = "<script>alert(1)</script>"
EVIL_KEY = "e" * 64


def evil_record(key: str = EVIL_KEY) -> Record:
    """A legacy or corrupted record, as if written past the API's rules: one node id and the
    activation are ``<script>alert(1)</script>``. The answer is a real one (TAT Leaky ReLU on a
    tiny MLP written node by node) with that activation put in, and a valid checksum, so every
    page shows it in full."""
    safe = {"graph": {"schema": "sigprop.graph/v1", "nodes": [
        {"id": "x", "op": "input", "shape": [8]}, {"id": "d", "op": "dense", "inputs": ["x"], "units": 8},
        {"id": "act", "op": "activation", "inputs": ["d"]}, {"id": "d2", "op": "dense", "inputs": ["act"], "units": 8},
        {"id": "out", "op": "output", "inputs": ["d2"]}]},
        "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.3}}
    prep = prepare(parse_solve_request(safe))
    canonical = solve_canonical(prep).to_json()
    assert canonical.count('"activation":"leaky_relu"') == 1
    canonical = canonical.replace('"activation":"leaky_relu"', '"activation":' + json.dumps(EVIL))
    evil_nodes = [dict(nd, id=EVIL if nd["id"] == "d" else nd["id"],
                       inputs=[EVIL if i == "d" else i for i in nd.get("inputs", [])])
                  for nd in safe["graph"]["nodes"]]
    request = dict(safe, graph={"schema": "sigprop.graph/v1", "nodes": evil_nodes}, activation=EVIL)
    ids = [EVIL if i == "d" else i for i in prep.ids]
    return new_record(key, canonical, json.dumps(request), ids, "tat", EVIL)
