"""The ``sigprop`` command line (contract section 5)."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .errors import SigpropError


def _read_request(path: str):
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as exc:
        raise SigpropError("invalid_request", f"cannot read {path}: {exc.strerror}", "give a path to a JSON file, or - for stdin") from None
    from .requests import load_json

    # the parser the service uses: NaN, Infinity and numbers past a double's range are rejected too
    return load_json(text, "check the file with a JSON validator", what="stdin" if path == "-" else path)


def cmd_solve(args) -> int:
    """Solve offline: no server, no Redis; prints exactly the answer POST /v1/solve gives."""
    from .engine.solve import solve_json
    from .requests import parse_solve_request

    try:
        answer = solve_json(parse_solve_request(_read_request(args.request)))
    except SigpropError as err:
        print(json.dumps(err.to_dict()), file=sys.stderr)
        return 2
    sys.stdout.write(answer + "\n")
    return 0


def cmd_serve(args) -> int:
    """The HTTP service (uvicorn); settings come from SIGPROP_* environment variables."""
    import os
    import tempfile

    import uvicorn
    from pydantic import ValidationError

    from .settings import Settings

    try:  # refuse to start on settings that cannot work, with the reason, before uvicorn starts
        Settings()
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            where = ".".join(str(p) for p in err.get("loc", ()))
            name = f"SIGPROP_{where.upper()}: " if where else ""
            print(f"sigprop serve: invalid settings: {name}{err.get('msg')}", file=sys.stderr)
        return 2

    if args.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Each worker is a process: point prometheus_client at a shared folder so /metrics
        # reports all of them, whichever worker answers.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sigprop-metrics-")
    from .api.server import NoDelayH11Protocol

    uvicorn.run("sigprop.api.app:create_app", factory=True, host=args.host, port=args.port, workers=args.workers,
                http=NoDelayH11Protocol, log_level="warning", access_log=False, timeout_graceful_shutdown=30)
    return 0


def cmd_worker(args) -> int:
    """A validation-training worker (RQ) on the Redis at SIGPROP_REDIS_URL."""
    from .settings import get_settings

    settings = get_settings()
    if not settings.redis_url:
        print(json.dumps(SigpropError("invalid_request", "sigprop worker needs a Redis: SIGPROP_REDIS_URL is not set",
                                      "set SIGPROP_REDIS_URL to the Redis `sigprop serve` uses; without Redis, "
                                      "`sigprop serve` runs validations itself").to_dict()), file=sys.stderr)
        return 2
    from .worker.worker import run_worker

    run_worker(settings, queues=args.queue or None, burst=args.burst, name=args.name)
    return 0


def cmd_schema(args) -> int:
    """Print the JSON Schema of the graph, the solve request or the answer."""
    from .schemas import Graph, Solution, SolveRequest

    model = {"graph": Graph, "request": SolveRequest, "solution": Solution}[args.which]
    print(json.dumps(model.model_json_schema(by_alias=True), indent=2, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sigprop", description="Shape deep networks: TAT, DKS, EOC solvers for any architecture graph.")
    parser.add_argument("--version", action="version", version=f"sigprop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("solve", help="solve a request offline and print the answer JSON")
    p.add_argument("request", help="path to a request JSON file, or - for stdin")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("serve", help="run the HTTP service (POST /v1/solve and friends)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("worker", help="run a validation-training worker (needs SIGPROP_REDIS_URL)")
    p.add_argument("--burst", action="store_true", help="quit once the queue is empty")
    p.add_argument("--queue", action="append", metavar="NAME",
                   help="queue to listen on (repeatable; default SIGPROP_VALIDATION_QUEUE, sigprop-validations)")
    p.add_argument("--name", default=None, help="worker name (default: random)")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("schema", help="print a JSON Schema (graph, request or solution)")
    p.add_argument("which", choices=["graph", "request", "solution"])
    p.set_defaults(func=cmd_schema)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
