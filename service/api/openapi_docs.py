"""What each operation of the OpenAPI description says to a reader of /docs and /redoc: a
description and an example request (a curl line, rendered by ReDoc from ``x-codeSamples``, and for
the routes that take a body, an example body that Swagger UI's "Try it out" starts from).

Kept in one table rather than on the routes so the routes stay about serving; a test checks
that every operation of the app has an entry, so a new route cannot go undocumented.
"""

from __future__ import annotations

BASE = "http://127.0.0.1:8000"
KEY_HEADER = '-H "Authorization: Bearer $SIGPROP_KEY"'

SOLVE_EXAMPLE = {
    "graph": {"template": "mlp", "depth": 50, "width": 512},
    "method": "tat",
    "activation": "leaky_relu",
    "targets": {"eta": 0.9},
}
VALIDATION_EXAMPLE = {
    "solve": {
        "graph": {"template": "mlp", "depth": 50, "width": 128, "input_shape": [64], "classes": 10},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.9},
    },
    "dataset": "digits",
    "steps": 300,
    "baselines": ["he"],
}
_KEY = "3361706911216fbd4d0c48e1467c4eb22ec7144e796e51732fe11211cd59aec0"
_VID = "0f8e4c2a9b7d4e61a3c5b2d9e8f70a14"


def _curl(method: str, path: str, extra: str = "") -> str:
    verb = "" if method == "GET" else f"-X {method} "
    return f"curl -s {verb}{extra + ' ' if extra else ''}'{BASE}{path}'"


# (method, path) -> (summary, description, curl line, example body or None); the summary is the
# operation's title in /docs (FastAPI would generate "Post Solve" from the function's name)
OPERATIONS: dict[tuple[str, str], tuple[str, str, str, dict | None]] = {
    ("post", "/v1/solve"): (
        "Solve a network",
        "Solve the activation transformation and per-layer initialization of a network (contract section 2). "
        "The graph is a node list or a template; equal requests (same graph up to node order and ids) share a "
        "key and are answered from the cache with `cached: true`.",
        _curl("POST", "/v1/solve", "-H 'Content-Type: application/json' -d @examples/tat_leaky_relu_mlp.json"),
        SOLVE_EXAMPLE,
    ),
    ("get", "/v1/solutions"): (
        "List stored solutions",
        "The stored solutions, newest first, with the total count; filter by method or activation.",
        _curl("GET", "/v1/solutions?limit=20&method=tat"),
        None,
    ),
    ("get", "/v1/solutions/{key}"): (
        "Read a stored solution",
        "One stored solution: its summary, the request that produced it and the answer.",
        _curl("GET", f"/v1/solutions/{_KEY}"),
        None,
    ),
    ("delete", "/v1/solutions/{key}"): (
        "Delete a stored solution",
        "Delete a stored solution (API key required).",
        _curl("DELETE", f"/v1/solutions/{_KEY}", KEY_HEADER),
        None,
    ),
    ("get", "/v1/templates"): (
        "List graph templates",
        "The graph templates (mlp, resnet, densenet, cnn) with their parameters, defaults and allowed values.",
        _curl("GET", "/v1/templates"),
        None,
    ),
    ("get", "/v1/templates/{name}"): (
        "Expand a graph template",
        "A template expanded to its node-by-node graph (sigprop.graph/v1); parameters go in the query.",
        _curl("GET", "/v1/templates/resnet?depth=50&shortcut_weight=0.8"),
        None,
    ),
    ("post", "/v1/validations"): (
        "Submit a validation training",
        "Train the solved network (and baselines) on a dataset and check the theory against it (API key "
        "required; contract section 4). A dataset that cannot feed the graph (input size, classes) is refused "
        "here with 422. Answers 202 with the job id.",
        _curl("POST", "/v1/validations", f"{KEY_HEADER} -H 'Content-Type: application/json' -d @validation.json"),
        VALIDATION_EXAMPLE,
    ),
    ("get", "/v1/validations"): (
        "List validations",
        "The validations, newest first (errors and .npz names hidden without an API key).",
        _curl("GET", "/v1/validations?limit=20", KEY_HEADER),
        None,
    ),
    ("get", "/v1/validations/{vid}"): (
        "Read a validation",
        "One validation: status, progress and, once finished, results. Without an API key the error text and "
        "an .npz dataset's name are hidden.",
        _curl("GET", f"/v1/validations/{_VID}", KEY_HEADER),
        None,
    ),
    ("delete", "/v1/validations/{vid}"): (
        "Cancel a validation",
        "Cancel a validation (API key required): a queued one at once (200), a running one when its job notices (202).",
        _curl("DELETE", f"/v1/validations/{_VID}", KEY_HEADER),
        None,
    ),
    ("get", "/healthz"): (
        "Liveness probe",
        "Liveness: the process is up (never needs a key).",
        _curl("GET", "/healthz"),
        None,
    ),
    ("get", "/readyz"): (
        "Readiness probe",
        "Readiness: the cache answers and the engine is warm (503 otherwise; 200 with storage 'degraded' when "
        "the store refuses writes).",
        _curl("GET", "/readyz"),
        None,
    ),
    ("get", "/metrics"): (
        "Prometheus metrics",
        "Prometheus metrics (text exposition format).",
        _curl("GET", "/metrics"),
        None,
    ),
}


# the groups of /docs, in its order: every route's router names one (no operation under "default")
TAGS = [
    {"name": "solve", "description": "Solve a network's activation transformation and initialization."},
    {"name": "solutions", "description": "The stored solutions."},
    {"name": "templates", "description": "The graph templates and their expansion."},
    {"name": "validations", "description": "Training runs that check an answer against a dataset (API key)."},
    {"name": "health", "description": "Probes and metrics (never need a key)."},
]


def document_operations(schema: dict) -> None:
    """Add each operation's summary, description, curl sample and example body to an OpenAPI schema,
    and the tags' descriptions."""
    schema["tags"] = TAGS
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            entry = OPERATIONS.get((method, path))
            if entry is None:
                continue  # tests/service/test_openapi.py fails on an operation missing from the table
            summary, description, curl, body = entry
            op["summary"], op["description"] = summary, description
            op["x-codeSamples"] = [{"lang": "Shell", "label": "curl", "source": curl}]
            content = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None and content is not None:
                content["example"] = body
