"""The command line for people: ``sigprop solve`` from flags and ``--pretty``, ``sigprop
serve --help`` listing every setting, ``serve`` saying where it listens, quiet broken pipes."""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from sigprop.cli import main
from sigprop.settings import Settings

from ..service_fixtures import LOOPBACK, SERVER_START_TIMEOUT_S, Service, free_port, service_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tat_leaky_relu_mlp.json"
FLAGS = ["--template", "mlp", "--depth", "50", "--method", "tat", "--activation", "leaky_relu", "--eta", "0.9"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["solve", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- solve ----------------------------------------------------------------------------------------


def test_flags_write_the_same_request_as_the_example_file(capsys):
    code, from_file, _ = _run(capsys, str(EXAMPLE))
    assert code == 0
    code, from_flags, err = _run(capsys, *FLAGS, "--width", "512")
    assert code == 0, err
    assert from_flags == from_file  # byte for byte: the same request, the same answer


def test_pretty_indents_the_same_answer(capsys):
    _, compact, _ = _run(capsys, *FLAGS)
    code, pretty, _ = _run(capsys, *FLAGS, "--pretty")
    assert code == 0 and pretty.startswith('{\n  "key": ')
    assert json.loads(pretty) == json.loads(compact)
    assert list(json.loads(pretty)) == list(json.loads(compact))  # key order kept


def test_param_values_are_json(capsys):
    code, out, err = _run(
        capsys, *FLAGS, "--param", "input_shape=[1,8,8]", "--param", "classes=10", "--param", "bias=false"
    )
    assert code == 0, err
    layers = json.loads(out)["layers"]
    assert layers[0]["fan_in"] == 64 and all(la["bias"] == "none" for la in layers)


@pytest.mark.parametrize(
    "flag,value,key",
    [("--tau", "0.5", "tau"), ("--q-star", "1.5", "q_star"), ("--local-q-slope", "1.0", "local_q_slope")],
)
def test_every_target_has_a_flag(capsys, flag, value, key):
    method = {"tau": ["tat", "tanh"], "q_star": ["eoc", "tanh"], "local_q_slope": ["dks", "tanh"]}[key]
    argv = ["--template", "mlp", "--depth", "10", "--method", method[0], "--activation", method[1], flag, value]
    if key == "local_q_slope":
        argv += ["--zeta", "1.5"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert json.loads(out)["targets"][key] == float(value)


def test_flags_override_a_request_file(capsys):
    code, out, err = _run(capsys, str(EXAMPLE), "--eta", "0.5", "--depth", "20")
    assert code == 0, err
    answer = json.loads(out)
    assert answer["targets"] == {"eta": 0.5} and answer["graph_summary"]["depth"] == 20


@pytest.mark.parametrize(
    "argv,what",
    [
        ([], "no request"),
        (["--depth", "5", "--method", "tat"], "no template"),
        (["--template", "mlp", "--param", "depth"], "NAME=VALUE"),
        (["--template", "mlp", "--depth", "5", "--method", "tat", "--activation", "LeakyReLU"], "leaky_relu"),
    ],
)
def test_incomplete_flags_are_refused_with_the_error_object(capsys, argv, what):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    error = json.loads(err)["error"]
    assert what in error["message"] + error["hint"], error


def test_solve_help_lists_every_template(capsys):
    from sigprop.engine.templates.expand import TEMPLATES

    with pytest.raises(SystemExit):
        main(["solve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help wraps lines: compare whitespace-folded
    listed = re.search(r"--template TEMPLATE graph template: ([\w, ]+) \(", text)
    assert listed, text
    assert listed.group(1).split(", ") == list(TEMPLATES)


@pytest.mark.parametrize(
    "argv,usage,said",
    [
        # after the subcommand: its usage, and the flag meant
        (["solve", "--activaton", "tanh"], "usage: sigprop solve ", "--activaton (did you mean --activation?)"),
        (["schema", "graph", "--pretty"], "usage: sigprop schema ", "unrecognized arguments: --pretty"),
        (["serve", "--bogus"], "usage: sigprop serve ", "unrecognized arguments: --bogus"),
        # before it: the top parser's
        (["--bogus", "solve"], "usage: sigprop [-h]", "sigprop: error: unrecognized arguments: --bogus"),
    ],
)
def test_an_unknown_flag_is_reported_with_the_usage_of_the_command_it_follows(capsys, argv, usage, said):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(usage) and said in err, err


# -- serve ----------------------------------------------------------------------------------------


def test_serve_help_lists_every_setting_with_its_environment_variable(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help wraps lines: compare whitespace-folded
    for name, info in Settings.model_fields.items():
        assert f"SIGPROP_{name.upper()} (default: " in text, name
        assert info.description and " ".join(info.description.split()) in text, name


def _serve_until_ready(tmp_path: Path, workers: int) -> tuple[Service, list[tuple[float, str]]]:
    """``sigprop serve`` on a free loopback port (solver processes and the embedded store, as a
    newcomer runs it), read until its ready line: the lines it printed, each with the monotonic
    time it was read. A start that lost its port to another process is retried on another."""
    env = service_env({"SIGPROP_DATA_DIR": str(tmp_path / "data")})
    for _attempt in range(3):
        port = free_port()
        log_path = tmp_path / f"serve-{port}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "sigprop.cli", "serve", "--host", LOOPBACK, "--port", str(port)]
            + ["--workers", str(workers)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        svc = Service(proc, port, log_path, env, workers)
        lines: queue.Queue = queue.Queue()

        def read(out=proc.stdout, log_path=log_path, lines=lines):
            with out, open(log_path, "wb") as log:  # svc.log() shows it when an assertion fails
                for raw in out:
                    lines.put((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))
                    log.write(raw)
                    log.flush()
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        seen: list[tuple[float, str]] = []
        deadline = time.monotonic() + 2 * SERVER_START_TIMEOUT_S
        while not seen or "listening on" not in seen[-1][1]:
            try:
                item = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                item = None
            if item is None:
                break
            seen.append(item)
        if seen and "listening on" in seen[-1][1]:
            return svc, seen
        svc.stop()
        text = "\n".join(line for _, line in seen)
        if "address already in use" not in text.lower():
            raise AssertionError(f"no ready line from sigprop serve --workers {workers}:\n{text}")
    raise AssertionError("sigprop serve lost its port three times")


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_says_it_listens_once_every_worker_answers(tmp_path, workers):
    """The ready line comes once /healthz answers (it used to come seconds before uvicorn
    accepted a connection), after a line with the address at once and one while the solver
    processes start; the address it names is the one it serves on."""
    # made before the server starts: a client's set-up (its TLS context) is not the server's time
    client = httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0))
    svc, seen = _serve_until_ready(tmp_path, workers)
    try:
        read_at, line = seen[-1]
        match = re.fullmatch(r"sigprop serve: listening on (http://\S+) \(.*\)", line)
        assert match and match.group(1) == svc.base_url, line
        response = client.get(match.group(1) + "/healthz")
        elapsed = time.monotonic() - read_at
        assert response.status_code == 200 and elapsed < 0.1, (response.status_code, elapsed, svc.log())
        # every connection after it is answered too, whichever worker takes it, and by a warm one
        for _ in range(4 * workers):
            assert client.get(svc.base_url + "/readyz").status_code == 200, svc.log()
        said = [text for _, text in seen[:-1]]
        assert any(text.startswith(f"sigprop serve: starting on {svc.base_url} ") for text in said), said
        assert any(text.startswith("sigprop serve: starting the solver processes") for text in said), said
    finally:
        client.close()
        svc.stop()


def test_the_ready_line_waits_for_every_worker(tmp_path):
    """A /healthz that answers is not enough with two workers: the line waits until two live
    processes have marked themselves ready (a dead one's marker does not count), and says how
    many are ready meanwhile."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from sigprop.api.serve_ready import announce_when_ready

    class Healthz(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/healthz" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "ready"
    folder.mkdir()
    for pid in (os.getpid(), dead.pid):
        (folder / f"{pid}.ready").touch()
    said: list[str] = []
    stop = threading.Event()
    with ThreadingHTTPServer((LOOPBACK, 0), Healthz) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        watcher = threading.Thread(
            target=announce_when_ready, args=(str(folder), 2, LOOPBACK, port, "READY", stop, said.append)
        )
        watcher.start()
        try:
            time.sleep(0.5)
            assert said == ["sigprop serve: 1 of 2 workers ready ..."]
            (folder / f"{os.getppid()}.ready").touch()  # a second live process
            watcher.join(10)
            assert said[-1] == "READY" and not watcher.is_alive(), said
        finally:
            stop.set()
            watcher.join(5)
            server.shutdown()
    assert not folder.exists()  # removed once said: a server stopped later by a signal leaves nothing


def test_serve_on_a_taken_port_says_so_at_once(tmp_path):
    """Not after the app's seconds of start-up, and never with a ready line: the server already on
    the port would answer the /healthz probe that the line waits for."""
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "sigprop.cli", "serve", "--host", LOOPBACK, "--port", str(port)],
            env=service_env({"SIGPROP_DATA_DIR": str(tmp_path)}),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert f"cannot listen on http://{LOOPBACK}:{port}" in proc.stderr, proc.stderr
    assert "address already in use" in proc.stderr.lower(), proc.stderr


# -- broken pipes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["schema", "request"], ["solve", "--template", "mlp", "--depth", "3", "--method", "eoc", "--activation", "tanh"]],
)
def test_a_closed_pipe_ends_quietly(argv):
    """``sigprop schema request | head -1``: the reader is gone before sigprop writes (its read end
    is closed at once here, so the write meets EPIPE whatever the pipe's size or timing)."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sigprop.cli", *argv], stdout=write_end, stderr=subprocess.PIPE, text=True
    )
    os.close(write_end)
    os.close(read_end)
    _, err = proc.communicate(timeout=120)
    assert err == "", err  # no traceback, no "Exception ignored"
    assert proc.returncode == 141  # the shell's status for a writer whose reader left (128 + SIGPIPE)
