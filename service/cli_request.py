"""``sigprop solve`` from flags: a solve request written on the command line, no file needed.

``sigprop solve --template mlp --depth 50 --method tat --activation leaky_relu --eta 0.9`` builds
the same JSON a file would hold, so it goes through the same parser (and errors) as ``POST
/v1/solve``. Flags given with a request file override the file's fields: ``--method``,
``--activation``, ``--init``, ``--assumptions`` replace them, targets are merged key by key, and
template parameters are merged into the file's template (``--template`` replaces its graph).
"""

from __future__ import annotations

import argparse
import json

from .errors import SigpropError
from .schemas.graph import TEMPLATE_NAMES

# (flag, target key): the contract's target names, with dashes on the command line
TARGET_FLAGS = (
    ("--eta", "eta"),
    ("--tau", "tau"),
    ("--zeta", "zeta"),
    ("--sparsity", "sparsity"),
    ("--v-slope", "v_slope"),
    ("--q-star", "q_star"),
    ("--local-q-slope", "local_q_slope"),
)
# template parameters common enough to get their own flag; any other one: --param name=value
TEMPLATE_FLAGS = (("--depth", "depth"), ("--width", "width"), ("--classes", "classes"))

_PARAM_HINT = "write --param NAME=VALUE, VALUE in JSON: --param input_shape=[3,32,32] --param shortcut_weight=0.5"


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """The flags that write (or override parts of) a solve request."""
    g = p.add_argument_group("request as flags (override the file's fields when a file is given too)")
    g.add_argument(
        "--template",
        help=f"graph template: {', '.join(TEMPLATE_NAMES)} (GET /v1/templates lists their parameters)",
    )
    for flag, key in TEMPLATE_FLAGS:
        g.add_argument(flag, type=int, dest=f"t_{key}", metavar="N", help=f"template parameter {key}")
    g.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any template parameter, VALUE in JSON (repeatable): --param input_shape=[3,32,32]",
    )
    g.add_argument("--method", help="tat, dks, eoc, sparse_eoc or geometric")
    g.add_argument("--activation", help="activation name, e.g. leaky_relu, tanh, gelu, swish")
    for flag, key in TARGET_FLAGS:
        g.add_argument(flag, type=float, dest=f"target_{key}", metavar="X", help=f"target {key}")
    g.add_argument("--init", choices=["orthogonal", "gaussian"], help="weight distribution")
    g.add_argument("--assumptions", choices=["strict", "warn"], help="strict (default) or warn")
    g.add_argument("--roots", choices=["first", "all"], help="first (default) or all: also list the other roots")
    g.add_argument(
        "--attention",
        metavar="SHAPING",
        help="a sequence graph's attention shaping: e-spa, u-spa, value-skipinit, shaped, or its JSON object "
        '(\'{"shaping": "e-spa", "final_gamma": 0.01}\')',
    )


def _param_value(text: str):
    """A --param value: JSON when it parses (numbers, lists, booleans), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_params(args) -> dict:
    """The template parameters the flags give (``--depth``, ``--width``, ``--classes``, ``--param``)."""
    params = {key: getattr(args, f"t_{key}") for _, key in TEMPLATE_FLAGS if getattr(args, f"t_{key}") is not None}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise SigpropError("invalid_request", f"--param {item!r} is not NAME=VALUE", _PARAM_HINT)
        params[name.strip()] = _param_value(value)
    return params


def has_request_flags(args) -> bool:
    targets = any(getattr(args, f"target_{key}") is not None for _, key in TARGET_FLAGS)
    fields = (args.template, args.method, args.activation, args.init, args.assumptions, args.roots, args.attention)
    return targets or any(f is not None for f in fields) or bool(template_params(args))


def _merge_graph(request: dict, args) -> None:
    params = template_params(args)
    if args.template is not None:
        request["graph"] = {"template": args.template, **params}
    elif params:
        graph = request.get("graph")
        if not isinstance(graph, dict) or "template" not in graph:
            raise SigpropError(
                "invalid_request",
                "template parameters were given as flags, but there is no template to apply them to",
                f"add --template NAME ({', '.join(TEMPLATE_NAMES)}), or give a request file whose graph is a template",
            )
        request["graph"] = {**graph, **params}


def apply_flags(request: dict | None, args) -> dict:
    """The request ``args``' flags write, on top of ``request`` (a file's JSON) when there is one."""
    if request is not None and not isinstance(request, dict):
        raise SigpropError("invalid_request", "the request must be a JSON object", "see docs/contract.md section 2")
    out = dict(request or {})
    _merge_graph(out, args)
    for key in ("method", "activation", "init", "assumptions", "roots"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    if args.attention is not None:
        given = _param_value(args.attention)
        out["attention"] = given if isinstance(given, dict) else {"shaping": args.attention}
    targets = {key: getattr(args, f"target_{key}") for _, key in TARGET_FLAGS}
    targets = {k: v for k, v in targets.items() if v is not None}
    if targets:
        old = out.get("targets")
        out["targets"] = {**(old if isinstance(old, dict) else {}), **targets}
    return out
