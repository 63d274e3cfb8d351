"""A schemathesis check (loaded through SCHEMATHESIS_HOOKS by tests/e2e/test_schemathesis.py): a
request the OpenAPI schema calls valid may be refused only for what no JSON Schema can say.

schemathesis's own ``positive_data_acceptance`` counts statuses, and a solve or a validation must
be allowed its 422 for a graph that is well formed JSON but not a network (a cycle, no output, a
shape that does not fit). This check looks at the error code that 422 carries: every rule the
validator applies to the JSON's shape (which keys, which types, which targets a method reads,
``solve`` or ``key``) is in the schema, so a schema-valid request refused with ``invalid_request``
means the schema is looser than the validator, and is a finding.
"""

from __future__ import annotations

import json
import re

import schemathesis

# 422 codes that depend on more than the JSON's shape, and why
SEMANTIC = {
    "invalid_graph": "cycles, dangling inputs, one output node, shapes that fit: the graph as a network",
    "unsupported_structure": "the kernel theory's assumptions, a property of the whole graph",
    "unsupported_activation": "which functions a method takes depends on the graph and the other functions",
    "invalid_target": "a target's range depends on the activation (tau only for smooth functions, ...)",
    "unreachable_target": "whether a target can be met depends on the network",
}
# invalid_target messages for rules the schema does state: these are findings too
STATED_TARGET_RULES = ("does not use target",)
# invalid_request messages of rules beyond JSON Schema: server state, or arithmetic on a template's
# parameters (the OpenAPI schema states which parameters each template takes and needs, and the
# values it allows where they are a list)
BEYOND_SCHEMA = (
    re.compile(r"^dataset"),  # which dataset files exist on the workers
    re.compile(r"^densenet depth \d+ is not supported"),  # 6n+4: no JSON Schema keyword says "4 mod 6"
    re.compile(r"^template '\w+' expands to an invalid graph"),  # e.g. channels past a node's bounds
    re.compile(r"^input_shape \[[0-9, ]*\] is too small for template"),  # the poolings its depth brings
    re.compile(r"^transformer width \d+ is not a multiple of heads"),  # no JSON Schema keyword relates two fields
    # a charlm validation trains the transformer template's graph: whether a stored solution (by key)
    # or a whole graph is that template's is server state or the graph's structure
    re.compile(r"^charlm: (the graph|block b0|b0\.fc1)"),
)
# The contract refuses a float for an integer ("depth": 5.0, docs/contract.md section 2), and JSON
# Schema cannot say so: its "integer" is any number with a zero fractional part, 5.0 included.
FLOAT_FOR_INTEGER = "Input should be a valid integer"


def _integral_floats(value) -> bool:
    """Whether a JSON value holds a float with a zero fractional part (5.0) anywhere."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and item.is_integer():
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


@schemathesis.check
def schema_states_every_shape_rule(ctx, response, case):
    meta = getattr(case, "meta", None)
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 422:
        return None
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"a 422 without the contract's error object: {response.content[:300]!r}") from None
    code, message = error.get("code"), error.get("message", "")
    if code in SEMANTIC and not any(rule in message for rule in STATED_TARGET_RULES):
        return None
    if code == "invalid_request" and any(rule.search(message) for rule in BEYOND_SCHEMA):
        return None
    if FLOAT_FOR_INTEGER in message and _integral_floats(case.body):
        return None
    raise AssertionError(
        f"a schema-valid request was refused with {code}: {message[:300]} -- the OpenAPI schema should "
        "state this rule (schemas/*.py json_schema_extra), or the rule is wrong"
    )
