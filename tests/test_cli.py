"""The command line for people: ``sigprop solve`` from flags and ``--pretty``, ``sigprop
serve --help`` listing every setting, ``serve`` saying where it listens, quiet broken pipes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sigprop.cli import main
from sigprop.settings import Settings

from .service_fixtures import start_service

ROOT = Path(__file__).resolve().parents[1]
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


# -- serve ----------------------------------------------------------------------------------------


def test_serve_help_lists_every_setting_with_its_environment_variable(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help wraps lines: compare whitespace-folded
    for name, info in Settings.model_fields.items():
        assert f"SIGPROP_{name.upper()} (default: " in text, name
        assert info.description and " ".join(info.description.split()) in text, name


def test_serve_prints_the_address_it_listens_on(tmp_path):
    svc = start_service(tmp_path, {"SIGPROP_DATA_DIR": str(tmp_path / "data"), "SIGPROP_SOLVE_PROCESSES": "0"})
    try:
        match = re.search(r"sigprop serve: listening on (http://\S+) ", svc.log())
        assert match, svc.log()
        assert match.group(1) == svc.base_url
        assert httpx.get(match.group(1) + "/healthz", timeout=10).status_code == 200
    finally:
        svc.stop()


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
