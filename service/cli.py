"""The ``sigprop`` command line (contract section 5).

``solve`` and ``schema`` need only what ``pip install sigprop`` brings; ``serve`` and ``worker``
need the ``server`` extra (``worker`` the ``worker`` extra, which includes it) and import it only
when they run.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import re
import sys

from . import __version__
from .cli_request import add_request_flags
from .errors import SigpropError
from .settings import settings_help

# The import names of the `server` extra's packages (pyproject.toml; a test keeps the two equal).
SERVER_MODULES = (
    "fastapi",
    "uvicorn",
    "redis",
    "prometheus_client",
    "rq",
    "limits",
    "jinja2",
    "plotly",
    "fastapi_offline",
)


def _missing_extra(command: str, extra: str) -> bool:
    """Say which extra to install, and return True, when a server package is not installed."""
    missing = []
    for name in SERVER_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        print(
            f"sigprop {command} needs the '{extra}' extra, which is not installed (missing: {', '.join(missing)}): "
            f"pip install 'sigprop[{extra}]'",
            file=sys.stderr,
        )
    return bool(missing)


def _read_request(path: str):
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as exc:
        raise SigpropError(
            "invalid_request", f"cannot read {path}: {exc.strerror}", "give a path to a JSON file, or - for stdin"
        ) from None
    from .requests import load_json

    # the parser the service uses: NaN, Infinity and numbers past a double's range are rejected too
    return load_json(text, "check the file with a JSON validator", what="stdin" if path == "-" else path)


def _solve_request(args):
    """The request to solve: the file's (or stdin's) JSON, with the flags applied on top."""
    from .cli_request import apply_flags, has_request_flags

    if args.request is None and not has_request_flags(args):
        raise SigpropError(
            "invalid_request",
            "no request: give a request file, - for stdin, or the request as flags",
            "e.g. sigprop solve --template mlp --depth 50 --method tat --activation leaky_relu --eta 0.9",
        )
    data = _read_request(args.request) if args.request is not None else None
    return apply_flags(data, args) if has_request_flags(args) else data


def cmd_solve(args) -> int:
    """Solve offline: no server, no Redis; prints exactly the answer POST /v1/solve gives
    (``--pretty``: the same JSON, indented)."""
    from .answers import prepared_json
    from .preparation import prepare_data
    from .settings import offline_limits

    try:
        answer = prepared_json(prepare_data(_solve_request(args), offline_limits()))
    except SigpropError as err:
        print(json.dumps(err.to_dict()), file=sys.stderr)
        return 2
    if args.pretty:  # key order kept: the same object, only indented
        answer = json.dumps(json.loads(answer), indent=2, ensure_ascii=False)
    sys.stdout.write(answer + "\n")
    return 0


def cmd_serve(args) -> int:
    """The HTTP service (uvicorn); settings come from SIGPROP_* environment variables."""
    if _missing_extra("serve", "server"):
        return 2
    import shutil
    import tempfile
    import threading

    from pydantic import ValidationError

    from .settings import Settings

    _expose_on_loopback(args.host)
    try:  # refuse to start on settings that cannot work, with the reason, before uvicorn starts
        settings = Settings()
    except ValidationError as exc:
        from .requests import error_path

        for err in exc.errors(include_url=False):
            where = error_path(err.get("loc", ()), "")
            name = f"SIGPROP_{where.upper()}: " if where else ""
            print(f"sigprop serve: invalid settings: {name}{err.get('msg')}", file=sys.stderr)
        return 2
    from .api.auth import weak_keys

    for setting, keys in (("SIGPROP_API_KEYS", settings.api_keys), ("SIGPROP_ADMIN_KEYS", settings.admin_keys)):
        weak = weak_keys(keys)
        if weak:
            print(f"sigprop serve: invalid settings: {setting}: {weak}", file=sys.stderr)
            return 2

    taken = _address_taken(args.host, args.port)
    if taken:
        print(f"sigprop serve: cannot listen on {_url(args)}: {taken}", file=sys.stderr)
        return 2

    if args.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Each worker is a process: point prometheus_client at a shared folder so /metrics
        # reports all of them, whichever worker answers.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sigprop-metrics-")

    trusted = ",".join(p.strip() for p in settings.trusted_proxies.split(",") if p.strip())
    if settings.metrics_port:
        try:
            _serve_metrics(args.host, settings.metrics_port, settings)
        except OSError as exc:
            print(f"sigprop serve: cannot serve /metrics on port {settings.metrics_port}: {exc}", file=sys.stderr)
            return 2
    # The ready line waits for every worker to answer (api/serve_ready.py): printed before
    # uvicorn starts, it sent the first request to a refused connection for seconds.
    from .api.serve_ready import READY_DIR_ENV, announce_when_ready

    ready_dir = tempfile.mkdtemp(prefix="sigprop-ready-")
    os.environ[READY_DIR_ENV] = ready_dir
    _say(_starting(args))
    stop = threading.Event()
    watcher = threading.Thread(
        target=announce_when_ready,
        args=(ready_dir, args.workers, args.host, args.port, _listening(args, settings), stop, _say),
        name="sigprop-serve-ready",
        daemon=True,  # a server that never starts must still exit
    )
    watcher.start()
    try:
        _run_uvicorn(args, trusted, settings.max_header_bytes)
    finally:
        stop.set()
        watcher.join(5)
        shutil.rmtree(ready_dir, ignore_errors=True)
    return 0


def _address_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None. With one worker uvicorn binds only after
    the app's start-up (seconds), and in the meantime the server already on the port (a
    ``sigprop serve`` started earlier) would answer the ready line's /healthz probe for it."""
    import socket

    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return str(exc)
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            if family == socket.AF_INET6:  # as asyncio binds: an IPv4 listener on the port is no clash
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                return str(exc)
    return None


def _say(line: str) -> None:
    """One write for the line and its newline: the workers log to the same stream, and print()'s
    two writes (unbuffered, as under PYTHONUNBUFFERED) let a log line land between them."""
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except OSError:  # nobody reads the output any more (a closed pipe): the server serves on regardless
        pass


def _run_uvicorn(args, trusted: str, max_header_bytes: int) -> None:
    import uvicorn

    from .api.server import uvicorn_options

    uvicorn.run(
        "sigprop.api.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        # parser, event loop, no Server banner, h11's buffer bound; the bench's bare app uses the same
        **uvicorn_options(args.workers, max_header_bytes),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=30,
        # X-Forwarded-For names the client only when it comes from a proxy the operator trusts
        # (uvicorn would otherwise trust it from loopback, so a local client could pick any address)
        proxy_headers=bool(trusted),
        forwarded_allow_ips=trusted or None,
    )


def _url(args) -> str:
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address goes in brackets
    return f"http://{host}:{args.port}"


def _starting(args) -> str:
    """The line ``sigprop serve`` prints at once: the address, and that it does not answer yet."""
    workers = f"{args.workers} workers" if args.workers > 1 else "1 worker"
    return f"sigprop serve: starting on {_url(args)} ({workers}); it answers once it says it listens"


def _listening(args, settings=None) -> str:
    """The line ``sigprop serve`` prints once every worker answers: where to point a client or a browser."""
    url = _url(args)
    shown = [
        f"{url}{path}{what}"
        for path, what, on in (
            ("/docs", " for the API", settings is None or settings.expose_docs),
            ("/dashboard", "", settings is None or settings.expose_dashboard),
        )
        if on
    ]
    if args.workers > 1:
        shown.append(f"{args.workers} workers")
    if settings is not None and settings.metrics_port:
        shown.append(f"/metrics on port {settings.metrics_port}")
    return f"sigprop serve: listening on {url}" + (f" ({', '.join(shown)})" if shown else "")


def _expose_on_loopback(host: str) -> None:
    """On a loopback address, a developer's own machine, the docs, the dashboard and /metrics are
    on unless the settings say otherwise; on any other they are off unless turned on (api/exposure.py).
    Set in the environment, which uvicorn's worker processes inherit and read their settings from."""
    if _is_loopback(host):
        for name in ("SIGPROP_EXPOSE_DOCS", "SIGPROP_EXPOSE_DASHBOARD", "SIGPROP_EXPOSE_METRICS"):
            os.environ.setdefault(name, "true")


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _serve_metrics(host: str, port: int, settings) -> None:
    """``/metrics`` on a port of its own, from this (the supervising) process: every worker's
    metrics through the shared folder, or this process's own with one worker, which serves here.
    A uvicorn server with the API's deadlines, connection cap and header limit (api/server.py)."""
    from prometheus_client import REGISTRY, CollectorRegistry, make_asgi_app, multiprocess

    from .api.server import serve_metrics

    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    serve_metrics(make_asgi_app(registry=registry), host, port, settings)


def cmd_worker(args) -> int:
    """A validation-training worker (RQ) on the Redis at SIGPROP_REDIS_URL."""
    if _missing_extra("worker", "worker"):
        return 2
    from .settings import get_settings

    settings = get_settings()
    if not settings.redis_url:
        print(
            json.dumps(
                SigpropError(
                    "invalid_request",
                    "sigprop worker needs a Redis: SIGPROP_REDIS_URL is not set",
                    "set SIGPROP_REDIS_URL to the Redis `sigprop serve` uses; without Redis, "
                    "`sigprop serve` runs validations itself",
                ).to_dict()
            ),
            file=sys.stderr,
        )
        return 2
    if args.check:
        from .worker.worker import check_worker

        healthy, found = check_worker(settings)
        print(f"sigprop worker --check: {found}", file=sys.stdout if healthy else sys.stderr)
        return 0 if healthy else 1
    from .worker.worker import run_worker

    run_worker(settings, queues=args.queue or None, burst=args.burst, name=args.name)
    return 0


def cmd_schema(args) -> int:
    """Print the JSON Schema of the graph, the solve request or the answer."""
    from .schemas import Graph, Solution, SolveRequest

    model = {"graph": Graph, "request": SolveRequest, "solution": Solution}[args.which]
    print(json.dumps(model.model_json_schema(by_alias=True), indent=2, sort_keys=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``sigprop`` command line and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="sigprop", description="Shape deep networks: TAT, DKS, EOC solvers for any architecture graph."
    )
    parser.add_argument("--version", action="version", version=f"sigprop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _add_command(
        sub,
        "solve",
        cmd_solve,
        help="solve a request offline and print the answer JSON",
        description="Solve a request offline (no server, no Redis) and print the answer POST /v1/solve gives. "
        "The request is a JSON file, stdin (-), or flags: sigprop solve --template mlp --depth 50 "
        "--method tat --activation leaky_relu --eta 0.9",
    )
    p.add_argument("request", nargs="?", help="path to a request JSON file, or - for stdin (optional with flags)")
    p.add_argument("--pretty", action="store_true", help="indent the answer JSON (default: one line, as served)")
    add_request_flags(p)

    p = _add_command(
        sub,
        "serve",
        cmd_serve,
        help="run the HTTP service (POST /v1/solve and friends)",
        description="Run the HTTP service. Settings come from environment variables (listed below).",
        epilog=settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--workers", type=int, default=1, help="API processes (default 1)")

    p = _add_command(sub, "worker", cmd_worker, help="run a validation-training worker (needs SIGPROP_REDIS_URL)")
    p.add_argument("--burst", action="store_true", help="quit once the queue is empty")
    p.add_argument(
        "--queue",
        action="append",
        metavar="NAME",
        help="queue to listen on (repeatable; default SIGPROP_VALIDATION_QUEUE, sigprop-validations)",
    )
    p.add_argument("--name", default=None, help="worker name (default: random)")
    p.add_argument(
        "--check",
        action="store_true",
        help="health check: exit 0 when Redis answers and a worker of this host is registered, else 1",
    )

    p = _add_command(sub, "schema", cmd_schema, help="print a JSON Schema (graph, request or solution)")
    p.add_argument("which", choices=["graph", "request", "solution"])
    return parser


def _add_command(sub, name: str, func, **kwargs) -> argparse.ArgumentParser:
    p = sub.add_parser(name, **kwargs)
    p.set_defaults(func=func, command_parser=p)  # main() reports arguments it does not know with its usage
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line. argparse reports an argument that no parser took from the top
    parser, with the list of subcommands for usage (``sigprop solve --activaton tanh``); after a
    subcommand it belongs to that subcommand, whose usage (and the flag it was likely meant to be)
    is what helps."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    if not unknown:
        return args
    # the top parser's own options take no values, so anything before the subcommand's name is its
    before = argv[: argv.index(args.command)] if args.command in argv else argv
    owner = parser if any(arg in before for arg in unknown) else args.command_parser
    message = f"unrecognized arguments: {' '.join(unknown)}"
    known = re.findall(r"--[A-Za-z][\w-]*", owner.format_usage())
    for arg in unknown:
        close = difflib.get_close_matches(arg.partition("=")[0], known, n=1) if arg.startswith("--") else []
        if close:
            message += f" (did you mean {close[0]}?)"
            break
    owner.error(message)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, so a closed pipe is noticed inside the try, not at exit
    except BrokenPipeError:
        return _closed_pipe()
    return code


def _closed_pipe() -> int:
    """The reader went away (``sigprop schema request | head -1``): stop quietly, as Unix tools do.

    stdout is pointed at /dev/null so that Python's own flush at exit does not raise again, and the
    exit status is the shell's for a process ended by SIGPIPE (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
