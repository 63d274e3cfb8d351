"""``sigprop.solve``: the in-process entry point answers what ``sigprop solve`` prints, in both call
forms, and refuses bad input with the same ``SigpropError`` as the service."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import sigprop
from sigprop.cli import main
from sigprop.schemas.errors import SigpropError
from sigprop.schemas.solve import Solution

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tat_leaky_relu_mlp.json"


def _cli_answer(capsys) -> dict:
    assert main(["solve", str(EXAMPLE)]) == 0
    return json.loads(capsys.readouterr().out)


def test_whole_request_equals_the_cli_answer(capsys):
    request = json.loads(EXAMPLE.read_text())
    expected = _cli_answer(capsys)
    for form in (request, EXAMPLE.read_text(), EXAMPLE.read_bytes()):
        sol = sigprop.solve(form)
        assert isinstance(sol, Solution)
        assert sol.model_dump(mode="json", by_alias=True) == Solution.model_validate(expected).model_dump(
            mode="json", by_alias=True
        )


def test_graph_form_equals_the_whole_request():
    request = json.loads(EXAMPLE.read_text())
    whole = sigprop.solve(request)
    parts = sigprop.solve(request["graph"], request["method"], request["activation"], request["targets"])
    assert parts.key == whole.key
    assert parts.negative_slope == whole.negative_slope
    assert parts.c_f_0 == pytest.approx(request["targets"]["eta"], abs=1e-12)


def test_bad_input_raises_the_contract_error():
    with pytest.raises(SigpropError) as err:
        sigprop.solve({"template": "mlp", "depth": 5}, "tat", "leaky_relu", {"eta": 2.0})
    assert err.value.code == "invalid_target" and err.value.hint
    with pytest.raises(SigpropError) as err:
        sigprop.solve('{"graph": {"template": "mlp"}, "method": "tat", "activation": "tanh", "targets": {"tau": NaN}}')
    assert err.value.code == "invalid_target"
    with pytest.raises(SigpropError) as err:
        sigprop.solve({"template": "mlp", "depth": 5}, "tat", None)
    assert err.value.code == "invalid_request"
    with pytest.raises(TypeError):
        sigprop.solve({"template": "mlp"}, None, "tanh")


def test_the_package_root_stays_numpy_free():
    code = "import sys, sigprop; assert 'numpy' not in sys.modules, 'numpy imported by the package root'"
    subprocess.run([sys.executable, "-c", code], check=True)
