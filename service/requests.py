"""Turn untrusted JSON into a ``SolveRequest``, mapping pydantic's errors onto the contract's codes.

Shared by the CLI and the HTTP app so both reject the same input with the same error object.
"""

from __future__ import annotations

import json
import math

from pydantic import ValidationError

from .errors import SigpropError
from .schemas.graph import OPS, TEMPLATE_FIELDS, TEMPLATE_NAMES, Graph, Template
from .schemas.solve import SolveRequest, Targets
from .schemas.suggest import did_you_mean


class _NonFinite(ValueError):
    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


class _Marker:
    """Stands for a non-finite number while locating it (second, slow parse of a rejected body)."""

    def __init__(self, text: str):
        self.text = text


def _reject_constant(text: str):
    raise _NonFinite(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise _NonFinite(text)
    return value


def _locate(text) -> tuple[tuple, str]:
    """Path and spelling of the first non-finite number in a JSON text (which parses with markers)."""
    data = json.loads(
        text, parse_constant=_Marker, parse_float=lambda t: _Marker(t) if not math.isfinite(float(t)) else 0.0
    )
    stack: list[tuple[tuple, object]] = [((), data)]
    while stack:  # iterative: nesting depth cannot overflow the interpreter's stack here
        path, node = stack.pop()
        if isinstance(node, _Marker):
            return path, node.text
        if isinstance(node, dict):
            stack.extend((path + (k,), v) for k, v in reversed(list(node.items())))
        elif isinstance(node, list):
            stack.extend((path + (i,), v) for i, v in reversed(list(enumerate(node))))
    return (), "?"


class _RepeatedKey(ValueError):
    """A JSON object names a key twice. RFC 8259 leaves the meaning to each parser (Python's keeps
    the last value, others the first), so such a request is refused rather than read one way."""


def _unique_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _RepeatedKey()
    return obj


class _Repeated(dict):
    """An object with a repeated key, while locating it (second, slow parse of a rejected body)."""

    def __init__(self, pairs: list, key: str):
        super().__init__(pairs)
        self.key = key


def _mark_repeats(pairs: list) -> dict:
    seen: set = set()
    for key, _value in pairs:
        if key in seen:
            return _Repeated(pairs, key)
        seen.add(key)
    return dict(pairs)


def _locate_repeat(text) -> tuple[tuple, str]:
    """Path and name of the first repeated key of a JSON text, in document order."""
    data = json.loads(text, object_pairs_hook=_mark_repeats, parse_constant=_Marker, parse_float=float)
    stack: list[tuple[tuple, object]] = [((), data)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, _Repeated):
            return path + (node.key,), node.key
        if isinstance(node, dict):
            stack.extend((path + (k,), v) for k, v in reversed(list(node.items())))
        elif isinstance(node, list):
            stack.extend((path + (i,), v) for i, v in reversed(list(enumerate(node))))
    return (), "?"


def _repeated_key(text, hint: str, what: str) -> SigpropError:
    try:
        path, key = _locate_repeat(text)
    except (ValueError, RecursionError) as exc:
        return _not_json(exc, hint, what)
    return SigpropError(
        "invalid_request",
        f"{error_path(path)}: {what} names the key {key!r} more than once in one object",
        "send each key once: JSON parsers disagree on which of two values wins; " + hint,
    )


def load_json(text: bytes | str, hint: str, what: str = "the request body"):
    """``json.loads`` for untrusted input, as every entry point (HTTP and CLI) uses it.

    Rejects what Python's parser accepts beyond JSON: the constants ``NaN``, ``Infinity`` and
    ``-Infinity``, and numbers too large for a float (``1e400`` would parse to infinity), with
    ``invalid_target`` when they sit in the targets and ``invalid_request`` elsewhere. Nesting too
    deep for the parser is invalid JSON, never a RecursionError. An object that repeats a key is
    refused too (``invalid_request``, naming where), so no two surfaces read it differently.
    """
    try:
        return json.loads(
            text, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except _NonFinite:
        pass
    except _RepeatedKey:
        raise _repeated_key(text, hint, what) from None
    except (ValueError, RecursionError) as exc:
        raise _not_json(exc, hint, what) from None
    try:
        path, spelling = _locate(text)
    except (ValueError, RecursionError) as exc:  # invalid JSON further on, after the first non-finite number
        raise _not_json(exc, hint, what) from None
    if not path and spelling == "?":  # its value was overwritten by a repeated key's
        raise _repeated_key(text, hint, what)
    where = error_path(path)
    message = f"{where}: {spelling} is not a finite number"
    if path[:1] == ("targets",) or path[:2] == ("solve", "targets"):
        raise SigpropError("invalid_target", message, _TARGET_HINT)
    raise SigpropError(
        "invalid_request",
        message,
        "JSON has no NaN or Infinity, and every number must be a finite double "
        "(magnitude below about 1.8e308); " + hint,
    )


def _not_json(exc: Exception, hint: str, what: str) -> SigpropError:
    if isinstance(exc, json.JSONDecodeError):
        detail = f": {exc.msg} at line {exc.lineno} column {exc.colno}"
    elif isinstance(exc, RecursionError):
        detail = ": it is nested too deeply"
    else:  # e.g. not UTF-8, or an integer with more than 4300 digits
        detail = f": {str(exc)[:200]}"
    return SigpropError("invalid_request", f"{what} is not valid JSON{detail}", hint)


_TARGET_HINT = "targets are finite numbers among eta, tau, zeta, local_q_slope, sparsity, v_slope, q_star"
SOLVE_HINT = "send a JSON object with graph, method, activation and targets"


def _type_note(error: dict, msg: str) -> str:
    """pydantic's message, plus why a quoted number is refused (the wire is strict, schemas/graph.py)."""
    if isinstance(error.get("input"), str) and error.get("type") in ("float_type", "int_type", "bool_type"):
        return f"{msg}, got the string {str(error['input'])[:40]!r}: send a JSON number, not a quoted one"
    return msg


def error_path(loc, default: str = "request") -> str:
    """Where a validation error is: its location's parts joined by dots (``graph.nodes.0.units``)."""
    return ".".join(str(p) for p in loc) or default


def invalid_request(exc, hint: str, default: str = "request", code: str = "invalid_request") -> SigpropError:
    """``invalid_request`` (or ``code``) for a pydantic ``ValidationError`` (or FastAPI's
    ``RequestValidationError``): where its first problem is and what it is, with ``hint``;
    ``default`` names the place when the problem has no location."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    return SigpropError(code, f"{error_path(first.get('loc', ()), default)}: {first.get('msg', 'invalid value')}", hint)


def error_from_validation(exc: ValidationError) -> SigpropError:
    """The most specific contract error for a pydantic ValidationError (first problem wins)."""
    return _classify(exc.errors(include_url=False))


def _classify(errs: list[dict]) -> SigpropError:
    """The contract error for pydantic's error list (its first problem; how many more, where useful)."""
    first = errs[0]
    loc = tuple(first.get("loc", ()))
    where = error_path(loc)
    msg = _type_note(first, first.get("msg", "invalid value"))
    more = f" (and {len(errs) - 1} more problem(s))" if len(errs) > 1 else ""
    if first.get("type") == "union_tag_invalid" or (loc and loc[-1] == "op"):
        tag = (first.get("ctx") or {}).get("tag", first.get("input"))
        return SigpropError("unsupported_op", f"{where}: {msg}{_op_meant(tag)}", f"supported ops: {', '.join(OPS)}")
    if first.get("type") == "extra_forbidden" and len(loc) == 1:
        fields = [f.alias or name for name, f in SolveRequest.model_fields.items()]
        return SigpropError(
            "invalid_request",
            f"{where}: unknown key {loc[0]!r}{did_you_mean(loc[0], fields)}",
            f"a solve request has the keys {', '.join(fields)}",
        )
    if loc[:1] == ("graph",):
        return SigpropError("invalid_graph", f"{where}: {msg}{more}", _GRAPH_HINT)
    if loc[:1] == ("targets",):
        if first.get("type") == "extra_forbidden" and len(loc) == 2:
            msg = f"unknown target{did_you_mean(loc[1], list(Targets.model_fields))}"
        return SigpropError("invalid_target", f"{where}: {msg}{more}", _TARGET_HINT)
    if loc[:1] == ("activation",):
        return SigpropError(
            "unsupported_activation",
            f"{where}: {msg}",
            "activation is a name such as leaky_relu, relu, tanh, softplus, gelu, swish (letters, digits and '_')",
        )
    if loc[:1] == ("method",):
        methods = ("tat", "dks", "eoc", "sparse_eoc", "geometric")
        return SigpropError(
            "unsupported_method",
            f"{where}: {msg}{did_you_mean(first.get('input'), methods)}",
            f"method is one of {', '.join(methods)}",
        )
    return SigpropError(
        "invalid_request",
        f"{where}: {msg}{more}",
        'a solve request is {"graph": ..., "method": ..., "activation": ..., "targets": {...}}',
    )


# framework spellings of the graph's ops (PyTorch, Keras, ONNX): "did you mean" finds no close
# spelling of 'linear' among the ops, so these are looked up first
_OP_SPELLINGS = {
    "linear": "dense", "fc": "dense", "gemm": "dense", "matmul": "dense", "fullyconnected": "dense",
    "conv1d": "conv", "conv2d": "conv", "convolution": "conv",
    "add": "sum", "residual": "sum", "cat": "concat", "concatenate": "concat",
    "maxpool": "max_pool", "maxpool2d": "max_pool", "avgpool": "avg_pool", "avgpool2d": "avg_pool",
    "averagepooling2d": "avg_pool", "maxpooling2d": "max_pool", "adaptiveavgpool2d": "global_avg_pool",
    "globalaveragepool": "global_avg_pool", "globalaveragepooling2d": "global_avg_pool",
    "reshape": "flatten", "view": "flatten", "relu": "activation", "tanh": "activation",
    "leaky_relu": "activation", "gelu": "activation", "act": "activation",
}  # fmt: skip


def _op_meant(tag: object) -> str:
    """ "; did you mean 'dense'?" for an op typed as another framework or a typo spells it."""
    if not isinstance(tag, str):
        return ""
    folded = tag.lower().replace("-", "").replace("_", "")
    meant = _OP_SPELLINGS.get(tag.lower()) or _OP_SPELLINGS.get(folded)
    if meant is not None:
        extra = " with fn naming the function" if meant == "activation" else ""
        return f"; did you mean '{meant}'{extra}?"
    return did_you_mean(tag, OPS)


_GRAPH_HINT = (
    'a graph is {"schema": "sigprop.graph/v1", "nodes": [...]} or a template such as '
    '{"template": "mlp", "depth": 50}; see the op table in docs/contract.md for node attributes'
)


def _template_problem(graph: dict) -> SigpropError | None:
    """The template's own error (an unknown name or parameter, with the valid ones), or None.

    Pydantic tries a ``graph`` against both union members (``Graph`` and ``Template``) and reports
    the first member's complaints (``graph.Graph.nodes: Field required``), which says nothing about
    the template the user wrote; this names the bad template or key and lists what is valid.
    """
    name = graph.get("template")
    if not isinstance(name, str) or name not in TEMPLATE_FIELDS:
        return SigpropError(
            "invalid_graph",
            f"graph.template: unknown template {name!r}{did_you_mean(name, TEMPLATE_NAMES)}",
            f"templates: {', '.join(TEMPLATE_NAMES)} (GET /v1/templates lists their parameters)",
        )
    fields = TEMPLATE_FIELDS[name]
    # a null is "not given" for any Template field (expansion ignores it), so only other keys are unknown
    unknown = [
        k
        for k in graph
        if k != "template" and k not in fields and not (graph[k] is None and k in Template.model_fields)
    ]
    if unknown:
        key = unknown[0]
        return SigpropError(
            "invalid_graph",
            f"graph.{key}: template '{name}' has no parameter {key!r}{did_you_mean(key, fields)}",
            f"template '{name}' takes {', '.join(fields)} (GET /v1/templates/{name} expands it)",
        )
    return None


def _graph_error(graph) -> SigpropError | None:
    """The error of the union member the graph was meant as: a template when it names one (has
    ``template``), else a node list, located under ``graph`` (None when it is neither a dict nor wrong)."""
    if not isinstance(graph, dict):
        return None
    model = Template if "template" in graph else Graph
    if model is Template:
        problem = _template_problem(graph)
        if problem is not None:
            return problem
    try:
        model.model_validate(graph)
    except ValidationError as exc:
        # re-locate under "graph" (without the union member's name) and classify as the request's error
        errors = [{**e, "loc": ("graph", *e.get("loc", ()))} for e in exc.errors(include_url=False)]
        err = _classify(errors)
        if model is Template and err.code == "invalid_graph":
            name = graph["template"]
            err.hint = f"GET /v1/templates lists the parameters of '{name}' with their types and ranges"
        return err
    return None


def parse_solve_request(data) -> SolveRequest:
    if not isinstance(data, dict):
        raise SigpropError(
            "invalid_request",
            "the request body must be a JSON object",
            'send {"graph": ..., "method": ..., "activation": ..., "targets": {...}}',
        )
    try:
        return SolveRequest.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors and tuple(errors[0].get("loc", ()))[:1] == ("graph",):
            err = _graph_error(data.get("graph"))
            if err is not None:
                raise err from None
        raise error_from_validation(exc) from None
