"""The OpenAPI description is complete: every $ref resolves, and the solve route documents the
request model it reads (clients in other languages generate code from it)."""

from sigprop.api.app import create_app
from sigprop.settings import Settings


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def test_every_ref_resolves(tmp_path):
    schema = create_app(Settings(data_dir=tmp_path)).openapi()
    components = schema["components"]["schemas"]
    refs = set(_refs(schema))
    assert "#/components/schemas/SolveRequest" in refs
    missing = [r for r in refs if r.split("/")[-1] not in components]
    assert not missing, missing
    body = schema["paths"]["/v1/solve"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/SolveRequest"}
    assert set(components["SolveRequest"]["properties"]) >= {"graph", "method", "activation", "targets"}
